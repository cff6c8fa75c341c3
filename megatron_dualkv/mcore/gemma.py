"""Gemma 3 / Gemma 4 text decoders on Megatron-Core: the layers Megatron does not provide.

Built from subclasses and a ``ModuleSpec``, never by editing Megatron (transformers'
``Gemma3DecoderLayer`` / ``Gemma4TextDecoderLayer`` are the reference):

* ``GemmaRMSNorm``: RMSNorm computed in float32, weight ``1 + w`` (Gemma 3, zero-centred, which is
  ``layernorm_zero_centered_gamma``) or ``w`` (Gemma 4), or no weight (Gemma 4's value norm); on
  GPU one Triton kernel per direction (``ops/rms_norm.py``).
* ``PostNormRowParallelLinear`` (``PostNorm`` on Megatron's or Transformer Engine's linear): a
  row-parallel linear followed by a norm of its reduced output.
  As ``linear_proj`` it is Gemma's post-attention norm, as ``linear_fc2`` its post-feedforward
  norm: the norms sit between the sublayer and its residual add, where ``TransformerLayer`` has
  no slot.
* ``GemmaMLP``: Megatron's gated MLP with Gemma's tanh-GELU gate as one Triton kernel per
  direction on GPU (``ops/geglu.py``; Megatron fuses only erf-GELU and SiLU gates).
* ``GemmaSelfAttention``: per-layer-type head dim and key/value heads (Gemma 4 full-attention
  layers: 512 and fewer heads), keys reused as values (``attention_k_eq_v``), the value norm, and
  the layer type's RoPE frequencies; a ``DualKVSelfAttention``, so its q/k norms and RoPE are
  recomputed under ``recompute_qk_norm_rope``.
* ``GemmaTransformerLayer``: ``DualKVTransformerLayer`` (the selective recompute of
  ``mcore.recompute``, which also covers ``GemmaRMSNorm`` and ``GemmaMLP``) times Gemma 4's
  ``layer_scalar``.
* ``GemmaGPTModel``: ``DualKVGPTModel`` with the embedding scaled by ``sqrt(hidden_size)``,
  RoPE per layer type and final logit softcapping.

Sliding-window layers are the layers ``config.window_size`` / ``window_attn_skip_freq`` give a
window (the rule Megatron's own attention uses); on the packed layout ``DualKVAttention`` turns
that window into the DualKV kernel's left window in logical positions, so a response token near
the start of its response still sees the end of its prompt. The others are full-attention layers.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional, Sequence

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from ..ops.checks import runs_kernels
from ..ops.geglu import geglu_func, geglu_reference
from ..ops.rms_norm import rms_norm_func, rms_norm_reference
from .attention import DualKVAttention
from .config import DualKVTransformerConfig
from .glu import plain_gated_linear_unit
from .gpt_model import DualKVGPTModel
from .layer_specs import LOCAL_SHARDED_KEYS, require_transformer_engine
from .mlp import DualKVMLP
from .recompute import DualKVTransformerLayer, RecomputableOutput
from .self_attention import DualKVSelfAttention


@dataclass
class GemmaTransformerConfig(DualKVTransformerConfig):
    """``TransformerConfig`` plus what differs between Gemma's full-attention and sliding layers.

    ``kv_channels`` / ``num_query_groups`` are those of the sliding-window layers; the
    ``full_attention_*`` fields, when set, replace them in full-attention layers.
    """

    full_attention_kv_channels: Optional[int] = None
    full_attention_num_query_groups: Optional[int] = None
    full_attention_keys_are_values: bool = False
    """Full-attention layers project no values and use their (un-normed) keys instead."""
    value_norm: bool = False
    """RMSNorm without weight on the values (Gemma 4)."""
    layer_scalar: bool = False
    """Each layer's output is multiplied by a per-layer scalar buffer (Gemma 4)."""

    def is_full_attention(self, layer_number: int) -> bool:
        """``layer_number``: 1-based over the whole model, as Megatron numbers layers."""
        return not is_layer_window_attention(self.window_size, self.window_attn_skip_freq, layer_number)

    @property
    def full_attention_head_dim(self) -> int:
        return self.full_attention_kv_channels or self.kv_channels

    def for_layer(self, layer_number: int) -> "GemmaTransformerConfig":
        """This config with the head dim and key/value heads of the layer's type."""
        if not self.is_full_attention(layer_number):
            return self
        layer = copy.copy(self)  # no __post_init__: the fields are already validated
        layer.kv_channels = self.full_attention_head_dim
        layer.num_query_groups = self.full_attention_num_query_groups or self.num_query_groups
        return layer

    def rope_columns(self, layer_number: int) -> slice:
        """Where the layer's RoPE frequencies sit in ``LayerTypeRotaryEmbedding``'s table."""
        if self.is_full_attention(layer_number):
            return slice(self.kv_channels, self.kv_channels + self.full_attention_head_dim)
        return slice(0, self.kv_channels)


class GemmaRMSNorm(RecomputableOutput):
    """RMSNorm in float32 like transformers' Gemma3RMSNorm / Gemma4RMSNorm, cast back to the input dtype.

    Weight ``1 + w`` (initialised to 0) when ``config.layernorm_zero_centered_gamma`` (Gemma 3),
    ``w`` (initialised to 1) otherwise; ``with_scale=False`` normalises only.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.zero_centered = config.layernorm_zero_centered_gamma
        if with_scale:
            init = torch.zeros if self.zero_centered else torch.ones
            self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
            # Megatron all-reduces the gradients of such weights when sequence parallelism splits tokens
            self.weight.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("weight", None)

    def compute(self, x: Tensor) -> Tensor:
        norm = rms_norm_func if runs_kernels(x) else rms_norm_reference  # one Triton kernel per direction on GPU
        return norm(x, self.weight, self.eps, self.zero_centered)


class PostNorm:
    """Mixin of a row-parallel linear whose (tensor-parallel reduced) output goes through a ``GemmaRMSNorm``."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, bias: bool, **kwargs):
        if bias:
            raise ValueError(f"{type(self).__name__} has no bias: the norm would have to follow the bias add")
        super().__init__(input_size, output_size, config=config, bias=bias, **kwargs)
        self.post_norm = GemmaRMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_: Tensor):
        output, bias = super().forward(input_)
        return self.post_norm(output), bias


class PostNormRowParallelLinear(PostNorm, RowParallelLinear):
    """Megatron's ``RowParallelLinear`` followed by a ``GemmaRMSNorm``."""


@lru_cache(maxsize=None)
def _te_linears():
    """(fused norm + column-parallel, column-parallel, post-normed row-parallel) linears of Transformer Engine."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear,
    )

    post_normed = type("PostNormTERowParallelLinear", (PostNorm, TERowParallelLinear),
                       {"__doc__": "Transformer Engine's row-parallel linear followed by a ``GemmaRMSNorm``."})
    return TELayerNormColumnParallelLinear, TEColumnParallelLinear, post_normed


class GemmaMLP(DualKVMLP):
    """``MLP`` whose activation is Gemma's GeGLU, ``gelu_tanh(gate) * linear`` over fc1's two halves,
    one Triton kernel per direction on GPU: Megatron's unfused path would run four PyTorch ops.
    Recomputed instead of kept where ``recompute_activation`` is set (``DualKVMLP``)."""

    def __init__(
        self, config: TransformerConfig, submodules: MLPSubmodules, pg_collection=None, is_mtp_layer: bool = False,
        **kwargs,
    ):
        if not plain_gated_linear_unit(config):
            raise ValueError("GemmaMLP is Gemma's GeGLU: gated_linear_unit, no clamp, no linear offset")
        # Megatron >= 0.17 hands a subclass of MLP the layer's process groups (as to its
        # ``as_mlp_submodule``); older versions hand it nothing and MLP takes the global groups.
        if pg_collection is not None:
            kwargs.setdefault("tp_group", pg_collection.tp)
        super().__init__(config, submodules, **kwargs)

    def activation(self, intermediate: Tensor) -> Tensor:
        return (geglu_func if runs_kernels(intermediate) else geglu_reference)(intermediate)


@dataclass
class GemmaSelfAttentionSubmodules(SelfAttentionSubmodules):
    v_layernorm: Optional[ModuleSpec] = None


class GemmaSelfAttention(DualKVSelfAttention):
    """``SelfAttention`` of one Gemma layer type (see ``GemmaTransformerConfig``).

    Takes the model's ``LayerTypeRotaryEmbedding`` table as ``rotary_pos_emb`` and applies the
    columns of its own layer type. The value norm is applied outside the recomputed q and k
    (``DualKVSelfAttention``).
    """

    def __init__(
        self,
        config: GemmaTransformerConfig,
        submodules: GemmaSelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        **kwargs,  # what the Megatron version hands SelfAttention (cp_comm_type, pg_collection, ...)
    ):
        keys_are_values = config.full_attention_keys_are_values and config.is_full_attention(layer_number)
        if keys_are_values:
            submodules = replace(submodules, linear_qkv=_without_value_rows(submodules.linear_qkv))
        rope_columns = config.rope_columns(layer_number)
        super().__init__(config.for_layer(layer_number), submodules, layer_number, attn_mask_type, **kwargs)
        self.keys_are_values = keys_are_values
        self.rope_columns = rope_columns
        if keys_are_values:
            self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
            if self.config.num_query_groups < self.world_size:
                raise ValueError(
                    f"layer {layer_number}: keys reused as values need at least one key/value head per tensor-parallel "
                    f"rank, got {self.config.num_query_groups} heads for tp={self.world_size}"
                )
        self.v_layernorm = None
        if submodules.v_layernorm is not None:
            self.v_layernorm = build_module(
                submodules.v_layernorm, hidden_size=self.hidden_size_per_attention_head, config=self.config,
                eps=self.config.layernorm_epsilon,
            )

    def forward(self, hidden_states: Tensor, *args, rotary_pos_emb: Optional[Tensor] = None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[..., self.rope_columns]
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if output_gate or not split_qkv:
            raise ValueError("GemmaSelfAttention has no output gate and splits q/k/v (fused_single_qkv_rope off)")
        if self.keys_are_values and not self.rotating_query_key:  # Megatron's split expects value rows
            query, key, value = self.unnormed_query_key_value(hidden_states)
            query, key = self.normed_query(query), self.normed_key(key)
        else:
            query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        if self.v_layernorm is not None:
            value = self.v_layernorm(value)
        return query, key, value

    def unnormed_query_key_value(self, hidden_states: Tensor):
        """``DualKVSelfAttention``'s; with keys as values the raw keys (views of linear_qkv's ``[q | k]``
        output) are the values too."""
        if not self.keys_are_values:
            return super().unnormed_query_key_value(hidden_states)
        mixed, _ = self.linear_qkv(hidden_states)
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        head_dim = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:-1], self.num_query_groups_per_partition, (heads_per_group + 1) * head_dim)
        query, key = torch.split(mixed, [heads_per_group * head_dim, head_dim], dim=3)
        return query, key, key


def _without_value_rows(linear_qkv):
    """A ``linear_qkv`` builder for layers whose values are their keys: the ``[q | k | v]`` output minus ``v``."""

    def build(input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        return linear_qkv(input_size, output_size - config.kv_channels * config.num_query_groups, config=config, **kwargs)

    return build


class GemmaTransformerLayer(DualKVTransformerLayer):
    """``DualKVTransformerLayer`` whose output is multiplied by ``layer_scalar`` (Gemma 4).

    A persistent buffer, not a parameter, as in transformers: checkpoints carry it, training
    leaves it alone.
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        return output * self.layer_scalar, context


def gemma_block_spec(
    config: GemmaTransformerConfig, use_transformer_engine: bool = False, vp_stage: Optional[int] = None
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: Gemma layers of Megatron's torch-native modules, or
    with Transformer Engine's linears.

    TE: the input and pre-feedforward norms are fused into ``linear_qkv`` and ``linear_fc1``
    (TE's RMSNorm, ``1 + w`` through its ``zero_centered_gamma``); with ``recompute_norms`` they are
    ``GemmaRMSNorm``s in front of TE's plain linears, whose outputs can be freed. The post norms,
    the q/k/v norms, the GeGLU and the layer scalar are ours in both. A TE layer stores its fused
    norms under the local layer's keys, so checkpoints load into either spec.
    """
    value_norm = ModuleSpec(module=GemmaRMSNorm, params={"with_scale": False}) if config.value_norm else None
    input_norm = pre_mlp_norm = GemmaRMSNorm
    column, row, keys_map = ColumnParallelLinear, PostNormRowParallelLinear, {}
    if use_transformer_engine:
        require_transformer_engine("the Gemma TE spec")
        fused, column, row = _te_linears()
        if not getattr(config, "recompute_norms", False):
            input_norm = pre_mlp_norm = IdentityOp
            column = fused
            # Gemma's local layers store their norms under their own names: the fused ones go back to them
            keys_map = {fused_name: name for name, fused_name in LOCAL_SHARDED_KEYS.items()}
    layer = ModuleSpec(
        module=GemmaTransformerLayer if config.layer_scalar else DualKVTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=ModuleSpec(
                module=GemmaSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=GemmaSelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=DualKVAttention,
                    linear_proj=row,
                    q_layernorm=GemmaRMSNorm,
                    k_layernorm=GemmaRMSNorm,
                    v_layernorm=value_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=ModuleSpec(module=GemmaMLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage), layer_norm=GemmaRMSNorm)


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's RoPE, as transformers' ``rope_parameters`` entry describes it.

    rope_type: "default"; "linear" (frequencies divided by ``factor``); "proportional" (Gemma 4's
    p-RoPE: only the first ``partial_rotary_factor`` of the frequency pairs rotate, with the
    exponents of the full head dim, the rest stay still).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def inv_freq(self, head_dim: int) -> Tensor:
        """(head_dim // 2,) float32 inverse frequencies, computed as transformers computes them."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if self.rope_type == "proportional":
            inv_freq[int(self.partial_rotary_factor * head_dim // 2):] = 0.0
        return inv_freq / self.factor if self.rope_type in ("linear", "proportional") else inv_freq


class LayerTypeRotaryEmbedding(torch.nn.Module):
    """The RoPE frequency tables of every layer type side by side: ``[s, 1, 1, sum of head dims]``.

    One tensor, so it travels through Megatron's ``rotary_pos_emb`` argument unchanged (packed
    per-token gathering, activation recomputation, pipeline stages); each ``GemmaSelfAttention``
    takes its ``rope_columns``. Per layer type the columns are ``cat(freqs, freqs)`` like
    Megatron's ``RotaryEmbedding`` (non-interleaved), so its RoPE application applies them.
    """

    def __init__(self, inv_freqs: Sequence[Tensor]):
        super().__init__()
        # a plain attribute, not a buffer: mixed-precision wrappers must not cast it to bf16
        self.inv_freq = torch.cat([torch.cat([f, f]) for f in inv_freqs])

    get_rotary_seq_len = RotaryEmbedding.get_rotary_seq_len

    @lru_cache(maxsize=8)
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        """The table for positions offset .. offset + max_seq_len - 1. ``packed_seq`` and ``cp_group``
        are Megatron's arguments; the table is never split by context-parallel rank here, because
        ``DualKVGPTModel`` gives Megatron's modules a context-parallel group of one."""
        if torch.cuda.is_available() and self.inv_freq.device.type == "cpu":
            self.inv_freq = self.inv_freq.to(torch.cuda.current_device())
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        return torch.outer(positions, self.inv_freq)[:, None, None, :]


class GemmaGPTModel(DualKVGPTModel):
    """``DualKVGPTModel`` for a Gemma text decoder built with ``gemma_block_spec``.

    sliding_rope / full_rope: the RoPE of each layer type. final_logit_softcapping: logits become
    ``c * tanh(logits / c)`` (None: off). Token embeddings are multiplied by ``sqrt(hidden_size)``
    rounded to the embedding dtype, as transformers does; a ``decoder_input`` passed by the caller
    is used as given.
    """

    def __init__(
        self,
        config: GemmaTransformerConfig,
        transformer_layer_spec,
        vocab_size: int,
        max_sequence_length: int,
        *,
        sliding_rope: RopeSpec,
        full_rope: RopeSpec,
        final_logit_softcapping: Optional[float] = None,
        **kwargs,
    ):
        super().__init__(
            config, transformer_layer_spec, vocab_size, max_sequence_length, position_embedding_type="rope", **kwargs
        )
        self.rotary_pos_emb = LayerTypeRotaryEmbedding(
            [sliding_rope.inv_freq(config.kv_channels), full_rope.inv_freq(config.full_attention_head_dim)]
        )
        self.final_logit_softcapping = final_logit_softcapping

    def _preprocess(self, input_ids, position_ids, decoder_input=None, **kwargs):
        embeds_here = decoder_input is None and self.pre_process
        outputs = super()._preprocess(input_ids, position_ids, decoder_input, **kwargs)
        if not embeds_here:
            return outputs
        scale = _embedding_scale(self.config.hidden_size, self.embedding.word_embeddings.weight.dtype)
        return (outputs[0] * scale, *outputs[1:])

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        cap = self.final_logit_softcapping
        if cap is None or self._skip_output_layer:  # no logits to cap (linear_logprobs_func caps its own)
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        logits = super()._postprocess(hidden_states, input_ids, position_ids, None, *args, **kwargs)
        if not self.post_process:
            return logits  # hidden states of a pipeline stage without the output layer
        logits = torch.tanh(logits / cap) * cap
        if labels is None:
            return logits
        return self.compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())


@lru_cache(maxsize=None)
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's sqrt(hidden_size) embedding scale rounded to the weights' dtype, as HF's Gemma does;
    a Python number, so no host-to-device copy per forward."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype))
