"""Hybrid decoders (Qwen3.5, Qwen3-Next): Gated DeltaNet layers between full-attention layers, as
a ``GPTModel`` whose block holds two kinds of ``TransformerLayer``.

Both kinds are Megatron's ``TransformerLayer`` (pre-norm, residual adds, the MLP or MoE of the
local spec): only the token mixer in the self-attention slot differs, a ``DualKVGatedDeltaNet``
or a ``DualKVSelfAttention`` with the output gate (``attention_output_gate``) and partial RoPE.
So the model stays a ``GPTModel`` (embedding, RoPE table, output layer, pipeline stages) rather
than Megatron's ``HybridModel``/``MambaModel``, whose layer allocation and stack are built for
Mamba mixers and have no DualKV attention. The norms are zero-centred (``1 + w``, in float32), as
transformers' ``Qwen3_5RMSNorm`` / ``Qwen3NextRMSNorm``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .config import DualKVTransformerConfig
from .gated_delta_net import DualKVGatedDeltaNet, GatedDeltaNetSubmodules
from .gemma import GemmaRMSNorm
from .layer_specs import dualkv_local_block_spec
from .recompute import DualKVTransformerLayer

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class HybridTransformerConfig(DualKVTransformerConfig):
    """``TransformerConfig`` plus each layer's type (transformers' ``layer_types``): its GDN sizes
    are Megatron's ``linear_*`` fields."""

    layer_types: Tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types must give each of the {self.num_layers} layers one of {LAYER_TYPES}, "
                             f"got {len(self.layer_types)} entries" + (f" with {unknown}" if unknown else ""))

    def check_parallel_sizes(self, sizes) -> None:
        """ValueError for a split the GDN layers cannot take: tensor parallelism and then Ulysses
        context parallelism each give a rank whole key heads (with the value heads they serve)."""
        split = sizes.tp * sizes.cp
        if "linear_attention" in self.layer_types and self.linear_num_key_heads % split:
            raise ValueError(f"linear_num_key_heads ({self.linear_num_key_heads}) is not divisible by tp*cp "
                             f"({split}): tensor parallelism and then Ulysses context parallelism split the Gated "
                             "DeltaNet key heads")

    def is_linear_attention(self, layer_number: int) -> bool:
        """``layer_number``: 1-based over the whole model, as Megatron numbers layers."""
        return self.layer_types[layer_number - 1] == "linear_attention"


class GatedDeltaNetLayer(DualKVTransformerLayer):
    """A ``DualKVTransformerLayer`` whose mixer is a GDN: its selective recompute frees the norm
    outputs and the MLP activation, and in the mixer the gated norm's output (with the norms) and
    the conv's (with the activations); it has no q/k norms or RoPE to recompute."""

    def _recompute_norm_outputs(self) -> None:
        super()._recompute_norm_outputs()
        self.self_attention.recompute_gated_norm = True

    def _recompute_query_key(self) -> None:
        return None

    def _recompute_activation(self) -> None:
        super()._recompute_activation()
        self.self_attention.recompute_conv = True


def hybrid_block_spec(config: HybridTransformerConfig, use_transformer_engine: bool = False,
                      vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """The local spec's layers of this pipeline stage (dense MLP or MoE as the config says) with
    zero-centred norms, and a GDN in the self-attention slot of the linear-attention layers."""
    if use_transformer_engine:
        raise ValueError("the hybrid (Gated DeltaNet) models have no Transformer Engine spec yet: build them with "
                         "use_transformer_engine=False (--transformer-engine off)")
    block = dualkv_local_block_spec(config, vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage)
    layers = [_hybrid_layer(spec, config.is_linear_attention(offset + i + 1)) for i, spec in enumerate(block.layer_specs)]
    return replace(block, layer_specs=layers, layer_norm=GemmaRMSNorm)


def _hybrid_layer(layer: ModuleSpec, linear_attention: bool) -> ModuleSpec:
    submodules = replace(layer.submodules, input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm)
    if not linear_attention:
        attention = layer.submodules.self_attention
        attention = replace(attention, submodules=replace(attention.submodules, q_layernorm=GemmaRMSNorm,
                                                          k_layernorm=GemmaRMSNorm))
        return replace(layer, submodules=replace(submodules, self_attention=attention))
    mixer = ModuleSpec(module=DualKVGatedDeltaNet,
                       submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    return replace(layer, module=GatedDeltaNetLayer, submodules=replace(submodules, self_attention=mixer))
