"""``DualKVSelfAttention``: Megatron's ``SelfAttention`` whose q/k norms and RoPE can be recomputed
instead of kept (``recompute_qk_norm_rope``, ``mcore.recompute``): the local spec's self-attention,
and the base of ``GemmaSelfAttention``.

Megatron's ``SelfAttention.forward`` norms q and k in ``get_query_key_value_tensors``, rotates them
(RoPE) and hands them to the core attention. Autograd then keeps, per token: the q norm's input (a
copy: the query reshape ``[sq, b, ng, np/ng*hn] -> [sq, b, np, hn]`` cannot be a view of
linear_qkv's output), RoPE's cos/sin, the norms' statistics, and the rotated q and k that the
attention kernel saves. Here q and k are each one function of their view of linear_qkv's output
(reshape, norm, RoPE), run through ``checkpoint_without_output``; the output of linear_qkv stays
alive anyway (v is a view of it), so that is all they save. The rotated q and k are released once
the sublayer's forward has returned and recomputed when the gradient of its output arrives, before
the attention's backward reads them. Megatron's forward gets ``rotary_pos_emb=None``: it must not
rotate them a second time.

The rotation is Megatron's ``apply_rotary_pos_emb`` with the arguments its forward passes in
megatron-core 0.16 and 0.19: per token with ``cu_seqlens`` (the padded ones where given) on the
packed thd layout, whose batch dimension it squeezes first; on ``[s, b, heads, dim]`` without
packed params (the replicated layout); the YaRN mscale; Megatron's context-parallel group (a group
of one under our Ulysses CP, which rotates each rank's token slice before the all-to-all).
Without the setting, and without autograd or with an inference context, it is Megatron's module.
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

from .recompute import RecomputableQueryKey, Release, checkpoint_without_output


# Configurations whose Megatron forward rotates q and k other than after the split and norms.
UNSPLIT_ROPE_FIELDS = ("fused_single_qkv_rope", "attention_output_gate")


@dataclass
class _QueryKeyRope:
    """One forward's RoPE, from ``forward`` to ``get_query_key_value_tensors``: (q's, k's) frequencies
    (None: no rotation) and cu_seqlens (None: not packed); the releases of the q and k it produced."""

    freqs: Tuple[Optional[Tensor], Optional[Tensor]]
    cu_seqlens: Tuple[Optional[Tensor], Optional[Tensor]]
    releases: List[Release] = field(default_factory=list)


class DualKVSelfAttention(RecomputableQueryKey, SelfAttention):
    """``SelfAttention`` that norms and rotates q and k as recomputed functions of linear_qkv's
    output in layers where ``recompute_qk_norm_rope`` is set (see the module docstring)."""

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
        if not self._rotates_query_key(kwargs, packed_seq_params):
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

    def _rotates_query_key(self, forward_kwargs, packed_seq_params) -> bool:
        """Whether this forward norms and rotates q and k here: where they are recomputed (in
        training), and on the packed thd layout, whose per-token RoPE Megatron's forward applies
        segment by segment, reading each segment's offset back from the GPU (a host sync per
        segment, per layer and pass). Not with an inference context, which adjusts RoPE to its cache
        (only Megatron's forward does), nor where Megatron's forward rotates q and k its own way."""
        inference = any(forward_kwargs.get(name) is not None for name in ("inference_context", "inference_params"))
        if inference or any(getattr(self.config, name, False) for name in UNSPLIT_ROPE_FIELDS):
            return False
        return self._recomputes_query_key() or _rope_cu_seqlens(packed_seq_params)[0] is not None

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
        query, key, value = self.unnormed_query_key_value(hidden_states)
        (q_freqs, k_freqs), (q_cu_seqlens, k_cu_seqlens) = self._rope.freqs, self._rope.cu_seqlens
        query = self._for_attention(self.normed_query, self.q_layernorm, q_freqs, q_cu_seqlens, query)
        key = self._for_attention(self.normed_key, self.k_layernorm, k_freqs, k_cu_seqlens, key)
        return query, key, value

    def unnormed_query_key_value(self, hidden_states: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """[sq, b, h] -> query [sq, b, ng, np/ng * hn], key and value [sq, b, ng, hn]: views of
        linear_qkv's output, split as Megatron splits it."""
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        split = megatron_attention.SplitAlongDim  # Transformer Engine's, where Megatron found it
        return split(mixed_qkv, 3, split_sizes) if split is not None else torch.split(mixed_qkv, split_sizes, dim=3)

    def normed_query(self, query: Tensor) -> Tensor:
        """[sq, b, ng, np/ng * hn] -> [sq, b, np, hn] through the q norm, as Megatron's
        ``get_query_key_value_tensors`` (a layout whose heads tp splits evenly: DualKVAttention's)."""
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        return query if self.q_layernorm is None else self.q_layernorm(query)

    def normed_key(self, key: Tensor) -> Tensor:
        return key if self.k_layernorm is None else self.k_layernorm(key)

    def _for_attention(self, normed: Callable[[Tensor], Tensor], norm, freqs, cu_seqlens, x: Tensor) -> Tensor:
        """``normed(x)`` rotated; recomputed instead of kept where the layer recomputes it (a plain
        call where neither a norm nor RoPE computes anything: no new tensor to free)."""
        if freqs is None and (norm is None or isinstance(norm, IdentityOp)):
            return normed(x)
        rotated = partial(self._rotated, normed, freqs, cu_seqlens)
        if not self._recomputes_query_key():
            output = rotated(x)
            return output if cu_seqlens is None else output.unsqueeze(1)
        output, release = checkpoint_without_output(rotated, x)
        self._rope.releases.append(release)
        # thd: the batch dimension back, for Megatron's forward to squeeze
        return output if cu_seqlens is None else output.unsqueeze(1)

    def _rotated(self, normed, freqs: Optional[Tensor], cu_seqlens: Optional[Tensor], x: Tensor) -> Tensor:
        """normed(x) rotated as Megatron's forward rotates it; thd: [t, heads, dim], without the batch dimension."""
        x = normed(x)
        if cu_seqlens is not None:
            x = x.squeeze(1)
        if freqs is None:
            return x
        rope = partial(apply_rotary_pos_emb, config=self.config, mscale=_yarn_get_concentration_factor_from_config(self.config),
                       cp_group=self.pg_collection.cp)
        if cu_seqlens is not None and freqs.size(0) == x.size(0) and self.pg_collection.cp.size() == 1:
            # One frequency row per packed token (DualKVGPTModel): Megatron's thd path would gather
            # these same rows segment by segment, with a host sync per segment; the [s, b, ...]
            # path applies them at once, bitwise the same.
            return rope(x.unsqueeze(1), freqs).squeeze(1)
        return rope(x, freqs, cu_seqlens=cu_seqlens)


def _rope_cu_seqlens(packed_seq_params) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(q's, k's) cu_seqlens of Megatron's per-token (thd) RoPE; (None, None) without packed params."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None, None
    params = packed_seq_params
    q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    return q, k
