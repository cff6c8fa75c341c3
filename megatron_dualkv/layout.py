"""DualKVLayout: the metadata every DualKV attention backend reads.

A packed micro-batch is a sequence of *groups*; group ``g`` occupies the contiguous token range
``[group_start[g], group_start[g+1])`` laid out as ``[prompt][response 0][response 1]...``.
A group without responses is a plain causal sequence: that is how the replicated baseline
layout is described, and padding (for TP/SP divisibility) is one such trailing group, so it
attends to itself only and needs no special case in kernels.

Attention rule (the definition of "exact" for the whole project), for a query token q and a
key token k with logical positions pos(q), pos(k):

    visible(q, k) = group(q) == group(k)
                    and (k is in the group's prompt or segment(k) == segment(q))
                    and pos(k) <= pos(q)
                    and pos(q) - pos(k) < window          (window optional)

Positions are logical: prompt tokens are ``0..P-1`` and every response continues at ``P``.
The layout keeps its lengths as Python tuples as well as tensors, so host-side planning
(kernel tile tables, replication indices) never synchronises with the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Dict, Optional, Sequence, Tuple

import torch

INT32_MAX = 2**31 - 1


def causal_pairs(n: int, window_size: Optional[int] = None) -> int:
    """(query, key) pairs of causal attention over positions 0..n-1: sum over p < n of min(p + 1, window)."""
    if window_size is None or n <= window_size:
        return n * (n + 1) // 2
    return window_size * (window_size + 1) // 2 + (n - window_size) * window_size


@dataclass(frozen=True, eq=False)
class DualKVLayout:
    """Segment structure of a packed DualKV micro-batch.

    Python metadata (hashable, device-free):
        prompt_lens:   (G,)  prompt length of each real group
        response_lens: (G,)  tuple of response lengths of each group
        pad_len:       number of trailing padding tokens (0 for none)

    Tensors (int32 unless stated, on ``device``), built once in ``__post_init__``:
        cu_seqlens:        (S+1,) segment boundaries (prompts, responses, padding in order)
        segment_group:     (S,)   group index of each segment (padding is group G)
        segment_is_prompt: (S,)   bool, True for prompts and for the padding segment
        group_start:       (G'+1,) token boundaries of groups (G' = G + (pad_len > 0))
        position_ids:      (T,)   int64 logical positions
    """

    prompt_lens: Tuple[int, ...]
    response_lens: Tuple[Tuple[int, ...], ...]
    pad_len: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        _check_lengths(self.prompt_lens, self.response_lens, self.pad_len)
        object.__setattr__(self, "device", torch.device(self.device))
        seg_group, seg_prompt, positions = [], [], []
        for g, (p, rs) in enumerate(self.groups_with_padding()):
            seg_group += [g] * (1 + len(rs))
            seg_prompt += [True] + [False] * len(rs)
            positions += [torch.arange(p)] + [torch.arange(p, p + r) for r in rs]
        kw = dict(dtype=torch.int32, device=self.device)
        tensors = dict(
            cu_seqlens=torch.tensor([0, *accumulate(self.segment_lens)], **kw),
            segment_group=torch.tensor(seg_group, **kw),
            segment_is_prompt=torch.tensor(seg_prompt, dtype=torch.bool, device=self.device),
            group_start=torch.tensor([0, *accumulate(p + sum(rs) for p, rs in self.groups_with_padding())], **kw),
            position_ids=torch.cat(positions).to(self.device),
        )
        for name, value in tensors.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_device_cache", {})
        object.__setattr__(self, "_derived", {})

    # ------------------------------------------------------------------ python-side metadata
    def groups_with_padding(self) -> Tuple[Tuple[int, Tuple[int, ...]], ...]:
        """Per group ``(prompt_len, response_lens)``; padding last, as a group without responses."""
        groups = tuple(zip(self.prompt_lens, self.response_lens))
        return groups + ((self.pad_len, ()),) if self.pad_len else groups

    @property
    def num_groups(self) -> int:
        """Real groups (padding excluded)."""
        return len(self.prompt_lens)

    @property
    def num_responses(self) -> int:
        return sum(len(rs) for rs in self.response_lens)

    @cached_property
    def segment_lens(self) -> Tuple[int, ...]:
        lens = [n for p, rs in self.groups_with_padding() for n in (p, *rs)]
        return tuple(lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.prompt_lens) + sum(map(sum, self.response_lens)) + self.pad_len

    @property
    def max_prompt_len(self) -> int:
        return max(self.prompt_lens, default=0)

    @property
    def max_response_len(self) -> int:
        return max((r for rs in self.response_lens for r in rs), default=0)

    @property
    def max_seqlen(self) -> int:
        """Longest segment: the ``max_seqlen`` Megatron's thd path wants with ``cu_seqlens``."""
        return max(self.segment_lens, default=0)

    def attention_pairs(self, window_size: Optional[int] = None) -> int:
        """(query, key) pairs the mask allows. A query at logical position p sees exactly the
        positions max(0, p - window + 1)..p (prompt keys, then its own response's), so the count
        is sum_t min(p_t + 1, window): the useful work FLOP counts are based on. Counted from the
        segments (positions prefix_len .. prefix_len + length - 1), so never a device sync."""
        return sum(causal_pairs(prefix_len + length, window_size) - causal_pairs(prefix_len, window_size)
                   for _, length, _, prefix_len in self.segments)

    @cached_property
    def segments(self) -> Tuple[Tuple[int, int, int, int], ...]:
        """Per segment ``(start, length, prefix_start, prefix_len)``.

        The prefix is the KV range a segment sees in full besides itself: the group's prompt
        for a response, nothing for a prompt or padding.
        """
        out, start = [], 0
        for p, rs in self.groups_with_padding():
            prompt_start = start
            out.append((start, p, start, 0))
            start += p
            for r in rs:
                out.append((start, r, prompt_start, p))
                start += r
        return tuple(out)

    @cached_property
    def response_segments(self) -> Tuple[Tuple[int, int, int, int], ...]:
        """The ``segments`` of responses, in packed order: those with a prefix (prompts and padding have none)."""
        return tuple(seg for seg in self.segments if seg[3])

    @cached_property
    def max_logical_len(self) -> int:
        """Longest logical sequence (a prompt, or a prompt plus one of its responses): the RoPE positions needed."""
        return max((prefix_len + length for _, length, _, prefix_len in self.segments), default=0)

    @cached_property
    def loss_mask(self) -> torch.Tensor:
        """(T,) bool: True on response tokens (what RL losses train), False on prompts and padding."""
        mask = torch.zeros(self.total_tokens, dtype=torch.bool)
        for start, length, _, _ in self.response_segments:
            mask[start : start + length] = True
        return mask.to(self.device)

    def derived(self, key, build):
        """``build()`` once per ``key`` and layout: host-side tables (kernel tiles, indices) that
        callers derive from the lengths and reuse for every layer of a micro-batch."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    # ------------------------------------------------------------------ device handling
    def to(self, device) -> "DualKVLayout":
        """The same layout with its tensors on ``device`` (cached, so repeated moves are free)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        cache: Dict[torch.device, DualKVLayout] = self._device_cache
        if device not in cache:
            cache[device] = DualKVLayout(self.prompt_lens, self.response_lens, self.pad_len, device)
        return cache[device]

    def __repr__(self) -> str:
        return (
            f"DualKVLayout(groups={self.num_groups}, responses={self.num_responses}, "
            f"tokens={self.total_tokens}, pad={self.pad_len}, device={self.device})"
        )

    # ------------------------------------------------------------------ reference helpers
    def dense_mask(self, window_size=None) -> torch.Tensor:
        """(T, T) bool mask of the attention rule above; O(T^2): for references and tests only."""
        seg_of_token = torch.repeat_interleave(
            torch.arange(len(self.segment_lens), device=self.device),
            torch.tensor(self.segment_lens, device=self.device),
        )
        group = self.segment_group.long()[seg_of_token]
        is_prompt = self.segment_is_prompt[seg_of_token]
        pos = self.position_ids
        mask = group[:, None] == group[None, :]
        mask &= is_prompt[None, :] | (seg_of_token[:, None] == seg_of_token[None, :])
        mask &= pos[None, :] <= pos[:, None]
        if window_size is not None:
            mask &= (pos[:, None] - pos[None, :]) < window_size
        return mask


def _check_lengths(prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]], pad_len: int):
    if len(prompt_lens) != len(response_lens):
        raise ValueError(
            f"DualKVLayout: {len(prompt_lens)} prompt lengths but {len(response_lens)} response-length lists"
        )
    for g, (p, rs) in enumerate(zip(prompt_lens, response_lens)):
        if p < 1:
            raise ValueError(f"DualKVLayout: group {g} has a prompt of length {p}; prompts need at least one token")
        if rs and min(rs) < 1:
            raise ValueError(
                f"DualKVLayout: group {g} has a response of length {min(rs)}; responses need at least one token"
            )
    if pad_len < 0:
        raise ValueError(f"DualKVLayout: pad_len must be >= 0, got {pad_len}")
    total = sum(prompt_lens) + sum(map(sum, response_lens)) + pad_len
    if total > INT32_MAX:
        raise ValueError(
            f"DualKVLayout: {total} packed tokens overflow int32 indexing (max {INT32_MAX}); "
            "split the rollouts into more micro-batches"
        )
