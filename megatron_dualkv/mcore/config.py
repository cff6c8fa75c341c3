"""``DualKVTransformerConfig``: Megatron-Core's ``TransformerConfig`` plus this library's settings,
the config class of every model family (``ModelFamily.config_class``)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class DualKVTransformerConfig(TransformerConfig):
    """``TransformerConfig`` with our selective activation recompute (``mcore.recompute``; set all
    three through ``build_model(recompute="selective")``). They act in the layers of our local and
    Gemma specs that Megatron does not recompute whole (``recompute_granularity="full"``), in
    training under autograd, and are independent of Megatron's ``recompute_modules``."""

    recompute_norms: bool = False
    """Free the outputs of each layer's input and pre-MLP norms once ``linear_qkv`` / the MLP (its
    ``linear_fc1``, a MoE layer's router and token permutation) have saved them, and recompute them
    in the backward: per token and layer, 2 x hidden_size values fewer kept."""

    recompute_qk_norm_rope: bool = False
    """Compute q and k (reshape, q/k norm, RoPE) as functions of their views of ``linear_qkv``'s
    output, free them once the attention has saved them, and recompute them in the backward
    (``DualKVSelfAttention``): per token and layer, the q norm's input (a copy of q), the rotated q
    and k, RoPE's cos/sin and the q/k norms' statistics fewer kept (2 x heads + query groups head
    vectors, 4 head dims, heads + query groups fp32 values). A field of its own rather than part of
    ``recompute_norms``: RoPE is no norm, a model without q/k norms still rotates, and each can be
    measured without the other."""

    recompute_activations: bool = False
    """Free the MLP activation output (SwiGLU, Gemma's GeGLU; a MoE layer's routed experts' SwiGLU,
    not its shared experts') once ``linear_fc2`` has saved it, and recompute it in the backward: per
    token and layer, ffn_hidden_size values fewer kept (per token routed to an expert,
    moe_ffn_hidden_size, plus the unfused SwiGLU's intermediates)."""
