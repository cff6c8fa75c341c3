"""Gemma 3 and Gemma 4 text decoders (``gemma3_text``, ``gemma4_text``): card -> Megatron-Core.

Architecture, as transformers 5 implements it (``models/gemma3/modeling_gemma3.py``,
``models/gemma4/modeling_gemma4.py`` and their configuration files):

* Layers are ``sliding_attention`` (local: a causal window of ``sliding_window`` positions, key
  visible iff ``q - k < sliding_window``) or ``full_attention`` (global), by ``layer_types``;
  without it Gemma 3 makes every ``sliding_window_pattern``-th layer (default 6) global, Gemma 4
  every 6th, and Gemma 4 forces the last layer global.
* Every layer: ``x + post_attention_norm(attn(input_norm(x)))``, then
  ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))``; GeGLU MLP (gelu, tanh
  approximation); q and k RMS-normed per head before RoPE; no biases; token embeddings times
  ``sqrt(hidden_size)`` rounded to the embedding dtype; final RMSNorm; tied output layer by
  default; ``final_logit_softcapping`` when set.
* RoPE per layer type (``rope_parameters[layer_type]``).
* Gemma 3: RMSNorm weight ``1 + w``; scores scaled by ``query_pre_attn_scalar ** -0.5``; the
  published configs use linear RoPE scaling (factor 8) on global layers only. transformers'
  Gemma 3 attention never applies ``attn_logit_softcapping``.
* Gemma 4: RMSNorm weight ``w``; scores unscaled (``scaling = 1.0``); values RMS-normed without
  weight; global layers have their own head dim (``global_head_dim``, default 512) and, with
  ``attention_k_eq_v``, ``num_global_key_value_heads`` heads and no value projection (the
  un-normed keys are the values); global RoPE is "proportional" (only ``partial_rotary_factor``
  of the frequency pairs rotate); each layer's output is multiplied by a ``layer_scalar`` buffer.
  Per-layer inputs (``hidden_size_per_layer_input``), KV sharing (``num_kv_shared_layers``) and
  the MoE block of the smaller/MoE Gemma 4 models are refused.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..mcore.gemma import GemmaGPTModel, GemmaTransformerConfig, RopeSpec, gemma_block_spec
from .cards import ModelCard
from .family import (
    ModelFamily,
    StateDictMapping,
    attention_mappings,
    card_field,
    decoder_mapping,
    gated_mlp_mapping,
    one_to_one,
)

LAYER_TYPES = ("sliding_attention", "full_attention")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


def gemma3_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    _refuse_enabled(card, attn_logit_softcapping=None, use_bidirectional_attention=False, attention_bias=False)
    pattern = card_field(card, "sliding_window_pattern", 6)
    kwargs = _decoder_kwargs(card, _layer_types(card, pattern, last_is_full=False))
    kwargs.update(layernorm_zero_centered_gamma=True, softmax_scale=card_field(card, "query_pre_attn_scalar", 256) ** -0.5)
    return kwargs


def gemma4_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    _refuse_enabled(
        card, hidden_size_per_layer_input=256, num_kv_shared_layers=0, enable_moe_block=False, attention_bias=False
    )
    # "vision" makes image tokens attend both ways; text, all this library packs, stays causal
    if card_field(card, "use_bidirectional_attention", None) == "all":
        raise ValueError(f"model card {card.name!r}: use_bidirectional_attention='all' is not supported (causal only)")
    layer_types = _layer_types(card, 6, last_is_full=True)
    head_dim, kv_heads = _gemma4_full_attention_heads(card, layer_types)
    kwargs = _decoder_kwargs(card, layer_types)
    kwargs.update(
        softmax_scale=1.0,
        full_attention_kv_channels=head_dim,
        full_attention_num_query_groups=kv_heads,
        full_attention_keys_are_values=card_field(card, "attention_k_eq_v", False),
        value_norm=True,
        layer_scalar=True,
    )
    return kwargs


def gemma3_gpt_model_kwargs(card: ModelCard) -> Dict[str, Any]:
    full, sliding = _gemma3_rope_parameters(card)
    return _gpt_model_kwargs(card, sliding_rope=_rope(card, "sliding_attention", sliding, ("default",)),
                             full_rope=_rope(card, "full_attention", full, ("default", "linear")))


def gemma4_gpt_model_kwargs(card: ModelCard) -> Dict[str, Any]:
    # transformers' Gemma4TextConfig defaults, for cards without rope_parameters
    parameters = card_field(card, "rope_parameters", None) or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    return _gpt_model_kwargs(
        card,
        sliding_rope=_rope(card, "sliding_attention", parameters.get("sliding_attention"), ("default",)),
        full_rope=_rope(card, "full_attention", parameters.get("full_attention"), ("default", "proportional")),
    )


def gemma_state_dict_mapping(card: ModelCard, config: GemmaTransformerConfig) -> StateDictMapping:
    """transformers' ``Gemma3ForCausalLM`` / ``Gemma4ForCausalLM`` state dict <-> ours.

    Gemma's post-attention and post-feedforward norms live in our ``linear_proj`` and ``linear_fc2``
    (``PostNormRowParallelLinear``); its pre-feedforward norm is Megatron's ``pre_mlp_layernorm``.
    Multimodal checkpoints (``*ForConditionalGeneration``) name the same tensors under
    ``model.language_model.`` instead of ``model.``.
    """
    mappings = []
    for i in range(config.num_layers):
        hf, ours, number = f"model.layers.{i}.", f"decoder.layers.{i}.", i + 1
        keys_are_values = config.full_attention_keys_are_values and config.is_full_attention(number)
        mappings += attention_mappings(hf + "self_attn.", ours + "self_attention.", config.for_layer(number), keys_are_values)
        mappings += [
            one_to_one(hf + "input_layernorm.weight", ours + "input_layernorm.weight"),
            one_to_one(hf + "post_attention_layernorm.weight", ours + "self_attention.linear_proj.post_norm.weight"),
            one_to_one(hf + "pre_feedforward_layernorm.weight", ours + "pre_mlp_layernorm.weight"),
            gated_mlp_mapping(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight", ours + "mlp.linear_fc1.weight"),
            one_to_one(hf + "mlp.down_proj.weight", ours + "mlp.linear_fc2.weight"),
            one_to_one(hf + "post_feedforward_layernorm.weight", ours + "mlp.linear_fc2.post_norm.weight"),
        ]
        if config.layer_scalar:
            mappings.append(one_to_one(hf + "layer_scalar", ours + "layer_scalar"))
    tied = card_field(card, "tie_word_embeddings", True)
    return decoder_mapping(mappings, tied=tied, vocab_size=card_field(card, "vocab_size"))


def _decoder_kwargs(card: ModelCard, layer_types: Sequence[str]) -> Dict[str, Any]:
    """What Gemma 3 and 4 share (sliding-layer head dim and key/value heads)."""
    activation = card_field(card, "hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"model card {card.name!r}: hidden_activation {activation!r} is not supported; Gemma uses 'gelu_pytorch_tanh'"
        )
    kwargs = dict(
        num_layers=len(layer_types),
        hidden_size=card_field(card, "hidden_size"),
        num_attention_heads=card_field(card, "num_attention_heads"),
        num_query_groups=card_field(card, "num_key_value_heads"),
        kv_channels=card_field(card, "head_dim"),
        ffn_hidden_size=card_field(card, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=card_field(card, "rms_norm_eps", 1e-6),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=gelu_tanh,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=card_field(card, "attention_dropout", 0.0),
        init_method_std=card_field(card, "initializer_range", 0.02),
    )
    if "sliding_attention" in layer_types:
        window = card_field(card, "sliding_window")
        if not isinstance(window, int) or window < 1:
            raise ValueError(
                f"model card {card.name!r}: sliding_window must be a positive int for sliding_attention layers, got {window!r}"
            )
        # transformers keeps keys with q - k < sliding_window; Megatron's (left, 0) keeps q - k <= left.
        kwargs.update(
            window_size=(window - 1, 0),
            window_attn_skip_freq=[int(kind == "sliding_attention") for kind in layer_types],
        )
    return kwargs


def _layer_types(card: ModelCard, pattern: int, last_is_full: bool) -> List[str]:
    num_layers = card_field(card, "num_hidden_layers")
    types = list(card_field(card, "layer_types", None) or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ])
    if len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(
            f"model card {card.name!r}: layer_types must list {num_layers} entries out of {LAYER_TYPES}, got {types}"
        )
    if last_is_full:
        types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    return types


def _gemma4_full_attention_heads(card: ModelCard, layer_types: Sequence[str]) -> Tuple[int, int]:
    """(head dim, key/value heads) of the full-attention layers, as Gemma4TextConfig resolves them.

    Published configs give ``global_head_dim`` / ``num_global_key_value_heads`` (the latter only
    counts with ``attention_k_eq_v``); a config.json written by transformers 5 carries the result
    as ``per_layer_config`` (layer index -> overrides).
    """
    kv_heads = card_field(card, "num_key_value_heads")
    per_layer = card_field(card, "per_layer_config", None)
    if per_layer is None:
        global_kv_heads = card_field(card, "num_global_key_value_heads", None)
        if global_kv_heads is None or not card_field(card, "attention_k_eq_v", False):
            global_kv_heads = kv_heads
        shape = card_field(card, "global_head_dim", 512), global_kv_heads
    else:
        shape = _full_attention_overrides(card, per_layer, layer_types, kv_heads)
    if card_field(card, "num_attention_heads") % shape[1]:
        raise ValueError(
            f"model card {card.name!r}: num_attention_heads is not a multiple of the global layers' {shape[1]} key/value heads"
        )
    return shape


def _full_attention_overrides(card, per_layer: Dict[str, Dict[str, int]], layer_types, kv_heads) -> Tuple[int, int]:
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    overrides = {int(index): dict(values) for index, values in per_layer.items()}
    distinct = {tuple(sorted(overrides.get(i, {}).items())) for i in full}
    if set(overrides) - set(full) or len(distinct) > 1 or set(overrides.get(full[0], {})) - {"head_dim", "num_key_value_heads"}:
        raise ValueError(
            f"model card {card.name!r}: per_layer_config is supported only as one head_dim / num_key_value_heads "
            f"override shared by all full_attention layers, got {per_layer}"
        )
    values = overrides.get(full[0], {})
    return values.get("head_dim", card_field(card, "head_dim")), values.get("num_key_value_heads", kv_heads)


def _gemma3_rope_parameters(card: ModelCard) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(full, sliding) rope parameters as Gemma3TextConfig.convert_rope_params_to_dict builds them."""
    parameters = card_field(card, "rope_parameters", None) or {}
    full = dict(parameters.get("full_attention") or {"rope_type": "default"})
    sliding = dict(parameters.get("sliding_attention") or {"rope_type": "default"})
    scaling = dict(card_field(card, "rope_scaling", None) or {})
    if "type" in scaling:
        # transformers 4's name; transformers 5 keeps "rope_type": "default" then and silently drops
        # the scaling the model was trained with
        scaling.setdefault("rope_type", scaling.pop("type"))
    full.update(scaling)
    full.setdefault("rope_theta", card_field(card, "rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", card_field(card, "rope_local_base_freq", 10_000.0))
    return full, sliding


def _rope(card: ModelCard, layer_type: str, parameters, supported: Sequence[str]) -> RopeSpec:
    if not parameters or "rope_theta" not in parameters:
        raise ValueError(f"model card {card.name!r}: rope_parameters[{layer_type!r}] needs a rope_theta")
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in supported:
        raise ValueError(
            f"model card {card.name!r}: rope_parameters[{layer_type!r}] rope_type {rope_type!r} is not supported "
            f"for {layer_type} layers; supported: {list(supported)}"
        )
    partial = float(parameters.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and rope_type != "proportional":
        raise ValueError(
            f"model card {card.name!r}: rope_parameters[{layer_type!r}] partial_rotary_factor needs rope_type 'proportional'"
        )
    return RopeSpec(float(parameters["rope_theta"]), rope_type, float(parameters.get("factor", 1.0)), partial)


def _gpt_model_kwargs(card: ModelCard, **ropes: RopeSpec) -> Dict[str, Any]:
    return dict(
        vocab_size=card_field(card, "vocab_size"),
        max_sequence_length=card_field(card, "max_position_embeddings"),
        share_embeddings_and_output_weights=card_field(card, "tie_word_embeddings", True),
        final_logit_softcapping=card_field(card, "final_logit_softcapping", None),
        **ropes,
    )


def _refuse_enabled(card: ModelCard, **hf_defaults: Any) -> None:
    """ValueError naming the first of these features that is on (unset fields take transformers' default)."""
    for key, default in hf_defaults.items():
        value = card_field(card, key, default)
        if value:
            raise ValueError(f"model card {card.name!r}: {key}={value!r} is not supported; it must be unset, 0, false or null")


def _family(model_type: str, config_kwargs, model_kwargs) -> ModelFamily:
    return ModelFamily(
        model_type,
        config_kwargs,
        model_kwargs,
        config_class=GemmaTransformerConfig,
        block_spec=gemma_block_spec,
        model_class=GemmaGPTModel,
        hf_mapping=gemma_state_dict_mapping,
    )


GEMMA3 = _family("gemma3_text", gemma3_transformer_config_kwargs, gemma3_gpt_model_kwargs)
GEMMA4 = _family("gemma4_text", gemma4_transformer_config_kwargs, gemma4_gpt_model_kwargs)
