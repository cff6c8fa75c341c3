"""Shared-prompt packing of GRPO/DAPO rollouts.

A group (one prompt, N sampled responses) is packed once as ``[P][R1]...[RN]`` instead of N
copies of ``[P][Ri]``. Responses keep the positions they had after the prompt (``P..P+Ri-1``),
so with DualKV attention every layer computes exactly what the replicated layout computes.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

import torch

from .layout import DualKVLayout, causal_pairs


@dataclass
class RolloutGroup:
    """One prompt and the N responses sampled from it (token ids), with optional rewards."""

    prompt: Sequence[int]
    responses: Sequence[Sequence[int]]
    rewards: Optional[Sequence[float]] = None

    def with_responses(self, indices: Sequence[int]) -> "RolloutGroup":
        """The prompt with the responses (and rewards) at ``indices``, in that order."""
        rewards = None if self.rewards is None else [self.rewards[i] for i in indices]
        return RolloutGroup(self.prompt, [self.responses[i] for i in indices], rewards)


@dataclass
class ReplicatedBatch:
    """The standard layout: every response with its own copy of the prompt, thd-packed.

    tokens, position_ids: (T_rep,)   sequences ``[P_g][R_g,i]`` one after the other
    loss_mask:            (T_rep,)   bool, True on response tokens
    cu_seqlens:           (S+1,)     int32 sequence boundaries
    index:                (T_rep,)   int64 packed-token index of every replicated token, so
                                     ``x_rep = x_packed[index]`` (and gradients sum over copies)
    layout:               DualKVLayout in which each sequence is its own causal segment, so the
                                     same attention backends run the baseline
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    index: torch.Tensor
    layout: DualKVLayout

    def split(self, x: torch.Tensor) -> List[torch.Tensor]:
        """x: (T_rep, ...) -> one tensor per sequence."""
        return list(torch.split(x, torch.diff(self.cu_seqlens).tolist()))


class PackedBatch:
    """A packed micro-batch ``[P1][R1_1]..[R1_N1][P2][R2_1]..[pad]`` and its DualKV layout.

    tokens:       (T,) int64
    position_ids: (T,) int64, prompt ``0..P-1``, each response ``P..P+R_i-1``, padding ``0..pad-1``
    loss_mask:    (T,) bool, True on response tokens
    layout:       DualKVLayout
    rewards:      per group a (N_g,) float tensor, or None when no group gave rewards
    """

    def __init__(self, tokens: torch.Tensor, layout: DualKVLayout, rewards=None):
        if tokens.shape != (layout.total_tokens,):
            raise ValueError(f"PackedBatch: tokens shape {tuple(tokens.shape)} != ({layout.total_tokens},)")
        self.tokens = tokens
        self.layout = layout
        self.rewards = rewards

    @property
    def position_ids(self) -> torch.Tensor:
        return self.layout.position_ids

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.layout.loss_mask

    @property
    def num_tokens(self) -> int:
        return self.layout.total_tokens

    def to(self, device) -> "PackedBatch":
        rewards = None if self.rewards is None else [r.to(device) for r in self.rewards]
        return PackedBatch(self.tokens.to(device), self.layout.to(device), rewards)

    def unpack(self, x: torch.Tensor) -> List[Tuple[torch.Tensor, List[torch.Tensor]]]:
        """x: (T, ...) -> per group ``(prompt part (P, ...), [response parts (R_i, ...)])``; padding dropped."""
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"unpack: x has {x.shape[0]} rows, the batch has {self.num_tokens} tokens")
        out, start = [], 0
        for p, rs in zip(self.layout.prompt_lens, self.layout.response_lens):
            parts = torch.split(x[start : start + p + sum(rs)], [p, *rs])
            out.append((parts[0], list(parts[1:])))
            start += p + sum(rs)
        return out

    @cached_property
    def _replicated(self) -> ReplicatedBatch:
        index, seq_lens, is_response = [], [], []
        for start, length, prefix_start, prefix_len in self.layout.response_segments:  # its prompt copy, then itself
            index += [torch.arange(prefix_start, prefix_start + prefix_len), torch.arange(start, start + length)]
            is_response += [torch.zeros(prefix_len, dtype=torch.bool), torch.ones(length, dtype=torch.bool)]
            seq_lens.append(prefix_len + length)
        # Each replicated sequence is a group without responses: a plain causal segment.
        layout = DualKVLayout(tuple(seq_lens), ((),) * len(seq_lens), 0, self.layout.device)
        index = torch.cat(index).to(self.tokens.device)
        return ReplicatedBatch(
            tokens=self.tokens[index],
            position_ids=layout.position_ids,
            loss_mask=torch.cat(is_response).to(self.layout.device),
            cu_seqlens=layout.cu_seqlens,
            index=index,
            layout=layout,
        )

    def replicated(self) -> ReplicatedBatch:
        """The standard (replicated) layout of the same rollouts, for baselines and equivalence checks."""
        return self._replicated

    @property
    def rho(self) -> float:
        """Token reduction ``sum_g N_g (P_g + mean R) / sum_g (P_g + sum_i R_g,i)``; padding excluded."""
        replicated = sum(len(rs) * p + sum(rs) for p, rs in zip(self.layout.prompt_lens, self.layout.response_lens))
        packed = self.num_tokens - self.layout.pad_len
        return replicated / packed

    @property
    def attention_pair_ratio(self) -> float:
        """Causal (query, key) pairs of the replicated layout over those of the packed layout (padding excluded)."""
        layout = self.layout
        replicated = sum(causal_pairs(p + r) for p, rs in zip(layout.prompt_lens, layout.response_lens) for r in rs)
        return replicated / (layout.attention_pairs() - causal_pairs(layout.pad_len))

    def __repr__(self) -> str:
        return f"PackedBatch(tokens={self.num_tokens}, rho={self.rho:.2f}, layout={self.layout})"


def pack_groups(groups: Sequence[RolloutGroup], pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """Pack rollout groups as ``[P1][R1_1]..[R1_N1][P2]..`` (+ padding to a multiple of ``pad_to_multiple_of``).

    Raises ValueError on an empty batch, an empty prompt or response, a group with no responses,
    non-integer or negative token ids, rewards that do not match the responses, or a total length
    that overflows int32 indexing.
    """
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    groups = list(groups)
    if not groups:
        raise ValueError("pack_groups: no rollout groups given")
    check_rollout_groups(groups, "pack_groups")
    prompt_lens, response_lens = [], []
    for g, group in enumerate(groups):
        if len(group.prompt) == 0:
            raise ValueError(f"group {g}: empty prompt")
        if len(group.responses) == 0:
            raise ValueError(f"group {g}: no responses")
        for i, r in enumerate(group.responses):
            if len(r) == 0:
                raise ValueError(f"group {g}: response {i} is empty")
        prompt_lens.append(len(group.prompt))
        response_lens.append(tuple(len(r) for r in group.responses))
    total = sum(prompt_lens) + sum(map(sum, response_lens))
    padded = -(-total // pad_to_multiple_of) * pad_to_multiple_of
    layout = DualKVLayout(tuple(prompt_lens), tuple(response_lens), padded - total)  # checks int32 first
    pieces = []
    for g, group in enumerate(groups):
        pieces.append(token_ids(group.prompt, f"group {g} prompt"))
        pieces += [token_ids(r, f"group {g} response {i}") for i, r in enumerate(group.responses)]
    if padded > total:
        pieces.append(torch.full((padded - total,), pad_token_id, dtype=torch.long))
    rewards = None
    if groups[0].rewards is not None:
        rewards = [torch.as_tensor(group.rewards, dtype=torch.float32) for group in groups]
    return PackedBatch(torch.cat(pieces), layout, rewards)


def check_rollout_groups(groups: Sequence[RolloutGroup], caller: str) -> None:
    """ValueError unless every item is a RolloutGroup with one reward per response, or no rewards
    in every group (what pack_groups and plan_micro_batches both need)."""
    for g, group in enumerate(groups):
        if not isinstance(group, RolloutGroup):
            raise ValueError(f"group {g}: expected a RolloutGroup, got {type(group).__name__}")
        if group.rewards is not None and len(group.rewards) != len(group.responses):
            raise ValueError(f"group {g}: {len(group.rewards)} rewards for {len(group.responses)} responses")
    if len({group.rewards is None for group in groups}) > 1:
        raise ValueError(f"{caller}: either every group has rewards or none does")


def token_ids(ids, what: str) -> torch.Tensor:
    """ids (a sequence of ints or a 1-D integer tensor) -> (n,) int64 on the host; ValueError,
    naming ``what``, on anything else or a negative id."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise ValueError(f"{what}: token ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        t = ids.to(torch.long).cpu()
    else:
        ids = list(ids)
        if not all(type(x) is int for x in ids):  # plain ints pass at once (an ABC check per id is slow)
            for x in ids:
                if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                    raise ValueError(f"{what}: token ids must be integers, got {x!r} ({type(x).__name__})")
        t = torch.tensor([int(x) for x in ids], dtype=torch.long)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{what}: negative token id {int(t.min())}")
    return t
