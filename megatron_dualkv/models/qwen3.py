"""Qwen3 (dense) and Qwen3-MoE: card fields -> Megatron-Core ``TransformerConfig`` and ``GPTModel``.

Architecture (Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``): pre-norm RMSNorm
decoder, GQA with per-head RMSNorm on q and k (QK-norm), no linear biases, RoPE, SwiGLU MLP; the
MoE variant replaces the MLP by a softmax-routed top-k mixture of SwiGLU experts without a shared
expert. ``norm_topk_prob`` renormalises the top-k softmax probabilities, which is Megatron's
top-k-then-softmax (``moe_router_pre_softmax=False``): ``softmax(l)_i / sum_topk softmax(l)_j =
exp(l_i) / sum_topk exp(l_j)``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch.nn.functional as F

from .cards import ModelCard
from .family import ModelFamily, card_field


def qwen3_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    hidden_act = card_field(card, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"model card {card.name!r}: Qwen3 uses SwiGLU (hidden_act='silu'), got {hidden_act!r}")
    num_layers = card_field(card, "num_hidden_layers")
    num_heads = card_field(card, "num_attention_heads")
    hidden_size = card_field(card, "hidden_size")
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_query_groups=card_field(card, "num_key_value_heads", None) or num_heads,
        kv_channels=card_field(card, "head_dim", None) or hidden_size // num_heads,
        ffn_hidden_size=card_field(card, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=card_field(card, "rms_norm_eps", 1e-6),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=card_field(card, "attention_bias", False),
        hidden_dropout=0.0,
        attention_dropout=card_field(card, "attention_dropout", 0.0),
        init_method_std=card_field(card, "initializer_range", 0.02),
    )
    window, sliding_layers = _sliding_window(card, num_layers)
    if window is not None:
        # HF keeps keys with q - k < sliding_window; Megatron's (left, 0) keeps q - k <= left.
        kwargs.update(window_size=(window - 1, 0), window_attn_skip_freq=sliding_layers)
    return kwargs


def qwen3_moe_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    kwargs = qwen3_transformer_config_kwargs(card)
    kwargs.update(
        # transformers 5 saves the field under its attribute_map alias num_local_experts
        num_moe_experts=card_field(card, "num_experts", None) or card_field(card, "num_local_experts"),
        moe_router_topk=card_field(card, "num_experts_per_tok"),
        moe_ffn_hidden_size=card_field(card, "moe_intermediate_size"),
        moe_layer_freq=_moe_layer_pattern(card, kwargs["num_layers"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not card_field(card, "norm_topk_prob", False),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=card_field(card, "router_aux_loss_coef", 0.0),
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
    )
    return kwargs


def qwen3_gpt_model_kwargs(card: ModelCard) -> Dict[str, Any]:
    return dict(
        vocab_size=card_field(card, "vocab_size"),
        max_sequence_length=card_field(card, "max_position_embeddings"),
        position_embedding_type="rope",
        rotary_base=_rope_theta(card),
        share_embeddings_and_output_weights=card_field(card, "tie_word_embeddings", False),
    )


def _rope_theta(card: ModelCard) -> float:
    """Plain RoPE base, from ``rope_theta`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
    parameters = card_field(card, "rope_parameters", None) or {}
    scaling = card_field(card, "rope_scaling", None)
    rope_type = (scaling or {}).get("rope_type", parameters.get("rope_type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"model card {card.name!r}: RoPE scaling {rope_type!r} is not supported yet")
    return float(parameters.get("rope_theta", card_field(card, "rope_theta", 10000.0)))


def _sliding_window(card: ModelCard, num_layers: int) -> Tuple[Optional[int], List[int]]:
    """(window, per-layer 1 = sliding / 0 = full) like transformers' Qwen3Config, or (None, [])."""
    window = card_field(card, "sliding_window", None)
    if not card_field(card, "use_sliding_window", False) or window is None:
        return None, []
    layer_types = card_field(card, "layer_types", None) or [
        "sliding_attention" if i >= card_field(card, "max_window_layers", num_layers) else "full_attention"
        for i in range(num_layers)
    ]
    return window, [int(kind == "sliding_attention") for kind in layer_types]


def _moe_layer_pattern(card: ModelCard, num_layers: int) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, as Qwen3MoeDecoderLayer decides."""
    dense = set(card_field(card, "mlp_only_layers", None) or [])
    step = card_field(card, "decoder_sparse_step", 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


QWEN3 = ModelFamily("qwen3", qwen3_transformer_config_kwargs, qwen3_gpt_model_kwargs)
QWEN3_MOE = ModelFamily("qwen3_moe", qwen3_moe_transformer_config_kwargs, qwen3_gpt_model_kwargs)
