"""Ulysses context parallelism for the DualKV layout, on Megatron's context-parallel process group.

Megatron-Core's own context parallelism is Transformer-Engine-only; this is the library's, for
DualKV attention. With ``cp`` ranks, the packed sequence of a micro-batch (padded to a multiple of
``ParallelSizes.token_multiple``) is cut into cp equal contiguous slices: CP rank r holds tokens
``[r*T/cp, (r+1)*T/cp)`` for the embedding, the norms, linears, MLP/MoE and the output layer,
with the RoPE rotation of each token's logical position (``DualKVGPTModel`` takes the slices).

Attention needs every token of a group, and the groups cross slice boundaries. So, per layer:

    q/k/v  [T/cp, H, D] (sequence-split)  --all-to-all-->  [T, H/cp, D] (head-split)
    dualkv_attn_func on the WHOLE packed layout for this rank's H/cp heads
    out    [T, H/cp, D]                    --all-to-all-->  [T/cp, H*D] (sequence-split)

The all-to-alls are Megatron's ``all_to_all_sp2hp``/``all_to_all_hp2sp`` (autograd functions whose
backward is the opposite all-to-all), run on the context-parallel group; q, k and v travel in
one exchange. With fewer key/value heads than cp (or a count cp does not divide), each KV head is
replicated so that every rank receives the KV heads its query heads read; the replication is a
``repeat_interleave``, whose backward sums the copies' gradients. Heads are already split by
tensor parallelism when they get here (H = heads per TP rank), so TP composes: the TP and CP
splits multiply.

A Gated DeltaNet layer (``DualKVGatedDeltaNet``) uses the same two exchanges around its conv and
delta rule (``tokens_to_heads``, ``heads_to_tokens``), and reads its rank's rows of its per-head
parameters (``local_heads``).

The parameters stay replicated over CP ranks and each rank's backward yields the gradient of its
own tokens' share: Megatron's DDP sums them over the data x context parallel group.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp
from torch import Tensor

from .packed_seq_params import DualKVPackedSeqParams


def context_parallel_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else group.size()


def context_parallel_slice(num_tokens: int, group: Optional[dist.ProcessGroup]) -> slice:
    """This rank's contiguous slice of ``num_tokens`` packed tokens (all of them without CP)."""
    cp = context_parallel_size(group)
    if num_tokens % cp:
        raise ValueError(
            f"context parallelism splits the packed sequence into {cp} equal slices, but it has {num_tokens} "
            f"tokens; pack with pack_groups(..., pad_to_multiple_of=ParallelSizes.token_multiple)"
        )
    size = num_tokens // cp
    start = 0 if cp == 1 else group.rank() * size
    return slice(start, start + size)


def local_tokens(packed_seq_params: DualKVPackedSeqParams) -> slice:
    """The packed tokens the params' rank holds: its CP slice of the layout."""
    return context_parallel_slice(packed_seq_params.layout.total_tokens, packed_seq_params.cp_group)


def context_parallel_params(packed_seq_params: DualKVPackedSeqParams, group: dist.ProcessGroup) -> DualKVPackedSeqParams:
    """The params of this CP rank: the whole layout (attention runs on it), Megatron's ``cp_group``
    field set to ``group``, and ``cu_seqlens`` cut to the rank's slice, so that Megatron's
    per-token RoPE (one frequency row per local token) lines up with the local tokens."""
    tokens = context_parallel_slice(packed_seq_params.layout.total_tokens, group)
    bounds = packed_seq_params.layout.to("cpu").cu_seqlens.clamp(tokens.start, tokens.stop) - tokens.start
    cu_seqlens = torch.unique_consecutive(bounds).to(torch.int32)
    return replace(packed_seq_params, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cp_group=group)


def kv_head_replication(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How often each KV head is repeated before the head split, so that cp ranks each get whole
    KV heads for their query heads: ``lcm(num_kv_heads, cp) / num_kv_heads`` (1 when cp divides it).

    With ``num_kv_heads * r`` heads, cp divides the KV heads, and query head h still reads copy
    ``h // (num_heads / (num_kv_heads * r))`` of KV head ``h // (num_heads / num_kv_heads)``.
    """
    if num_heads % cp:
        raise ValueError(
            f"Ulysses context parallelism splits the attention heads over cp={cp} ranks, but this rank has "
            f"{num_heads} query heads; num_attention_heads must be a multiple of tp*cp"
        )
    return math.lcm(num_kv_heads, cp) // num_kv_heads


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """Context-parallel attention of this rank's tokens.

    query: [T/cp, H, D], key/value: [T/cp, Hkv, D] (this rank's slice of the packed sequence).
    attend(q, k, v): attention on the whole packed sequence, q [T, H/cp, D], k/v [T, Hkv'/cp, D]
    -> [T, H/cp, D]. Returns [T/cp, H*D].
    """
    replicas = kv_head_replication(query.shape[1], key.shape[1], group.size())
    if replicas > 1:
        key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
    return heads_to_tokens(attend(*tokens_to_heads((query, key, value), group)), group)


def tokens_to_heads(parts: Sequence[Tensor], group: dist.ProcessGroup) -> List[Tensor]:
    """Sequence-split to head-split, in one all-to-all for all ``parts``.

    parts: each [T/cp, heads_i, width_i], this rank's tokens, heads_i a multiple of cp.
    Returns each as [T, heads_i/cp, width_i]: every token, this rank's contiguous share of the heads.
    """
    cp, tokens = group.size(), parts[0].shape[0]
    for part in parts:
        if part.shape[1] % cp:
            raise ValueError(f"Ulysses context parallelism splits heads over cp={cp} ranks, got {part.shape[1]} heads")
    # Per destination rank r: its share of each part's heads, in one row.
    outgoing = torch.cat([p.reshape(tokens, cp, -1) for p in parts], dim=2).reshape(tokens, -1)
    incoming = all_to_all_sp2hp(outgoing, group=group)
    widths = [p.shape[1] // cp * p.shape[2] for p in parts]
    return [x.reshape(x.shape[0], p.shape[1] // cp, p.shape[2]) for x, p in zip(incoming.split(widths, dim=1), parts)]


def heads_to_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Head-split back to sequence-split: x [T, heads/cp, width] -> [T/cp, heads * width]."""
    return all_to_all_hp2sp(x.reshape(x.shape[0], -1), group=group)


def local_heads(tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """This CP rank's contiguous share of a per-head tensor (rows grouped by head along dim 0), as
    ``tokens_to_heads`` gives it that share of the heads; all of it without CP. A slice of a
    parameter: its gradient lands in the rank's rows, and DDP's sum over the CP ranks fills them all."""
    cp = context_parallel_size(group)
    return tensor if cp == 1 else tensor.chunk(cp)[group.rank()]
