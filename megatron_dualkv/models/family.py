"""``ModelFamily``: how one Hugging Face ``model_type`` becomes a Megatron-Core model.

A family turns card fields into ``TransformerConfig`` architecture fields and ``GPTModel``
arguments; the builder adds the parallel and precision settings and the DualKV layer spec. One
small module per family (``qwen3.py``, ``gemma.py``): that module is also where a family's
Hugging Face state-dict mapping (a ``StateDictMapping``: every tensor under both names, used in both
directions by ``ModelFamily.hf_to_megatron`` / ``megatron_to_hf``) and any family-specific layer
spec, config class and model class (Gemma's extra norms) belong.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from ..mcore.config import DualKVTransformerConfig
from ..mcore.gpt_model import DualKVGPTModel
from ..mcore.layer_specs import dualkv_local_block_spec, dualkv_te_block_spec
from .cards import ModelCard

_REQUIRED = object()


def dualkv_gpt_block_spec(
    config: TransformerConfig, use_transformer_engine: bool, vp_stage: Optional[int] = None
) -> TransformerBlockSubmodules:
    """Megatron's own GPT block (dense or MoE layers) with DualKV core attention; the layers of
    this pipeline rank (and virtual stage ``vp_stage``) only."""
    spec = dualkv_te_block_spec if use_transformer_engine else dualkv_local_block_spec
    return spec(config, vp_stage)


@dataclass(frozen=True)
class TensorMapping:
    """Some Hugging Face tensors <-> some Megatron tensors, and how one side is made from the other.

    to_megatron(*hf tensors) -> the Megatron tensors in ``megatron`` order (a tuple, or one
    tensor); to_hf is the inverse. Most entries are one-to-one with the identity; fused
    projections join several HF tensors (q/k/v, gate/up); fused MoE expert tensors split into
    per-expert ones.
    """

    hf: Tuple[str, ...]
    megatron: Tuple[str, ...]
    to_megatron: Callable[..., Tuple[Tensor, ...]] = lambda *tensors: tensors  # noqa: E731
    to_hf: Callable[..., Tuple[Tensor, ...]] = lambda *tensors: tensors  # noqa: E731

    def convert(self, target: str, *tensors: Tensor) -> Dict[str, Tensor]:
        """The ``target`` side's tensors ("megatron" or "hf") by name, made from the other side's
        ``tensors`` (in its name order); ValueError when the conversion makes the wrong number."""
        source = "hf" if target == "megatron" else "megatron"
        names = getattr(self, target)
        outputs = getattr(self, "to_" + target)(*tensors)
        outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        if len(outputs) != len(names):
            raise ValueError(f"mapping {getattr(self, source)} -> {names} produced {len(outputs)} tensors")
        return dict(zip(names, outputs))


@dataclass(frozen=True)
class StateDictMapping:
    """Every tensor of one model under both names: what a family's ``hf_mapping`` returns.

    Hugging Face side: the names of the transformers model's ``state_dict()``. Megatron side: the
    names of the model ``build_model`` makes, with full (tp=1, ep=1) tensors; ``_extra_state``
    entries are not tensors and are left out. ``tied``: HF names that alias another HF tensor
    (tied embeddings: ``lm_head.weight`` -> ``model.embed_tokens.weight``), checked equal on the
    way in and emitted as the same tensor on the way out.
    """

    tensors: Tuple[TensorMapping, ...]
    tied: Dict[str, str] = field(default_factory=dict)

    def check_hf_names(self, names: Iterable[str]) -> None:
        """ValueError naming the missing and the unexpected Hugging Face tensors, if any."""
        _check_names("Hugging Face", dict.fromkeys(names), [n for m in self.tensors for n in m.hf], self.tied)

    def check_tied(self, hf_tensors: Dict[str, Tensor]) -> None:
        """ValueError when a tied alias in ``hf_tensors`` differs from the tensor it aliases."""
        for alias, source in self.tied.items():
            if alias in hf_tensors and not torch.equal(hf_tensors[alias], hf_tensors[source]):
                raise ValueError(f"{alias} differs from {source}, but the model ties them (tie_word_embeddings)")

    def to_megatron(self, hf_state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        self.check_hf_names(hf_state_dict)
        self.check_tied(hf_state_dict)
        return _apply(self.tensors, hf_state_dict, "hf", "megatron")

    def to_hf(self, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        tensors = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
        _check_names("Megatron", tensors, [n for m in self.tensors for n in m.megatron], {})
        hf = _apply(self.tensors, tensors, "megatron", "hf")
        hf.update({alias: hf[source] for alias, source in self.tied.items()})
        return hf


def _check_names(side: str, state_dict: Dict[str, Tensor], expected: Sequence[str], optional: Dict[str, str]) -> None:
    missing = [n for n in expected if n not in state_dict]
    unexpected = sorted(set(state_dict) - set(expected) - set(optional))
    if missing or unexpected:
        raise ValueError(
            f"{side} state dict does not match the model card: missing {_first(missing)}, unexpected {_first(unexpected)}"
        )


def _first(names: Sequence[str], n: int = 5) -> str:
    return "none" if not names else ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _apply(mappings, state_dict, source: str, target: str) -> Dict[str, Tensor]:
    out = {}
    for mapping in mappings:
        out.update(mapping.convert(target, *(state_dict[n] for n in getattr(mapping, source))))
    return out


StateDictMappingFn = Callable[[ModelCard, TransformerConfig], StateDictMapping]


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    transformer_config_kwargs: Callable[[ModelCard], Dict[str, Any]]
    gpt_model_kwargs: Callable[[ModelCard], Dict[str, Any]]
    # Megatron building blocks: Megatron's GPT layers with DualKV attention unless a family brings its own
    config_class: type = DualKVTransformerConfig
    block_spec: Callable[[TransformerConfig, bool, Optional[int]], TransformerBlockSubmodules] = dualkv_gpt_block_spec
    model_class: type = DualKVGPTModel
    hf_mapping: Optional[StateDictMappingFn] = None
    # The names of the family's published safetensors files where they differ from transformers'
    # state dict (Qwen3-MoE files name experts one by one, transformers 5 fuses them in memory).
    hf_file_mapping: Optional[StateDictMappingFn] = None
    # whether block_spec builds Transformer Engine layers; without, the default spec is the local one
    transformer_engine_spec: bool = True

    def hf_state_dict_mapping(self, card: ModelCard, config: TransformerConfig) -> StateDictMapping:
        """Every tensor of the model of ``card`` (built with ``config``) under both names."""
        if self.hf_mapping is None:
            raise NotImplementedError(f"model_type {self.model_type!r} has no Hugging Face state-dict mapping yet")
        return self.hf_mapping(card, config)

    def hf_file_state_dict_mapping(self, card: ModelCard, config: TransformerConfig) -> StateDictMapping:
        """Like ``hf_state_dict_mapping``, with the Hugging Face names of the published safetensors
        files (what transformers' ``save_pretrained`` writes) on the Hugging Face side."""
        if self.hf_file_mapping is None:
            return self.hf_state_dict_mapping(card, config)
        return self.hf_file_mapping(card, config)

    def hf_to_megatron(self, card: ModelCard, config: TransformerConfig, hf_state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """A transformers model's ``state_dict()`` -> the ``state_dict()`` of our model of ``card``
        (full tensors; load it with ``load_megatron_state_dict``). config: the model's ``TransformerConfig``."""
        return self.hf_state_dict_mapping(card, config).to_megatron(hf_state_dict)

    def megatron_to_hf(self, card: ModelCard, config: TransformerConfig, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Our model's (full) ``state_dict()`` -> the transformers model's ``state_dict()``."""
        return self.hf_state_dict_mapping(card, config).to_hf(state_dict)


# The Megatron tensors with one row per vocabulary entry: padded for tensor parallelism in a live
# model (``DualKVGPTModel.vocab_size``), the real vocabulary everywhere else (Hugging Face, checkpoints).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


# Transformer Engine's module names -> the local spec's, which the family mappings use: the norms
# fused into TE's LayerNormLinear, and TEGroupedMLP's per-expert weights (SequentialMLP's modules)
_TE_NAMES = (
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r".input_layernorm.\1"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r".pre_mlp_layernorm.\1"),
    (re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$"), r".mlp.experts.local_experts.\3.\1.\2"),
)


def local_spec_name(name: str) -> str:
    """A parameter's name in a model of the local spec, for a name in a model of either spec
    (``decoder.layers.0.self_attention.linear_qkv.layer_norm_weight`` ->
    ``decoder.layers.0.input_layernorm.weight``). The family mappings name the local spec's tensors."""
    for pattern, replacement in _TE_NAMES:
        name, found = pattern.subn(replacement, name)
        if found:
            return name
    return name


def local_spec_state_dict(model: torch.nn.Module, keep_vars: bool = False) -> Dict[str, Tensor]:
    """``model.state_dict()`` under the local spec's names (``local_spec_name``), ``_extra_state``
    entries left out."""
    return {local_spec_name(name): tensor for name, tensor in model.state_dict(keep_vars=keep_vars).items()
            if not name.endswith("_extra_state")}


def load_megatron_state_dict(model: torch.nn.Module, state_dict: Dict[str, Tensor]) -> None:
    """``model.load_state_dict`` of a state dict under the local spec's names (what the family
    mappings make; ``local_spec_state_dict``) into a model of either spec, which forgives only
    absent ``_extra_state`` entries (no tensors).

    The embedding and output layer of the real vocabulary (what ``hf_to_megatron`` makes) get
    zero rows up to the model's padded vocabulary (Megatron's checkpoint loader pads the same way).
    """
    own = model.state_dict(keep_vars=True)
    own_names = {local_spec_name(name): name for name in own}
    state_dict = {own_names.get(name, name): tensor for name, tensor in state_dict.items()}
    state_dict = {
        name: _padded_rows(tensor, own[name]) if name in VOCAB_TENSORS and name in own else tensor
        for name, tensor in state_dict.items()
    }
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"state dict does not fit the model: missing {_first(missing)}, unexpected {_first(unexpected)}")


def _padded_rows(tensor: Tensor, like: Tensor) -> Tensor:
    """``tensor`` with zero rows added up to the rows of ``like`` (the model's own tensor)."""
    if tensor.shape[0] >= like.shape[0]:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(like.shape[0] - tensor.shape[0], *tensor.shape[1:])])


def interleave_query_groups(num_query_groups: int, *parts: Tensor) -> Tensor:
    """Megatron's fused QKV layout from separate projections: per query group, its rows of every part.

    parts: e.g. q ``[groups*heads_per_group*d, h]``, k and v ``[groups*d, h]`` (weights or biases)
    -> ``[q_g0 k_g0 v_g0 | q_g1 k_g1 v_g1 | ...]``.
    """
    for part in parts:
        if part.shape[0] % num_query_groups:
            raise ValueError(f"a projection of {part.shape[0]} rows does not split into {num_query_groups} key/value groups")
    grouped = [part.reshape(num_query_groups, -1, *part.shape[1:]) for part in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:])


def split_query_groups(fused: Tensor, num_query_groups: int, rows_per_group: Sequence[int]) -> Tuple[Tensor, ...]:
    """Inverse of ``interleave_query_groups``: ``rows_per_group`` of each part in one group."""
    if fused.shape[0] != num_query_groups * sum(rows_per_group):
        raise ValueError(
            f"fused projection has {fused.shape[0]} rows, expected {num_query_groups} groups of {sum(rows_per_group)}"
        )
    grouped = fused.reshape(num_query_groups, sum(rows_per_group), *fused.shape[1:])
    return tuple(part.reshape(-1, *fused.shape[1:]) for part in torch.split(grouped, list(rows_per_group), dim=1))


def gated_mlp_mapping(hf_gate: str, hf_up: str, megatron_fc1: str) -> TensorMapping:
    """Megatron's gated-MLP ``linear_fc1`` is ``[gate; up]`` of the separate HF projections."""
    return TensorMapping((hf_gate, hf_up), (megatron_fc1,), lambda gate, up: torch.cat((gate, up)), _halves)


def _halves(fused: Tensor) -> Tuple[Tensor, ...]:
    return tuple(torch.chunk(fused, 2, dim=0))


def one_to_one(hf: str, megatron: str) -> TensorMapping:
    return TensorMapping((hf,), (megatron,))


def vocabulary_mapping(hf: str, megatron: str, vocab_size: int) -> TensorMapping:
    """One row per token both ways; a Megatron tensor padded past ``vocab_size`` rows loses the padding."""
    return TensorMapping((hf,), (megatron,), to_hf=lambda weight: weight[:vocab_size])


def decoder_mapping(layer_mappings: Sequence[TensorMapping], tied: bool, vocab_size: int) -> StateDictMapping:
    """A transformers decoder's embedding, final norm and (untied) ``lm_head`` around the family's
    per-layer mappings; a tied ``lm_head.weight`` is an alias of the embedding. vocab_size: the
    card's; the rows a live model pads its vocabulary with are left out on the way to Hugging Face."""
    mappings = [
        vocabulary_mapping("model.embed_tokens.weight", "embedding.word_embeddings.weight", vocab_size),
        one_to_one("model.norm.weight", "decoder.final_layernorm.weight"),
        *layer_mappings,
    ]
    if not tied:
        mappings.append(vocabulary_mapping("lm_head.weight", "output_layer.weight", vocab_size))
    return StateDictMapping(tuple(mappings), {"lm_head.weight": "model.embed_tokens.weight"} if tied else {})


def attention_mappings(hf: str, megatron: str, config: TransformerConfig, keys_are_values: bool = False) -> List[TensorMapping]:
    """A transformers ``self_attn`` (q/k/v/o projections, q/k norms) <-> Megatron's ``self_attention``.

    config: the layer's ``TransformerConfig`` (its head dim and key/value heads). keys_are_values:
    the layer has no value projection (Gemma 4's ``attention_k_eq_v``).
    """
    groups, head_dim = config.num_query_groups, config.kv_channels
    projections = ("q_proj", "k_proj") if keys_are_values else ("q_proj", "k_proj", "v_proj")
    rows = (config.num_attention_heads // groups * head_dim,) + (head_dim,) * (len(projections) - 1)
    mappings = [
        TensorMapping(
            tuple(f"{hf}{p}.{kind}" for p in projections),
            (f"{megatron}linear_qkv.{kind}",),
            partial(interleave_query_groups, groups),
            partial(split_query_groups, num_query_groups=groups, rows_per_group=rows),
        )
        for kind in (("weight", "bias") if config.add_qkv_bias else ("weight",))
    ]
    return mappings + [
        one_to_one(hf + "o_proj.weight", megatron + "linear_proj.weight"),
        one_to_one(hf + "q_norm.weight", megatron + "q_layernorm.weight"),
        one_to_one(hf + "k_norm.weight", megatron + "k_layernorm.weight"),
    ]


def card_field(card: ModelCard, key: str, default: Any = _REQUIRED) -> Any:
    """``card.config[key]``; a missing required field is a ValueError naming the card."""
    value = card.config.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"model card {card.name!r} ({card.model_type}) lacks the required field {key!r}")
    return value
