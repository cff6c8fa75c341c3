"""``DualKVGatedDeltaNet``: Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) on the packed layout.

A GDN layer is a recurrence: on a packed micro-batch ``[P][R1]..[RN]`` (or a prefix tree) every
segment starts from its parent's final state, not from zero and not from the previous segment's.
Two pieces carry state across a segment boundary, and both follow the layout's tree:

* the short causal convolution (width K, 4) over q, k and v: a response's first K-1 tokens read
  the last K-1 inputs of its path (``ops.causal_conv1d_func``);
* the gated delta rule: a response starts from its prompt's final state, per head a (Dk, Dv)
  matrix (``ops.gated_delta_rule_func``: a chunked kernel once per tree level on CUDA, fla's where
  it is usable, else the PyTorch one; the reference recurrence elsewhere).

Autograd through those gathers sums a shared state's gradient over its children. Without packed
params (the replicated layout) each row of the batch is one sequence from zero state.

Prefix reuse (``rl.prefix_reuse``, a group split into micro-batches that share one prompt pass):
the prompt's pass holds the prompt's final state and its last K-1 conv inputs, and each part's
responses (a ``PrefixedLayout``) start from them, as they would packed after the prompt.

The math is transformers' ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``: q, k, v = SiLU(conv
(x W_qkv)); q and k L2-normalised, each key head serving ``value_heads / key_heads`` value heads;
beta = sigmoid(x W_b); the decay g = -exp(A_log) * softplus(x W_a + dt_bias); the output is
RMSNorm(o) * w * SiLU(x W_z), then ``out_proj``.

Why our own module and not Megatron's ``GatedDeltaNet``: Megatron's refuses packed sequences and
imports fla at construction (no CPU), and it moved between megatron-core 0.16 and 0.19.

Tensor parallelism splits heads: ``in_proj`` is one column-parallel linear whose rows are grouped
per key head (its q and k rows, then the v, z, b and a rows of the value heads it serves), so a
contiguous split by tp gives each rank whole key heads with their value heads; the conv channels,
``A_log`` and ``dt_bias`` are split the same way, ``out_proj`` is row-parallel. The Hugging Face
conversion reorders the rows (``models.qwen3_next``).

Ulysses context parallelism (the params' ``cp_group``): the conv and delta rule need every token, so
their inputs go from this rank's tokens to its share of the key heads over the whole sequence, and
the output comes back before the gated norm (``mcore.context_parallel``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor

from ..layout import PackedLayout, PrefixedLayout, TreeLayout
from ..ops.causal_conv1d import causal_conv1d_func
from ..ops.checks import runs_kernels
from ..ops.gated_delta_rule import gated_delta_rule_func
from .context_parallel import context_parallel_size, heads_to_tokens, local_heads, local_tokens, tokens_to_heads
from .recompute import Release, checkpoint_without_output

# the parameters of the module itself that tensor parallelism splits along dim 0 (per value/conv channel)
TP_SPLIT_PARAMETERS = {"conv_weight": 0, "A_log": 0, "dt_bias": 0}


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


class DualKVGatedDeltaNet(MegatronModule):
    """A GDN token mixer in the place of a ``TransformerLayer``'s self-attention: [s, b, h] ->
    ([s, b, h], None). Its sizes are the config's ``linear_*`` fields (transformers' names).

    Selective recompute (set per layer by ``GatedDeltaNetLayer``): the conv's output (with its
    SiLU) is freed once the delta rule has run, the gated norm's once ``out_proj`` has saved it,
    and each is recomputed in the backward from what it kept: the conv from its input, without the
    gathered input and the pre-SiLU output it would save, and the norm from o and the gate. Where
    the conv runs its Triton kernels (CUDA) it keeps only its input anyway, so it is not recomputed."""

    recompute_conv = False  # with the layer's recompute_activations
    recompute_gated_norm = False  # with the layer's recompute_norms

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = 1, pg_collection=None, **kwargs):
        super().__init__(config)
        self.layer_number = layer_number
        tp = pg_collection.tp if pg_collection is not None else None
        tp_size, tp_rank = (tp.size(), tp.rank()) if tp is not None else (1, 0)
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})")
        if key_heads % tp_size:
            raise ValueError(f"linear_num_key_heads ({key_heads}) must split evenly over tensor parallelism {tp_size}")
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.values_per_key = value_heads // key_heads
        self.local_key_heads = key_heads // tp_size
        self.width = config.linear_conv_kernel_dim
        # per key head: its conv channels (q, k, v), then the z, b and a rows of its value heads
        group_rows = self.conv_group_channels + self.values_per_key * (self.value_dim + 2)
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, key_heads * group_rows, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1", tp_group=tp,
        )
        local_values = self.local_key_heads * self.values_per_key
        conv_channels = self.local_key_heads * self.conv_group_channels
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(torch.empty(conv_channels, self.width, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(local_values, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(local_values, dtype=dtype))
        for name in TP_SPLIT_PARAMETERS:
            set_tensor_model_parallel_attributes(getattr(self, name), True, 0, 1)
        with torch.no_grad():
            # transformers' initialisation (conv as nn.Conv1d's default, A uniform in (0.01, 16)), drawn
            # whole and sliced: the same seed gives the same full weights at any tp, as Megatron's
            # linears initialised on the host
            bound = self.width**-0.5
            conv = torch.empty(key_heads * self.conv_group_channels, self.width).uniform_(-bound, bound)
            a_log = torch.empty(value_heads).uniform_(0.01, 16).log()
            self.conv_weight.copy_(conv.chunk(tp_size)[tp_rank])
            self.A_log.copy_(a_log.chunk(tp_size)[tp_rank])
        self.norm_weight = torch.nn.Parameter(torch.ones(self.value_dim, dtype=dtype))
        self.norm_eps = config.layernorm_epsilon
        self.tp_group = tp
        self.out_proj = build_module(
            submodules.out_proj, value_heads * self.value_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="proj", tp_group=tp,
        )

    @property
    def conv_group_channels(self) -> int:
        """Conv channels of one key head: its q and k, and the v of the value heads it serves."""
        return 2 * self.key_dim + self.values_per_key * self.value_dim

    def forward(self, hidden_states: Tensor, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        inference = any(kwargs.get(name) is not None for name in ("inference_context", "inference_params"))
        if inference:
            raise NotImplementedError("DualKVGatedDeltaNet: no inference (KV-cache) path; training and forward-only passes")
        projected, _ = self.in_proj(hidden_states)  # [s, b, local key heads * group rows]
        seq, batch = projected.shape[:2]
        layout = _layout_of(packed_seq_params, seq, batch, projected.device)
        tokens = projected.transpose(0, 1).reshape(seq * batch, self.local_key_heads, -1)
        qkv, z, b, a = torch.split(
            tokens, [self.conv_group_channels, self.values_per_key * self.value_dim, self.values_per_key,
                     self.values_per_key], dim=-1)
        cp_group = getattr(packed_seq_params, "cp_group", None)
        ulysses = context_parallel_size(cp_group) > 1
        if ulysses:
            # the recurrence needs every token: this rank's key heads over the whole sequence (the
            # gate z stays with the tokens, for the gated norm after the way back)
            qkv, b, a = tokens_to_heads((qkv, b, a), cp_group)
        conv_input = qkv.reshape(len(qkv), -1)
        held = getattr(packed_seq_params, "held_prompt", None)
        reads_held = held is not None and isinstance(layout, PrefixedLayout)
        conv_layout, initial_state, extended = layout, None, conv_input
        if reads_held:
            tail, initial_state = held.kv[self.layer_number]
            extended, conv_layout = _after_held_tail(conv_input, tail, layout, self.width)
        conv = functools.partial(causal_conv1d_func, weight=local_heads(self.conv_weight, cp_group),
                                 layout=conv_layout, activation="silu")
        # the conv's kernels keep only their input, as the checkpoint would: nothing to recompute
        conv_output, release_conv = checkpoint_without_output(
            conv, extended, enabled=self.recompute_conv and not runs_kernels(extended))
        conv_output = conv_output[len(extended) - len(conv_input):]  # a part's own rows, after the held tail's
        q, k, v = torch.split(conv_output.view_as(qkv),
                              [self.key_dim, self.key_dim, self.values_per_key * self.value_dim], dim=-1)
        out, final_states = self._delta_rule(q, k, v, b, a, layout, initial_state, cp_group)  # [T, value heads, Dv]
        if held is not None and not reads_held:
            # the prompt's pass: its segment is the layout's first
            out = held.hold_state(self.layer_number, out, conv_input, final_states[0], self.width)
        release_conv(out)
        if ulysses:
            out = heads_to_tokens(out, cp_group)
        per_head = (z.shape[0], -1, self.value_dim)
        normed, release_norm = self._gated_norm_kept_lean(out.view(per_head), z.reshape(per_head), hidden_states.dtype)
        output = self.out_proj(normed.view(batch, seq, -1).transpose(0, 1))
        if self.recompute_gated_norm:
            release_norm(output[0])
        return output

    def _delta_rule(self, q: Tensor, k: Tensor, v: Tensor, b: Tensor, a: Tensor, layout: PackedLayout,
                    initial_state: Optional[Tensor], cp_group) -> Tuple[Tensor, Tensor]:
        """(output, every segment's final state). Each key head's q and k serve its value heads; beta
        and the log decay g in float32, as transformers computes them."""
        tokens = q.shape[0]
        a_log, dt_bias = (local_heads(p, cp_group).float() for p in (self.A_log, self.dt_bias))
        beta = b.float().sigmoid().reshape(tokens, -1)
        decay = -a_log.exp() * F.softplus(a.float().reshape(tokens, -1) + dt_bias)
        return gated_delta_rule_func(q, k, v.reshape(tokens, -1, self.value_dim), decay, beta, layout,
                                     initial_state=initial_state, qk_l2norm=True)

    def _gated_norm_kept_lean(self, out: Tensor, gate: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Release]:
        """The gated norm, keeping only its inputs (``checkpoint_without_output``), and the release of
        its output: its float32 chain would keep five float32 copies of the values per token (80 KiB
        a token at Qwen3.5-4B's widths, ten times out_proj's input), and its backward recomputes them
        in a few elementwise kernels instead."""
        return checkpoint_without_output(functools.partial(self._gated_norm, dtype=dtype), out, gate)

    def _gated_norm(self, out: Tensor, gate: Tensor, dtype: torch.dtype) -> Tensor:
        """RMSNorm over each head's values, times ``norm_weight`` and SiLU of the gate, in float32,
        returned in ``dtype``.

        Every head shares ``norm_weight`` and each tensor-parallel rank holds some heads: the weight
        enters through Megatron's copy-to-TP-region, whose backward sums the ranks' gradients."""
        weight = self.norm_weight if self.tp_group is None else copy_to_tensor_model_parallel_region(self.norm_weight,
                                                                                                     self.tp_group)
        out = out.float()
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (normed * weight.float() * F.silu(gate.float())).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Tuple = (), metadata: Optional[dict] = None,
                           tp_group=None):
        """Megatron's distributed checkpoint: the module's own tensors split along TP like its heads."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = tp_group if tp_group is not None else self.tp_group
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, TP_SPLIT_PARAMETERS, sharded_offsets,
                                                      tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        return sharded


def _layout_of(packed_seq_params, seq: int, batch: int, device) -> PackedLayout:
    """The packed micro-batch's layout; without packed params each batch row is a sequence of its own."""
    layout = getattr(packed_seq_params, "layout", None)
    if layout is not None:
        tokens = local_tokens(packed_seq_params)
        if batch != 1 or tokens.stop - tokens.start != seq:
            cp = context_parallel_size(packed_seq_params.cp_group)
            raise ValueError(f"DualKVGatedDeltaNet: {seq} x {batch} hidden states for a layout of "
                             f"{layout.total_tokens} tokens" + (f" split over {cp} context-parallel ranks" if cp > 1 else ""))
        return layout
    if packed_seq_params is not None:
        raise ValueError("DualKVGatedDeltaNet: packed params without a DualKV layout (DualKVPackedSeqParams.from_layout)")
    return _rows_layout(seq, batch, torch.device(device))


def _after_held_tail(conv_input: Tensor, tail: Tensor, layout: PrefixedLayout,
                     width: int) -> Tuple[Tensor, PackedLayout]:
    """A prefix-reuse part's conv input after its prompt's held last inputs ``tail`` (K-1 rows,
    fewer in a shorter prompt: zeros before them, as before any root), and the layout in which that
    tail is the root of every segment, so each window reaches back into the prompt."""
    if layout.num_groups != 1:
        raise ValueError("DualKVGatedDeltaNet: prefix reuse holds one prompt, got a PrefixedLayout of "
                         f"{layout.num_groups}")
    carry = width - 1
    if not carry:
        return conv_input, layout
    rows = torch.cat([tail.new_zeros(carry - len(tail), tail.shape[1]), tail, conv_input])
    return rows, layout.derived(("gdn_held_tail", carry), lambda: _under_a_root(layout, carry))


def _under_a_root(layout: PackedLayout, length: int) -> TreeLayout:
    """``layout``'s segments (padding included) under one new root segment of ``length`` tokens."""
    lens = (length, *(node.length for node in layout.nodes))
    parents = (-1, *(node.parent + 1 if node.parent >= 0 else 0 for node in layout.nodes))
    return TreeLayout(lens, parents, device=layout.device)


@functools.lru_cache(maxsize=16)
def _rows_layout(seq: int, batch: int, device: torch.device) -> TreeLayout:
    """Each of ``batch`` rows a sequence of its own: one layout per shape, so the plans that the
    conv and the delta rule derive from it are built once, not again in every GDN layer."""
    return TreeLayout((seq,) * batch, (-1,) * batch, device=device)
