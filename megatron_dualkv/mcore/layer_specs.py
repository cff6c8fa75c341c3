"""Layer specs: Megatron-Core's own GPT block specs with ``DualKVAttention`` as core attention.

Everything else (linears, norms, MLP or MoE, the dense/MoE layer pattern of
``config.moe_layer_freq``, the layers of this pipeline stage) is whatever Megatron's
``get_gpt_decoder_block_spec`` builds from the ``TransformerConfig``; only the core-attention
submodule (and in the local spec, the modules below) is swapped, through ``ModuleSpec`` copies,
never by patching Megatron.

* ``dualkv_local_block_spec``: torch-native modules (ColumnParallelLinear, torch RMSNorm,
  SequentialMLP experts as ``GroupedMMExperts``, or legacy GroupedMLP when the grouped_gemm
  package is installed; MoE layers as ``GatheredPermutationMoELayer``);
  runs on CPU and GPU. Its torch norms are ``SequenceParallelTorchNorm`` (``mcore.norms``), so it
  also runs under sequence parallelism. Its layers are ``DualKVTransformerLayer``s, which run the
  selective recompute of ``mcore.recompute``, with ``DualKVSelfAttention`` (its own q/k norms and
  RoPE, fused where it can) and, with ``recompute_activations``, ``DualKVMLP``.
* ``dualkv_te_block_spec``: Transformer Engine linears and norms (LayerNorm fused into the QKV
  and FC1 linears, TEGroupedMLP experts); only when transformer_engine imports. Megatron's own
  layers: our selective recompute does not apply (TE's is Megatron's ``recompute_modules``).
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from .attention import DualKVAttention
from .experts import with_grouped_mm_experts
from .mlp import with_dualkv_mlp
from .moe_layer import with_gathered_permutation
from .norms import with_sequence_parallel_torch_norms
from .recompute import DualKVTransformerLayer
from .self_attention import DualKVSelfAttention


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def dualkv_local_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Megatron's local (torch-native) GPT block spec with DualKV core attention."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    # Megatron's local block picks apex FusedLayerNorm for the final norm whenever apex imports,
    # and FusedLayerNorm rejects RMSNorm; the torch norm follows config.normalization.
    block = replace(block, layer_norm=WrappedTorchNorm)
    block = replace(block, layer_specs=[_local_layer(spec, config) for spec in block.layer_specs])
    return _with_dualkv_attention(with_sequence_parallel_torch_norms(block), DualKVSelfAttention)


def dualkv_te_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Megatron's Transformer Engine GPT block spec with DualKV core attention."""
    if not transformer_engine_available():
        raise ImportError("dualkv_te_block_spec needs transformer_engine; use dualkv_local_block_spec without it")
    return _with_dualkv_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage))


def _with_dualkv_attention(block: TransformerBlockSubmodules, self_attention: type = SelfAttention):
    """The block's layers with DualKV core attention in ``self_attention`` (Megatron's SelfAttention
    or a subclass)."""
    layers = [_layer_with_dualkv_attention(spec, self_attention) for spec in block.layer_specs]
    return replace(block, layer_specs=layers)


def _local_layer(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """Megatron's local layer as ``DualKVTransformerLayer``, with our MoE modules (and ``DualKVMLP``
    where the activation is recomputed)."""
    if layer.module is not TransformerLayer:
        raise ValueError(f"the local DualKV spec builds on Megatron's TransformerLayer, got {layer.module.__name__}")
    mlp = with_gathered_permutation(with_grouped_mm_experts(layer.submodules.mlp))
    if getattr(config, "recompute_activations", False):
        mlp = with_dualkv_mlp(mlp)
    return replace(layer, module=DualKVTransformerLayer, submodules=replace(layer.submodules, mlp=mlp))


def _layer_with_dualkv_attention(layer: ModuleSpec, self_attention: type) -> ModuleSpec:
    attention = layer.submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(f"DualKV layer specs replace the core attention of SelfAttention, got {attention.module.__name__}")
    attention = replace(attention, module=self_attention,
                        submodules=replace(attention.submodules, core_attention=DualKVAttention))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))
