"""``DualKVSelfAttention``: Megatron's ``SelfAttention`` that norms and rotates q and k itself,
in one fused function where it can, and can recompute them instead of keeping them
(``recompute_qk_norm_rope``, ``mcore.recompute``): the local spec's self-attention, and the base of
``GemmaSelfAttention``.

Megatron's ``SelfAttention.forward`` norms q and k in ``get_query_key_value_tensors``, rotates them
(RoPE) and hands them to the core attention. Here q and k are each one function of their view of
linear_qkv's output (reshape, norm, RoPE), in training and forward-only passes on either layout;
Megatron's forward gets ``rotary_pos_emb=None``, so that it does not rotate them a second time.
Why:
- Megatron's RoPE on the packed thd layout splits the tokens by ``cu_seqlens`` and reads each
  segment's offset back from the GPU: a host sync per segment, for q and k, in every layer and pass.
  ``DualKVGPTModel`` hands RoPE one frequency row per token, so the rotation here applies them all
  at once through Megatron's ``[s, b, ...]`` path: the same rows, the same bits, no sync.
- Where the norm is torch's RMSNorm (``FusedRMSNorm``: Qwen3) and the rotation the plain one over
  the whole head, ``ops.rms_norm_rope`` does both on CUDA, in one Triton kernel per direction that
  reads k in place. On the CPU its reference runs the same ops as torch's norm and Megatron's
  rotation, in order: the same bits.
- With ``recompute_qk_norm_rope`` the function runs through ``checkpoint_without_output``. Autograd
  would keep, per token: the q norm's input (a copy: the query reshape ``[sq, b, ng, np/ng*hn] ->
  [sq, b, np, hn]`` cannot be a view of linear_qkv's output), RoPE's cos/sin, the norms' statistics,
  and the rotated q and k that the attention kernel saves. The output of linear_qkv stays alive
  anyway (v is a view of it), so that is all the function saves. The rotated q and k are released
  once the sublayer's forward has returned, and recomputed when the gradient of its output arrives,
  before the attention's backward reads them.
- The output gate (Qwen3.5, Qwen3-Next) is ``ops.output_gate``, not Megatron's compiled function:
  that one keeps the float32 sigmoid instead of the gate whenever Dynamo runs it eagerly (past its
  recompile limit), and the memory the model counts would no longer hold.

Otherwise the rotation is Megatron's ``apply_rotary_pos_emb`` with the arguments its forward passes
in megatron-core 0.16 and 0.19: per token with ``cu_seqlens`` (the padded ones where given) on the
packed thd layout, whose batch dimension it squeezes first; on ``[s, b, heads, dim]`` without
packed params (the replicated layout); the YaRN mscale; Megatron's context-parallel group (a group
of one under our Ulysses CP, which rotates each rank's token slice before the all-to-all). With an
inference context, it is Megatron's module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, List, Optional, Tuple

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from torch import Tensor

from ..ops.checks import runs_kernels
from ..ops.output_gate import output_gate_func
from ..ops.rms_norm_rope import rms_norm_rope_func, rms_norm_rope_reference
from .norms import FusedRMSNorm
from .recompute import RecomputableQueryKey, Release, checkpoint_without_output


# Configurations whose Megatron forward rotates q and k other than after the split and norms.
UNSPLIT_ROPE_FIELDS = ("fused_single_qkv_rope",)


@dataclass
class _QueryKeyRope:
    """One forward's RoPE, from ``forward`` to ``get_query_key_value_tensors``: (q's, k's) frequencies
    (None: no rotation) and cu_seqlens (None: not packed); the releases of the q and k it produced."""

    freqs: Tuple[Optional[Tensor], Optional[Tensor]]
    cu_seqlens: Tuple[Optional[Tensor], Optional[Tensor]]
    releases: List[Release] = field(default_factory=list)


class DualKVSelfAttention(RecomputableQueryKey, SelfAttention):
    """``SelfAttention`` that norms and rotates q and k itself, as functions of linear_qkv's output,
    recomputed in layers where ``recompute_qk_norm_rope`` is set (see the module docstring)."""

    _rope: Optional[_QueryKeyRope] = None  # set while a forward that rotates q and k here runs

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if getattr(config, "recompute_qk_norm_rope", False):
            self.check_recomputable_query_key()

    def check_recomputable_query_key(self) -> None:
        """ValueError naming ``recompute_qk_norm_rope`` where Megatron's forward would not split and
        rotate q and k the way it is recomputed."""
        for name in UNSPLIT_ROPE_FIELDS:
            if getattr(self.config, name, False):
                raise ValueError(f"recompute_qk_norm_rope: the attention runs without {name}")

    def forward(self, hidden_states: Tensor, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        if not self._rotates_query_key(kwargs):
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        self._rope = _QueryKeyRope(self._rope_freqs(rotary_pos_emb), _rope_cu_seqlens(packed_seq_params))
        try:
            output, bias = super().forward(hidden_states, *args, rotary_pos_emb=None,
                                           packed_seq_params=packed_seq_params, **kwargs)
        finally:
            rope, self._rope = self._rope, None
        for release in rope.releases:
            release(output)
        return output, bias

    def _rotates_query_key(self, forward_kwargs) -> bool:
        """Whether this forward norms and rotates q and k here (see the module docstring): in
        training and forward-only passes, on either layout, so that both run the same math. Not with
        an inference context, which adjusts RoPE to its cache (only Megatron's forward does), nor
        where Megatron's forward rotates q and k its own way."""
        inference = any(forward_kwargs.get(name) is not None for name in ("inference_context", "inference_params"))
        return not inference and not any(getattr(self.config, name, False) for name in UNSPLIT_ROPE_FIELDS)

    def _recomputes_query_key(self) -> bool:
        return self.recompute_qk_norm_rope and torch.is_grad_enabled()

    def _rope_freqs(self, rotary_pos_emb) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(q's, k's) frequencies, as Megatron's forward takes them from its argument."""
        no_rope = self.config.no_rope_freq[self.layer_number - 1] if self.config.no_rope_freq else False
        if rotary_pos_emb is None or no_rope:
            return None, None
        return rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2

    @property
    def rotating_query_key(self) -> bool:
        """Whether the running forward norms and rotates q and k in ``get_query_key_value_tensors``."""
        return self._rope is not None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if not self.rotating_query_key:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if output_gate:
            query, gate, key, value = self.gated_query_key_value(hidden_states)
        else:
            query, key, value = self.unnormed_query_key_value(hidden_states)
        (q_freqs, k_freqs), (q_cu_seqlens, k_cu_seqlens) = self._rope.freqs, self._rope.cu_seqlens
        query = self._for_attention(self.query_heads, self.q_layernorm, q_freqs, q_cu_seqlens, query)
        key = self._for_attention(_unchanged, self.k_layernorm, k_freqs, k_cu_seqlens, key)
        return (query, key, value, self.query_heads(gate)) if output_gate else (query, key, value)

    def _apply_output_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        """x * sigmoid(gate) through ``ops.output_gate``: it keeps x and the gate heads, as the
        memory model counts, whether or not torch.compile compiles Megatron's gate."""
        return output_gate_func(x, gate)

    def unnormed_query_key_value(self, hidden_states: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """[sq, b, h] -> query [sq, b, ng, np/ng * hn], key and value [sq, b, ng, hn]: views of
        linear_qkv's output, split as Megatron splits it."""
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        return _split(mixed_qkv, split_sizes)

    def gated_query_key_value(self, hidden_states: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """With ``attention_output_gate`` (Qwen3.5, Qwen3-Next): query and gate [sq, b, ng, np/ng * hn],
        key and value [sq, b, ng, hn], each query group's rows as Megatron lays them out (its q
        heads, their gates, its k, its v). Megatron's own split of this layout also norms and
        rotates, so it is done here."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        groups, head_dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        query_rows = self.num_attention_heads_per_partition // groups * head_dim
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:2], groups, -1)
        return _split(mixed_qkv, [query_rows, query_rows, head_dim, head_dim])

    def query_heads(self, query: Tensor) -> Tensor:
        """[sq, b, ng, np/ng * hn] -> [sq, b, np, hn], as Megatron's ``get_query_key_value_tensors``
        (a layout whose heads tp splits evenly: DualKVAttention's)."""
        return query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)

    def normed_query(self, query: Tensor) -> Tensor:
        """``query_heads`` through the q norm."""
        return _normed(self.q_layernorm, self.query_heads(query))

    def normed_key(self, key: Tensor) -> Tensor:
        return _normed(self.k_layernorm, key)

    def _for_attention(self, heads: Callable[[Tensor], Tensor], norm, freqs, cu_seqlens, x: Tensor) -> Tensor:
        """``heads(x)`` normed and rotated; recomputed instead of kept where the layer recomputes it
        (a plain call where neither a norm nor RoPE computes anything: no new tensor to free)."""
        if freqs is None and (norm is None or isinstance(norm, IdentityOp)):
            return heads(x)
        rotated = partial(self._rotated, heads, norm, freqs, cu_seqlens)
        if self._recomputes_query_key():
            output, release = checkpoint_without_output(rotated, x)
            self._rope.releases.append(release)
        else:
            output = rotated(x)
        # thd: the batch dimension back, for Megatron's forward to squeeze
        return output if cu_seqlens is None else output.unsqueeze(1)

    def _rotated(self, heads, norm, freqs: Optional[Tensor], cu_seqlens: Optional[Tensor], x: Tensor) -> Tensor:
        """heads(x) normed and rotated as Megatron's forward does it; thd: [t, heads, dim], without the
        batch dimension."""
        x = heads(x)  # [s, b, heads, d]; thd: b = 1
        thd = cu_seqlens is not None
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        rope = partial(apply_rotary_pos_emb, config=self.config, mscale=mscale, cp_group=self.pg_collection.cp)
        # One frequency row per token: [s, 1, 1, d] of the replicated layout's positions, or
        # DualKVGPTModel's [t, 1, 1, d] of the packed tokens (Megatron's thd path would gather these
        # same rows segment by segment, with a host sync per segment, then rotate them the same way).
        per_token = freqs is not None and freqs.size(0) == x.size(0) and self.pg_collection.cp.size() == 1
        if freqs is None:
            x = _normed(norm, x)
        elif per_token and self._fuses_norm_and_rope(norm, freqs, x):
            fused = rms_norm_rope_func if runs_kernels(x) else rms_norm_rope_reference
            x = fused(x, norm.weight, norm.eps, freqs, mscale)
        elif thd and not per_token:
            return rope(_normed(norm, x).squeeze(1), freqs, cu_seqlens=cu_seqlens)
        else:
            x = rope(_normed(norm, x), freqs)
        return x.squeeze(1) if thd else x

    def _fuses_norm_and_rope(self, norm, freqs: Tensor, x: Tensor) -> bool:
        """Whether the norm is torch's RMSNorm (``FusedRMSNorm``) and the rotation Megatron's plain
        one over the whole head, which ``rms_norm_rope_func`` computes."""
        plain_rope = not (self.config.rotary_interleaved or self.config.multi_latent_attention)
        return (type(norm) is FusedRMSNorm and norm.weight is not None and norm.eps is not None and plain_rope
                and freqs.size(-1) == x.size(-1))


def _split(mixed_qkv: Tensor, sizes: List[int]) -> Tuple[Tensor, ...]:
    split = megatron_attention.SplitAlongDim  # Transformer Engine's, where Megatron found it
    return split(mixed_qkv, 3, sizes) if split is not None else torch.split(mixed_qkv, sizes, dim=3)


def _normed(norm, x: Tensor) -> Tensor:
    return x if norm is None else norm(x)


def _unchanged(x: Tensor) -> Tensor:
    return x


def _rope_cu_seqlens(packed_seq_params) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(q's, k's) cu_seqlens of Megatron's per-token (thd) RoPE; (None, None) without packed params."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None, None
    params = packed_seq_params
    q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    return q, k
