"""Qwen3.5 (text) and Qwen3-Next: hybrid decoders of Gated DeltaNet and full-attention layers.

Architecture (transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3NextForCausalLM``): ``layer_types``
gives each layer a token mixer, a Gated DeltaNet (``linear_attention``; three of every four
layers in the published models) or full attention with an output gate (the q projection is
twice as wide, ``o * sigmoid(gate)``), q/k norms and RoPE on the first ``partial_rotary_factor``
of each head. Every norm is zero-centred (``1 + w``). The MLP is SwiGLU (Qwen3.5) or, in
Qwen3-Next, a routed mixture with a shared expert behind a sigmoid gate.

Layers and model: ``mcore.hybrid``; the GDN on the packed layout: ``mcore.gated_delta_net``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, List

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from ..mcore.hybrid import LAYER_TYPES, HybridTransformerConfig, hybrid_block_spec
from ..planner import moe_layer_flags
from .cards import ModelCard
from .family import (
    ModelFamily,
    StateDictMapping,
    TensorMapping,
    attention_mappings,
    card_field,
    decoder_mapping,
    interleave_query_groups,
    one_to_one,
    split_query_groups,
)
from .qwen3 import (
    norm_and_mlp_mappings,
    qwen3_gpt_model_kwargs,
    qwen3_moe_transformer_config_kwargs,
    qwen3_transformer_config_kwargs,
    rope_parameters,
)


def qwen3_5_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    _refuse_yarn(card)
    return _with_hybrid_layers(card, qwen3_transformer_config_kwargs(card))


def qwen3_next_transformer_config_kwargs(card: ModelCard) -> Dict[str, Any]:
    _refuse_yarn(card)
    kwargs = _with_hybrid_layers(card, qwen3_moe_transformer_config_kwargs(card))
    shared = card_field(card, "shared_expert_intermediate_size", 0)
    if shared:  # behind a sigmoid gate, as Megatron's moe_shared_expert_gate
        kwargs.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return kwargs


def _with_hybrid_layers(card: ModelCard, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A Qwen3 (or Qwen3-MoE) config's fields plus the hybrid decoder's: the layer types, the GDN
    sizes, zero-centred norms and the attention's output gate."""
    num_layers = kwargs["num_layers"]
    layer_types = tuple(card_field(card, "layer_types", None) or _interval_layer_types(card, num_layers))
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"model card {card.name!r}: unknown layer_types {unknown}; supported: {list(LAYER_TYPES)}")
    return dict(
        kwargs,
        layer_types=layer_types,
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        linear_conv_kernel_dim=card_field(card, "linear_conv_kernel_dim"),
        linear_key_head_dim=card_field(card, "linear_key_head_dim"),
        linear_value_head_dim=card_field(card, "linear_value_head_dim"),
        linear_num_key_heads=card_field(card, "linear_num_key_heads"),
        linear_num_value_heads=card_field(card, "linear_num_value_heads"),
    )


def _interval_layer_types(card: ModelCard, num_layers: int) -> List[str]:
    """transformers' default: every ``full_attention_interval``-th layer full attention."""
    interval = card_field(card, "full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _refuse_yarn(card: ModelCard) -> None:
    """Megatron's YarnRotaryEmbedding spans the whole head; these models rotate a part of it."""
    if rope_parameters(card)["rope_type"] == "yarn":
        raise NotImplementedError(f"model card {card.name!r}: YaRN RoPE is supported for qwen3 and qwen3_moe cards, "
                                  f"not for {card.model_type} (partial RoPE)")


def qwen3_5_gpt_model_kwargs(card: ModelCard) -> Dict[str, Any]:
    _refuse_yarn(card)
    parameters = card_field(card, "rope_parameters", None) or {}
    rotary_percent = parameters.get("partial_rotary_factor", card_field(card, "partial_rotary_factor", 1.0))
    return dict(qwen3_gpt_model_kwargs(card), rotary_percent=float(rotary_percent))


def qwen3_next_state_dict_mapping(card: ModelCard, config: TransformerConfig, experts_one_by_one: bool = False
                                  ) -> StateDictMapping:
    """transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3NextForCausalLM`` state dict <-> ours.

    Qwen3-Next fuses the GDN projections per key head already (``in_proj_qkvz``, ``in_proj_ba``),
    Qwen3.5 keeps them apart; its MoE layers add a shared expert behind a sigmoid gate.
    experts_one_by_one: the routed experts named as the published safetensors files name them."""
    moe_layers = moe_layer_flags(config)
    mappings = []
    for i, kind in enumerate(config.layer_types):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        if kind == "linear_attention":
            mappings += gated_delta_net_mappings(hf + "linear_attn.", ours + "self_attention.", config,
                                                 fused=card.model_type == "qwen3_next")
        else:
            mappings += gated_attention_mappings(hf + "self_attn.", ours + "self_attention.", config)
        mappings += norm_and_mlp_mappings(hf, ours, config, moe_layers[i], experts_one_by_one)
    return decoder_mapping(mappings, tied=card_field(card, "tie_word_embeddings", False),
                           vocab_size=card_field(card, "vocab_size"))


def gated_attention_mappings(hf: str, ours: str, config: TransformerConfig) -> List[TensorMapping]:
    """Attention with an output gate: transformers' ``q_proj`` holds each head's query, then its
    gate; Megatron's ``linear_qkv`` per query group its heads' queries, their gates, its k and v."""
    groups, heads, head_dim = config.num_query_groups, config.num_attention_heads, config.kv_channels
    group_heads = heads // groups * head_dim

    def to_megatron(q_proj: Tensor, k_proj: Tensor, v_proj: Tensor) -> Tensor:
        if q_proj.shape[0] != 2 * heads * head_dim:
            raise ValueError(f"a q_proj of {q_proj.shape[0]} rows does not split into {heads} heads of {head_dim} "
                             "query and gate rows each")
        query, gate = q_proj.view(heads, 2, head_dim, -1).unbind(1)
        return interleave_query_groups(groups, query.reshape(heads * head_dim, -1), gate.reshape(heads * head_dim, -1),
                                       k_proj, v_proj)

    def to_hf(linear_qkv: Tensor):
        query, gate, key, value = split_query_groups(linear_qkv, groups, (group_heads, group_heads, head_dim, head_dim))
        q_proj = torch.stack([query.view(heads, head_dim, -1), gate.view(heads, head_dim, -1)], 1)
        return q_proj.reshape(2 * heads * head_dim, -1), key, value

    qkv = TensorMapping(tuple(f"{hf}{p}_proj.weight" for p in "qkv"), (ours + "linear_qkv.weight",), to_megatron, to_hf)
    # the plain attention's o_proj and q/k norms
    return [qkv, *attention_mappings(hf, ours, config)[1:]]


def gated_delta_net_mappings(hf: str, ours: str, config: TransformerConfig, fused: bool = False) -> List[TensorMapping]:
    """transformers' GDN (a depthwise conv over [q; k; v], and Qwen3.5's in_proj_qkv/z/b/a or
    Qwen3-Next's ``fused`` in_proj_qkvz/ba, already grouped per key head) <-> ours, whose in_proj
    and conv channels are grouped per key head (``DualKVGatedDeltaNet``)."""
    key_heads, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    values_per_key = config.linear_num_value_heads // key_heads
    value_rows = values_per_key * config.linear_value_head_dim
    qkv_rows = (key_heads * key_dim, key_heads * key_dim)  # then v
    if fused:
        in_proj_mapping = TensorMapping(
            (hf + "in_proj_qkvz.weight", hf + "in_proj_ba.weight"), (ours + "in_proj.weight",),
            partial(interleave_query_groups, key_heads),
            partial(split_query_groups, num_query_groups=key_heads,
                    rows_per_group=(2 * key_dim + 2 * value_rows, 2 * values_per_key)))

    def in_proj(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor) -> Tensor:
        return interleave_query_groups(key_heads, *_split_qkv(qkv, qkv_rows), z, b, a)

    def in_proj_to_hf(fused: Tensor):
        q, k, v, z, b, a = split_query_groups(fused, key_heads, (key_dim, key_dim, value_rows, value_rows,
                                                                 values_per_key, values_per_key))
        return torch.cat([q, k, v]), z, b, a

    def conv(weight: Tensor) -> Tensor:
        return interleave_query_groups(key_heads, *_split_qkv(weight.squeeze(1), qkv_rows))

    def conv_to_hf(weight: Tensor) -> Tensor:
        return torch.cat(split_query_groups(weight, key_heads, (key_dim, key_dim, value_rows))).unsqueeze(1)

    if not fused:
        in_proj_mapping = TensorMapping(tuple(f"{hf}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                                        (ours + "in_proj.weight",), in_proj, in_proj_to_hf)
    return [
        in_proj_mapping,
        TensorMapping((hf + "conv1d.weight",), (ours + "conv_weight",), conv, conv_to_hf),
        one_to_one(hf + "A_log", ours + "A_log"),
        one_to_one(hf + "dt_bias", ours + "dt_bias"),
        one_to_one(hf + "norm.weight", ours + "norm_weight"),
        one_to_one(hf + "out_proj.weight", ours + "out_proj.weight"),
    ]


def _split_qkv(qkv: Tensor, qk_rows) -> List[Tensor]:
    return list(torch.split(qkv, [*qk_rows, qkv.shape[0] - sum(qk_rows)]))


_HYBRID = dict(config_class=HybridTransformerConfig, block_spec=hybrid_block_spec, hf_mapping=qwen3_next_state_dict_mapping,
               transformer_engine_spec=False)
QWEN3_5 = ModelFamily("qwen3_5_text", qwen3_5_transformer_config_kwargs, qwen3_5_gpt_model_kwargs, **_HYBRID)
QWEN3_NEXT = ModelFamily("qwen3_next", qwen3_next_transformer_config_kwargs, qwen3_5_gpt_model_kwargs, **_HYBRID,
                         hf_file_mapping=partial(qwen3_next_state_dict_mapping, experts_one_by_one=True))
