"""``DualKVTransformerConfig``: Megatron-Core's ``TransformerConfig`` plus this library's settings,
the config class of every model family (``ModelFamily.config_class``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class DualKVTransformerConfig(TransformerConfig):
    """``TransformerConfig`` with our selective activation recompute (``mcore.recompute``; set all
    three through ``build_model(recompute="selective")``) and the YaRN RoPE parameters Megatron's
    ``GPTModel`` expects of its config. The recompute fields act in the layers of our local and
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

    offload_layers: int = 0
    """The saved tensors of the first N layers of every pipeline stage (model chunk) wait in page-locked
    host memory from each layer's forward to its backward, copied out and back on side streams beside
    the kernels (``mcore.offload``); selective recompute still runs inside them. Set through
    ``build_model(recompute="offload", recompute_layers=N)``."""

    offload_min_bytes: int = 1 << 20
    """Offloaded layers leave storages smaller than this on the device (index tables, norms' statistics:
    not worth a copy); Megatron's ``min_offloaded_tensor_size``."""

    prefix_reuse_prompt_on_host: bool = False
    """Prefix reuse (``rl.prefix_reuse``): what the held prompt's forward saves for its backward waits
    in page-locked host memory while the response parts run (``rl.host_stash``: pieces at their own
    sizes, parameters left in place), and its backward copies each tensor back when it needs it. For
    prompts whose saved activations, with the held K/V and their gradients, would not fit beside a
    part (``MemoryModel``'s ``prompt_on_host``)."""

    # YaRN RoPE (position_embedding_type="yarn"): Megatron's GPTModel reads these fields by name
    # without defaults, and its attention applies the attention factor ("mscale") they give to cos
    # and sin. The defaults give a factor of 1, which leaves plain RoPE unchanged.
    yarn_rotary_scaling_factor: float = 1.0
    """How many times the original context the positions are stretched over (YaRN's s)."""

    yarn_original_max_position_embeddings: int = 4096
    """The context the model was pretrained with; which frequencies are interpolated depends on it."""

    yarn_beta_fast: float = 32.0
    """Dimensions turning more than this many times over the original context keep their frequency."""

    yarn_beta_slow: float = 1.0
    """Dimensions turning fewer times than this are interpolated by the whole factor; between the
    two betas the frequency ramps linearly."""

    yarn_mscale: Optional[float] = None
    """With ``yarn_mscale_all_dim``: attention factor ``(0.1 mscale ln s + 1) / (0.1 mscale_all_dim
    ln s + 1)``; None (either one): ``0.1 ln s + 1``."""

    yarn_mscale_all_dim: Optional[float] = None

    yarn_correction_range_round_to_int: bool = True
    """Round the ramp's dimension bounds outward to integers (transformers' ``truncate``)."""
