"""Layer specs: Megatron-Core's own GPT block specs with ``DualKVAttention`` as core attention.

Everything else (linears, norms, MLP or MoE, the dense/MoE layer pattern of
``config.moe_layer_freq``, the layers of this pipeline stage) is whatever Megatron's
``get_gpt_decoder_block_spec`` builds from the ``TransformerConfig``; only the core-attention
submodule (and the modules below) is swapped, through ``ModuleSpec`` copies, never by patching
Megatron. In both specs the layers are ``DualKVTransformerLayer``s, which run the selective
recompute of ``mcore.recompute``, with ``DualKVSelfAttention`` (its own q/k norms and RoPE, fused
where it can) and, with ``recompute_activations``, ``DualKVMLP``.

* ``dualkv_local_block_spec``: torch-native modules (ColumnParallelLinear, torch RMSNorm,
  SequentialMLP experts as ``GroupedMMExperts``, or legacy GroupedMLP when the grouped_gemm
  package is installed; MoE layers as ``GatheredPermutationMoELayer``);
  runs on CPU and GPU. Its torch norms are ``SequenceParallelTorchNorm`` (``mcore.norms``), so it
  also runs under sequence parallelism.
* ``dualkv_te_block_spec``: Transformer Engine's linears (FP8-capable), with the input and
  pre-MLP norms fused into ``linear_qkv`` and ``linear_fc1`` (``TELayerNormColumnParallelLinear``),
  and TE's grouped-GEMM experts (``TEGroupedMLP``); only when transformer_engine imports. Where TE
  cannot do what a layer needs, ours stay (``te_layer``): the q/k norms are ours, because the
  fused q/k norm + RoPE kernel reads their weights; with ``recompute_norms`` the input and pre-MLP
  norms are ours in front of TE's plain linears, because a fused norm's output lives inside TE's
  linear and cannot be freed; the dense MLP's activation is ``DualKVMLP``'s; TE's experts
  recompute their activation with Megatron's own ``moe_act`` mechanism (``mcore.recompute``).

Both specs store a checkpoint under the same keys: the TE layers carry the local layers'
``sharded_state_dict_keys_map`` (Megatron's: the input and pre-MLP norms under the names of
their fused TE form), and Megatron's ``TEGroupedMLP`` and ``SequentialMLP`` share their experts' keys.
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
from .norms import SequenceParallelTorchNorm, with_sequence_parallel_torch_norms
from .recompute import DualKVTransformerLayer
from .self_attention import DualKVSelfAttention
from .spec_entries import submodules_of, with_submodules


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
    """Megatron's Transformer Engine GPT block spec with DualKV core attention and ours where TE
    cannot do what the layer needs (the module docstring)."""
    require_transformer_engine("dualkv_te_block_spec")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    block = replace(block, layer_specs=[te_layer(spec, config) for spec in block.layer_specs])
    return _with_dualkv_attention(block, DualKVSelfAttention)


def require_transformer_engine(what: str) -> None:
    """ImportError naming ``what`` when transformer_engine does not import (it needs CUDA to build)."""
    if not transformer_engine_available():
        raise ImportError(f"{what} needs Transformer Engine (transformer_engine), which is not installed; "
                          "use the local spec (use_transformer_engine=False, --transformer-engine off)")


# Megatron's local GPT layer stores its input and pre-MLP norms under the names of their fused TE form
LOCAL_SHARDED_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                      "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def te_layer(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """Megatron's TE layer as ``DualKVTransformerLayer``, with our norms wherever a norm stands
    alone (the q/k norms, a MoE layer's pre-MLP norm; with ``recompute_norms`` the input and
    pre-MLP norms too, in front of TE's plain linears), ``DualKVMLP`` where the activation is
    recomputed, and the local layer's checkpoint keys."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    if layer.module is not TransformerLayer:
        raise ValueError(f"the TE DualKV spec builds on Megatron's TransformerLayer, got {layer.module.__name__}")
    layer = with_sequence_parallel_torch_norms(layer, replacing=_te_norm_classes())
    submodules = layer.submodules
    attention, mlp = submodules.self_attention, with_gathered_permutation(submodules.mlp)
    norms = {}
    if getattr(config, "recompute_norms", False):
        attention = replace(attention, submodules=replace(attention.submodules, linear_qkv=TEColumnParallelLinear))
        norms["input_layernorm"] = SequenceParallelTorchNorm
        mlp_submodules = submodules_of(mlp)
        if getattr(mlp_submodules, "linear_fc1", None) is not None:  # a dense MLP: its fc1 had the norm fused in
            mlp = with_submodules(mlp, replace(mlp_submodules, linear_fc1=TEColumnParallelLinear))
            norms["pre_mlp_layernorm"] = SequenceParallelTorchNorm
    if getattr(config, "recompute_activations", False):
        mlp = with_dualkv_mlp(mlp)
    submodules = replace(submodules, self_attention=attention, mlp=mlp, **norms,
                         sharded_state_dict_keys_map={**submodules.sharded_state_dict_keys_map, **LOCAL_SHARDED_KEYS})
    return replace(layer, module=DualKVTransformerLayer, submodules=submodules)


def _te_norm_classes() -> tuple:
    """The standalone norms of Megatron's TE spec: ``TENorm``, and on megatron-core 0.19 its
    residual-fusing form."""
    from megatron.core.extensions import transformer_engine, transformer_engine_spec_provider

    residual = getattr(transformer_engine_spec_provider, "_TENormWithResidual", None)
    return (transformer_engine.TENorm,) + ((residual,) if residual is not None else ())


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
