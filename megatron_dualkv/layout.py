"""Packed layouts: the metadata every DualKV attention backend reads.

A packed micro-batch is a sequence of *segments* forming a forest, in DFS (packed) order: each
segment has a parent segment or none (a root), and a segment's subtree (itself and its
descendants) is one contiguous packed range ``[start, subtree_end)``. Logical positions run along
each path from a root: a root starts at 0, a child continues at its parent's end position.

Attention rule (the definition of "exact" for the whole project), for a query token q and a
key token k with logical positions pos(q), pos(k):

    visible(q, k) = seg(k) is seg(q) or an ancestor of seg(q)
                    and pos(k) <= pos(q)
                    and pos(q) - pos(k) < window          (window optional)

Every trajectory (a root-to-segment path, up to any of its tokens) is thereby one causal sequence.
Two layouts describe such forests:

* ``DualKVLayout``, depth 1: groups ``[prompt][response 0][response 1]...``, every response a
  child of its prompt; a group without responses is a plain causal sequence (how the replicated
  baseline layout is described).
* ``TreeLayout``, any depth: prefix trees of trajectories that share prefixes (multi-turn agents,
  tree-search rollouts), built by ``pack_trajectories``.

Both give kernels and tables one view, ``nodes`` (``SegmentNode`` per segment: its ancestors'
key ranges, root first, and its subtree's end), and padding (for TP/SP divisibility) is a trailing
root segment of its own, so it attends to itself only and needs no special case in kernels.
The layouts keep their lengths as Python tuples as well as tensors, so host-side planning
(kernel tile tables, replication indices) never synchronises with the device.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

INT32_MAX = 2**31 - 1


def causal_pairs(n: int, window_size: Optional[int] = None) -> int:
    """(query, key) pairs of causal attention over positions 0..n-1: sum over p < n of min(p + 1, window)."""
    if window_size is None or n <= window_size:
        return n * (n + 1) // 2
    return window_size * (window_size + 1) // 2 + (n - window_size) * window_size


class SegmentNode(NamedTuple):
    """One segment of a packed layout, as the kernel tables read it (all packed indices)."""

    start: int  # its first token
    length: int
    position: int  # logical position of its first token: the length of its ancestor path
    parent: int  # its parent segment's index, -1 for a root (a prompt, a tree's root, padding)
    ancestors: Tuple[Tuple[int, int], ...]  # (start, length) of each ancestor segment, root first
    subtree_end: int  # its descendants fill [start + length, subtree_end)
    root_start: int  # its tree's root's start


class PackedLayout:
    """The segment forest shared by ``DualKVLayout`` and ``TreeLayout`` (see the module docstring).

    Subclasses are frozen dataclasses with a ``device`` field that call ``_build`` from
    ``__post_init__``; it sets, on ``device``:
        cu_seqlens:   (S+1,) int32 segment boundaries, padding included
        position_ids: (T,)   int64 logical positions
    """

    device: torch.device

    def _build(self, segment_lens: Sequence[int], segment_parent: Sequence[int], what: str,
               root_positions: Optional[Sequence[int]] = None) -> None:
        """Nodes and tensors of segments (padding included) given in DFS order, parents already checked.
        ``root_positions``: per segment, where a root starts (default 0; ``PrefixedLayout``'s roots
        continue after a prefix held outside the micro-batch)."""
        total = sum(segment_lens)
        if total > INT32_MAX:
            raise ValueError(
                f"{what}: {total} packed tokens overflow int32 indexing (max {INT32_MAX}); "
                "split the rollouts into more micro-batches"
            )
        object.__setattr__(self, "device", torch.device(self.device))
        starts = [0, *accumulate(segment_lens)]
        ends = starts[1:]  # subtree ends, completed bottom-up: a DFS order lists children after parents
        for s in range(len(segment_lens) - 1, -1, -1):
            if segment_parent[s] >= 0:
                ends[segment_parent[s]] = max(ends[segment_parent[s]], ends[s])
        nodes = []
        for s, (start, length, parent) in enumerate(zip(starts, segment_lens, segment_parent)):
            if parent < 0:
                position = root_positions[s] if root_positions is not None else 0
                nodes.append(SegmentNode(start, length, position, -1, (), ends[s], start))
            else:
                p = nodes[parent]
                nodes.append(SegmentNode(start, length, p.position + p.length, parent,
                                         p.ancestors + ((p.start, p.length),), ends[s], p.root_start))
        object.__setattr__(self, "nodes", tuple(nodes))
        positions = [torch.arange(n.position, n.position + n.length) for n in nodes]
        object.__setattr__(self, "cu_seqlens", torch.tensor(starts, dtype=torch.int32, device=self.device))
        object.__setattr__(self, "position_ids", torch.cat(positions).to(self.device) if positions
                           else torch.zeros(0, dtype=torch.long, device=self.device))
        object.__setattr__(self, "_device_cache", {})
        object.__setattr__(self, "_derived", {})

    # ------------------------------------------------------------------ python-side metadata
    @property
    def total_tokens(self) -> int:
        return self.nodes[-1].start + self.nodes[-1].length if self.nodes else 0

    @cached_property
    def max_seqlen(self) -> int:
        """Longest segment: the ``max_seqlen`` Megatron's thd path wants with ``cu_seqlens``."""
        return max((n.length for n in self.nodes), default=0)

    @cached_property
    def max_logical_len(self) -> int:
        """Longest logical sequence (a root-to-leaf path): the RoPE positions needed."""
        return max((n.position + n.length for n in self.nodes), default=0)

    @cached_property
    def max_depth(self) -> int:
        """Most ancestors of a segment: 0 for plain causal sequences, 1 for prompts and responses."""
        return max((len(n.ancestors) for n in self.nodes), default=0)

    def attention_pairs(self, window_size: Optional[int] = None) -> int:
        """(query, key) pairs the mask allows. A query at logical position p sees exactly the
        positions max(0, p - window + 1)..p (its ancestors' keys, then its own segment's), so the
        count is sum_t min(p_t + 1, window): the useful work FLOP counts are based on. Counted from
        the segments (positions position .. position + length - 1), so never a device sync."""
        return sum(causal_pairs(n.position + n.length, window_size) - causal_pairs(n.position, window_size)
                   for n in self.nodes)

    def derived(self, key, build):
        """``build()`` once per ``key`` and layout: host-side tables (kernel tiles, indices) that
        callers derive from the lengths and reuse for every layer of a micro-batch."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    # ------------------------------------------------------------------ device handling
    def to(self, device):
        """The same layout with its tensors on ``device`` (cached, so repeated moves are free)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        cache: Dict[torch.device, PackedLayout] = self._device_cache
        if device not in cache:
            cache[device] = dataclasses.replace(self, device=device)
        return cache[device]

    # ------------------------------------------------------------------ reference helpers
    def dense_mask(self, window_size=None) -> torch.Tensor:
        """(T, T) bool mask of the attention rule; O(T^2): for references and tests only.

        seg(k) is seg(q) or an ancestor of it iff q lies in seg(k)'s subtree range."""
        lens = torch.tensor([n.length for n in self.nodes], device=self.device)
        first = torch.repeat_interleave(torch.tensor([n.start for n in self.nodes], device=self.device), lens)
        end = torch.repeat_interleave(torch.tensor([n.subtree_end for n in self.nodes], device=self.device), lens)
        query = torch.arange(self.total_tokens, device=self.device)[:, None]
        pos = self.position_ids
        mask = (first[None, :] <= query) & (query < end[None, :]) & (pos[None, :] <= pos[:, None])
        if window_size is not None:
            mask &= (pos[:, None] - pos[None, :]) < window_size
        return mask


@dataclass(frozen=True, eq=False)
class DualKVLayout(PackedLayout):
    """Segment structure of a packed DualKV micro-batch (depth 1).

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

    As a forest (``nodes``): prompts and padding are roots, every response a child of its prompt.
    """

    prompt_lens: Tuple[int, ...]
    response_lens: Tuple[Tuple[int, ...], ...]
    pad_len: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        _check_lengths(self.prompt_lens, self.response_lens, self.pad_len)
        seg_group, seg_prompt, parents = [], [], []
        for g, (p, rs) in enumerate(self.groups_with_padding()):
            seg_group += [g] * (1 + len(rs))
            seg_prompt += [True] + [False] * len(rs)
            parents += [-1] + [len(parents)] * len(rs)
        self._build(self.segment_lens, parents, "DualKVLayout")
        kw = dict(dtype=torch.int32, device=self.device)
        tensors = dict(
            segment_group=torch.tensor(seg_group, **kw),
            segment_is_prompt=torch.tensor(seg_prompt, dtype=torch.bool, device=self.device),
            group_start=torch.tensor([0, *accumulate(p + sum(rs) for p, rs in self.groups_with_padding())], **kw),
        )
        for name, value in tensors.items():
            object.__setattr__(self, name, value)

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
    def max_prompt_len(self) -> int:
        return max(self.prompt_lens, default=0)

    @property
    def max_response_len(self) -> int:
        return max((r for rs in self.response_lens for r in rs), default=0)

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
    def loss_mask(self) -> torch.Tensor:
        """(T,) bool: True on response tokens (what RL losses train), False on prompts and padding."""
        mask = torch.zeros(self.total_tokens, dtype=torch.bool)
        for start, length, _, _ in self.response_segments:
            mask[start : start + length] = True
        return mask.to(self.device)

    def __repr__(self) -> str:
        return (
            f"DualKVLayout(groups={self.num_groups}, responses={self.num_responses}, "
            f"tokens={self.total_tokens}, pad={self.pad_len}, device={self.device})"
        )


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


@dataclass(frozen=True, eq=False)
class TreeLayout(PackedLayout):
    """A packed forest of prefix trees, any depth (``pack_trajectories`` builds it).

    Python metadata (tuples, device-free):
        segment_lens:   (S,) length of each real segment, in DFS (packed) order
        segment_parent: (S,) index of each segment's parent, -1 for a root; DFS order means each
                        segment's parent is the previous segment or one of its ancestors
        pad_len:        number of trailing padding tokens (0 for none): one more root segment,
                        which ``nodes`` and ``cu_seqlens`` include (``segment_lens`` does not)

    Tensors (on ``device``): ``cu_seqlens`` (S'+1,) int32 and ``position_ids`` (T,) int64, as in
    ``PackedLayout``.
    """

    segment_lens: Tuple[int, ...]
    segment_parent: Tuple[int, ...]
    pad_len: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self):
        object.__setattr__(self, "segment_lens", tuple(self.segment_lens))
        object.__setattr__(self, "segment_parent", tuple(self.segment_parent))
        _check_tree(self.segment_lens, self.segment_parent, self.pad_len)
        pad = (self.pad_len,) if self.pad_len else ()
        self._build(self.segment_lens + pad, self.segment_parent + (-1,) * len(pad), "TreeLayout")

    @property
    def num_segments(self) -> int:
        """Real segments (padding excluded)."""
        return len(self.segment_lens)

    def __repr__(self) -> str:
        return (f"TreeLayout(segments={self.num_segments}, depth={self.max_depth}, tokens={self.total_tokens}, "
                f"pad={self.pad_len}, device={self.device})")


@dataclass(frozen=True, eq=False)
class PrefixedLayout(PackedLayout):
    """Responses, or subtrees, whose prompts are held outside the micro-batch (prefix reuse,
    ``rl.prefix_reuse``).

    Python metadata (tuples, device-free):
        prefix_lens:     (G,) prompt (shared path) length of each group; the prompts' K/V are one
                         separate ``(sum(prefix_lens), Hkv, D)`` operand, group by group
        response_lens:   (G,) tuple of the segment lengths of each group (at least one each)
        pad_len:         trailing padding tokens (0 for none)
        segment_parents: None (every segment a response hanging from its prompt), or (G,) tuple
                         per group of each segment's parent among that group's segments, -1 for
                         one hanging from the prompt: the rest of a prefix tree whose shared path
                         is held, in DFS order as ``TreeLayout``'s

    The packed tokens are the segments only, group by group, then padding. A segment hanging from
    its prompt is a root at logical position ``prefix_lens[g]`` (as in the whole group or tree), so
    RoPE and windows see the positions of the whole; within the micro-batch a token attends to its
    own ancestors and itself causally, and to its group's prefix through the separate operand
    (``ops.dualkv_prefix_attn``).
    """

    prefix_lens: Tuple[int, ...]
    response_lens: Tuple[Tuple[int, ...], ...]
    pad_len: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    segment_parents: Optional[Tuple[Tuple[int, ...], ...]] = None

    def __post_init__(self):
        object.__setattr__(self, "prefix_lens", tuple(self.prefix_lens))
        object.__setattr__(self, "response_lens", tuple(tuple(rs) for rs in self.response_lens))
        _check_lengths(self.prefix_lens, self.response_lens, self.pad_len)
        if any(not rs for rs in self.response_lens):
            raise ValueError("PrefixedLayout: every group needs at least one response")
        if self.segment_parents is None:
            local = [(-1,) * len(rs) for rs in self.response_lens]
        else:
            local = [tuple(ps) for ps in self.segment_parents]
            object.__setattr__(self, "segment_parents", tuple(local))
            if len(local) != len(self.response_lens):
                raise ValueError(f"PrefixedLayout: {len(local)} segment_parents tuples for {len(self.response_lens)} groups")
            for lens, parents in zip(self.response_lens, local):
                _check_tree(lens, parents, 0)
        lens = [r for rs in self.response_lens for r in rs]
        starts = [p for p, rs in zip(self.prefix_lens, self.response_lens) for _ in rs]
        offsets = accumulate((len(rs) for rs in self.response_lens), initial=0)
        parents = [parent + offset if parent >= 0 else -1 for ps, offset in zip(local, offsets) for parent in ps]
        if self.pad_len:
            lens, starts, parents = lens + [self.pad_len], starts + [0], parents + [-1]
        self._build(lens, parents, "PrefixedLayout", starts)

    @property
    def is_tree(self) -> bool:
        """Whether some segment hangs from another (the rest of a prefix tree) rather than its prompt."""
        return self.segment_parents is not None and any(p >= 0 for ps in self.segment_parents for p in ps)

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)

    @cached_property
    def prefix_starts(self) -> Tuple[int, ...]:
        """Each group's first row in the prefix operand."""
        return tuple(accumulate(self.prefix_lens, initial=0))[:-1]

    @property
    def prefix_tokens(self) -> int:
        """Rows of the prefix K/V operand."""
        return sum(self.prefix_lens)

    @cached_property
    def token_group(self) -> torch.Tensor:
        """(T,) int64: the group of each packed token, -1 on padding."""
        groups = [torch.full((sum(rs),), g, dtype=torch.long) for g, rs in enumerate(self.response_lens)]
        return torch.cat(groups + [torch.full((self.pad_len,), -1, dtype=torch.long)]).to(self.device)

    def prefix_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        """(T, sum(prefix_lens)) bool: which prefix keys each token sees (its group's whole prompt,
        up to the window); O(T * prefix): for references and tests only."""
        key_group = torch.repeat_interleave(torch.arange(self.num_groups, device=self.device),
                                            torch.tensor(self.prefix_lens, device=self.device))
        key_pos = torch.cat([torch.arange(p, device=self.device) for p in self.prefix_lens])
        mask = self.token_group[:, None] == key_group[None, :]
        if window_size is not None:
            mask &= (self.position_ids[:, None] - key_pos[None, :]) < window_size
        return mask

    def __repr__(self) -> str:
        return (f"PrefixedLayout(groups={self.num_groups}, prefix={self.prefix_tokens}, tokens={self.total_tokens}, "
                f"pad={self.pad_len}{', tree' if self.is_tree else ''}, device={self.device})")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_tree(segment_lens: Tuple[int, ...], segment_parent: Tuple[int, ...], pad_len: int) -> None:
    if len(segment_lens) != len(segment_parent):
        raise ValueError(f"TreeLayout: {len(segment_lens)} segment lengths but {len(segment_parent)} parents")
    path = []  # the previous segment and its ancestors, root first
    for s, (length, parent) in enumerate(zip(segment_lens, segment_parent)):
        if not _is_int(length) or length < 1:
            raise ValueError(f"TreeLayout: segment {s} has length {length!r}; segments need at least one token")
        if not _is_int(parent) or parent < -1:
            raise ValueError(f"TreeLayout: segment {s} has parent {parent!r}; expected -1 (a root) or a segment index")
        if parent >= 0:
            if parent not in path:
                raise ValueError(
                    f"TreeLayout: segment {s} has parent {parent}, which is neither segment {s - 1} nor one of its "
                    "ancestors: segments must be in DFS order (every subtree one contiguous range)"
                )
            del path[path.index(parent) + 1:]
        else:
            path.clear()
        path.append(s)
    if not _is_int(pad_len) or pad_len < 0:
        raise ValueError(f"TreeLayout: pad_len must be an int >= 0, got {pad_len!r}")
