"""Qwen3 (dense) and Qwen3-MoE: card fields -> Megatron-Core ``TransformerConfig`` and ``GPTModel``.

Architecture (Hugging Face ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``): pre-norm RMSNorm
decoder, GQA with per-head RMSNorm on q and k (QK-norm), no linear biases, RoPE, SwiGLU MLP; the
MoE variant replaces the MLP by a softmax-routed top-k mixture of SwiGLU experts without a shared
expert. ``norm_topk_prob`` renormalises the top-k softmax probabilities, which is Megatron's
top-k-then-softmax (``moe_router_pre_softmax=False``): ``softmax(l)_i / sum_topk softmax(l)_j =
exp(l_i) / sum_topk exp(l_j)``.

RoPE is plain, or YaRN (Peng et al. 2023) where the card's ``rope_scaling`` / ``rope_parameters``
say ``"rope_type": "yarn"`` (Qwen3's published way past 32,768 tokens): Megatron-Core's
``YarnRotaryEmbedding`` (``position_embedding_type="yarn"``) with the parameters transformers'
``_compute_yarn_parameters`` reads, its attention factor ("mscale") applied to cos and sin by
``apply_rotary_pos_emb`` as transformers does. Other RoPE scalings are refused.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from ..planner import moe_layer_flags
from .cards import ModelCard
from .family import (
    ModelFamily,
    StateDictMapping,
    TensorMapping,
    attention_mappings,
    card_field,
    decoder_mapping,
    gated_mlp_mapping,
    one_to_one,
)


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
        **_yarn_config_kwargs(card),
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
    parameters = rope_parameters(card)
    return dict(
        vocab_size=card_field(card, "vocab_size"),
        max_sequence_length=card_field(card, "max_position_embeddings"),
        position_embedding_type="yarn" if parameters["rope_type"] == "yarn" else "rope",
        rotary_base=float(parameters["rope_theta"]),
        share_embeddings_and_output_weights=card_field(card, "tie_word_embeddings", False),
    )


_YARN_FIELDS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def rope_parameters(card: ModelCard) -> Dict[str, Any]:
    """The card's RoPE parameters as transformers 5's ``convert_rope_params_to_dict`` reads them:
    ``rope_scaling`` (transformers 4's name) wins over ``rope_parameters``; ``rope_type`` defaults
    to the older ``type``, ``rope_theta`` to the top-level field. NotImplementedError for a
    rope_type other than plain RoPE ("default") and YaRN."""
    parameters = dict(card_field(card, "rope_scaling", None) or card_field(card, "rope_parameters", None) or {})
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    parameters.setdefault("rope_theta", card_field(card, "rope_theta", 10000.0))
    if parameters["rope_type"] not in ("default", "yarn"):
        raise NotImplementedError(
            f"model card {card.name!r}: RoPE scaling {parameters['rope_type']!r} is not supported; "
            "Qwen3 cards take plain RoPE or rope_type 'yarn'"
        )
    return parameters


def _yarn_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    """``DualKVTransformerConfig``'s yarn_* fields for a YaRN card (Megatron's ``GPTModel`` and
    attention read them), with transformers' defaults and precedence; {} for plain RoPE."""
    parameters = rope_parameters(card)
    if parameters["rope_type"] != "yarn":
        return {}
    unsupported = sorted(set(parameters) - _YARN_FIELDS)
    if unsupported:
        # attention_factor: Megatron derives the factor from factor, mscale and mscale_all_dim only
        raise NotImplementedError(f"model card {card.name!r}: YaRN parameters {unsupported} are not supported")
    max_positions = card_field(card, "max_position_embeddings")
    # a top-level original_max_position_embeddings wins, as transformers' standardize_rope_params has it
    original = (card_field(card, "original_max_position_embeddings", None)
                or parameters.get("original_max_position_embeddings") or max_positions)
    factor = parameters.get("factor") or max_positions / original
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        # transformers then uses 0.1 ln(factor) + 1, which Megatron computes from None, None
        mscale = mscale_all_dim = None
    return dict(
        yarn_rotary_scaling_factor=float(factor),
        yarn_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(parameters.get("beta_fast") or 32),
        yarn_beta_slow=float(parameters.get("beta_slow") or 1),
        yarn_mscale=mscale,
        yarn_mscale_all_dim=mscale_all_dim,
        yarn_correction_range_round_to_int=bool(parameters.get("truncate", True)),
    )


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


def qwen3_state_dict_mapping(card: ModelCard, config: TransformerConfig, experts_one_by_one: bool = False) -> StateDictMapping:
    """transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` state dict <-> ours.

    MoE experts: transformers 5 keeps them fused per layer (``experts.gate_up_proj`` ``[E, 2I, h]``,
    ``experts.down_proj`` ``[E, h, I]``); ours are Megatron's ``SequentialMLP`` experts.
    experts_one_by_one: name the experts as the published safetensors files (and ``save_pretrained``)
    do, ``mlp.experts.<e>.{gate,up,down}_proj.weight``.
    """
    moe_layers = moe_layer_flags(config)
    mappings = []
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        mappings += attention_mappings(hf + "self_attn.", ours + "self_attention.", config)
        mappings += norm_and_mlp_mappings(hf, ours, config, moe_layers[i], experts_one_by_one)
    tied = card_field(card, "tie_word_embeddings", False)
    return decoder_mapping(mappings, tied=tied, vocab_size=card_field(card, "vocab_size"))


def norm_and_mlp_mappings(hf: str, ours: str, config: TransformerConfig, moe: bool, experts_one_by_one: bool
                          ) -> List[TensorMapping]:
    """A Qwen decoder layer's input and post-attention norms and its MLP: SwiGLU, or routed experts
    (with Qwen3-Next's shared expert and its sigmoid gate where the config has one)."""
    mappings = [
        one_to_one(hf + "input_layernorm.weight", ours + "input_layernorm.weight"),
        one_to_one(hf + "post_attention_layernorm.weight", ours + "pre_mlp_layernorm.weight"),
    ]
    if not moe:
        return mappings + _mlp_mappings(hf + "mlp.", ours + "mlp.")
    mappings += _moe_mappings(hf + "mlp.", ours + "mlp.", config, experts_one_by_one)
    if config.moe_shared_expert_intermediate_size:
        mappings += [*_mlp_mappings(hf + "mlp.shared_expert.", ours + "mlp.shared_experts."),
                     one_to_one(hf + "mlp.shared_expert_gate.weight", ours + "mlp.shared_experts.gate_weight")]
    return mappings


def _mlp_mappings(hf: str, ours: str) -> List[TensorMapping]:
    """A transformers SwiGLU MLP (gate/up/down projections) <-> a Megatron ``MLP``."""
    return [
        gated_mlp_mapping(hf + "gate_proj.weight", hf + "up_proj.weight", ours + "linear_fc1.weight"),
        one_to_one(hf + "down_proj.weight", ours + "linear_fc2.weight"),
    ]


def _moe_mappings(hf: str, ours: str, config: TransformerConfig, experts_one_by_one: bool) -> List[TensorMapping]:
    experts = range(config.num_moe_experts)
    router = one_to_one(hf + "gate.weight", ours + "router.weight")
    if experts_one_by_one:
        return [router] + [m for e in experts for m in _mlp_mappings(f"{hf}experts.{e}.", f"{ours}experts.local_experts.{e}.")]
    per_expert = lambda name: tuple(f"{ours}experts.local_experts.{e}.{name}.weight" for e in experts)  # noqa: E731
    return [
        router,
        TensorMapping((hf + "experts.gate_up_proj",), per_expert("linear_fc1"), torch.unbind, _stack),
        TensorMapping((hf + "experts.down_proj",), per_expert("linear_fc2"), torch.unbind, _stack),
    ]


def _stack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack(tensors)


QWEN3 = ModelFamily(
    "qwen3", qwen3_transformer_config_kwargs, qwen3_gpt_model_kwargs, hf_mapping=qwen3_state_dict_mapping
)
QWEN3_MOE = ModelFamily(
    "qwen3_moe",
    qwen3_moe_transformer_config_kwargs,
    qwen3_gpt_model_kwargs,
    hf_mapping=qwen3_state_dict_mapping,
    hf_file_mapping=partial(qwen3_state_dict_mapping, experts_one_by_one=True),
)
