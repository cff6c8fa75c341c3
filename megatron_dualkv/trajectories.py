"""Prefix-tree packing of trajectories that share prefixes at any depth.

Multi-turn agent episodes share the conversation so far, tree-search rollouts branch at inner
tokens. ``pack_trajectories`` finds the shared prefixes itself: a token trie per group (over all
trajectories when none has a group), compressed to segments, packed once in DFS order as a
``TreeLayout``. Sharing is maximal: a token sequence that starts several trajectories of a group
is packed once; a trajectory may end inside the tree (it is a prefix of another), and identical
trajectories share everything. Every token keeps its position along its path (``0..L-1`` for
each trajectory), so with DualKV attention every layer computes exactly what the replicated
layout (each trajectory one causal sequence) computes.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .layout import DualKVLayout, TreeLayout
from .packing import ReplicatedBatch, token_ids


@dataclass
class Trajectory:
    """One sampled sequence (token ids), with optional per-token loss mask, reward and group.

    loss_mask: (L,) 0/1 or bools, True where a token is trained (default: every token); a token
               is predicted from the ones before it, so the first token's entry is never used
    reward:    a number (every trajectory has one, or none does)
    group:     any hashable id: trajectories share prefixes only within their group, and group
               advantages are taken over it (every trajectory has one, or none does)
    """

    tokens: Sequence[int]
    loss_mask: Optional[Sequence] = None
    reward: Optional[float] = None
    group: Optional[Hashable] = None


class TrajectoryBatch:
    """Trajectories packed as prefix trees ``[root][child]..[next root]..[pad]`` and their layout.

    tokens:           (T,) int64 packed tokens: shared prefixes once, DFS order
    layout:           TreeLayout (what ``dualkv_attn_func`` takes)
    trajectory_index: per trajectory an (L_i,) int64 tensor: the packed index of each of its tokens
    predictor_index:  (T,) int64 packed index of the token before each token along its path, whose
                      logits predict it (the previous token in a segment, the parent's last token
                      at a segment's start; -1 at a root's first token)
    loss_masks:       per trajectory an (L_i,) bool tensor
    rewards:          (N,) float32, or None when no trajectory has a reward
    groups:           per trajectory its group id, or None when no trajectory has one
    group_index:      (N,) int64 group number of each trajectory, in order of first occurrence
                      (all 0 without groups)
    trajectory_segments: per trajectory the segments of its path, root first (the last one may
                      hold more tokens than the trajectory: it ends inside the tree)
    """

    def __init__(self, tokens: torch.Tensor, layout: TreeLayout, trajectory_index: List[torch.Tensor],
                 predictor_index: torch.Tensor, loss_masks: List[torch.Tensor], rewards: Optional[torch.Tensor],
                 groups: Optional[Tuple[Hashable, ...]], group_index: torch.Tensor,
                 trajectory_segments: Tuple[Tuple[int, ...], ...]):
        if tokens.shape != (layout.total_tokens,):
            raise ValueError(f"TrajectoryBatch: tokens shape {tuple(tokens.shape)} != ({layout.total_tokens},)")
        self.tokens = tokens
        self.layout = layout
        self.trajectory_index = trajectory_index
        self.predictor_index = predictor_index
        self.loss_masks = loss_masks
        self.rewards = rewards
        self.groups = groups
        self.group_index = group_index
        self.trajectory_segments = trajectory_segments

    @property
    def position_ids(self) -> torch.Tensor:
        return self.layout.position_ids

    @property
    def num_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def num_trajectories(self) -> int:
        return len(self.trajectory_index)

    @property
    def trajectory_lens(self) -> Tuple[int, ...]:
        return tuple(index.numel() for index in self.trajectory_index)

    @property
    def rho(self) -> float:
        """Token reduction: trajectory tokens over packed tokens, padding excluded."""
        return sum(self.trajectory_lens) / (self.num_tokens - self.layout.pad_len)

    def to(self, device) -> "TrajectoryBatch":
        move = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        return TrajectoryBatch(self.tokens.to(device), self.layout.to(device), move(self.trajectory_index),
                               self.predictor_index.to(device), move(self.loss_masks),
                               None if self.rewards is None else self.rewards.to(device), self.groups,
                               self.group_index.to(device), self.trajectory_segments)

    @cached_property
    def _replicated(self) -> ReplicatedBatch:
        index = torch.cat(self.trajectory_index)
        layout = DualKVLayout(self.trajectory_lens, ((),) * self.num_trajectories, 0, self.layout.device)
        return ReplicatedBatch(tokens=self.tokens[index], position_ids=layout.position_ids,
                               loss_mask=torch.cat(self.loss_masks), cu_seqlens=layout.cu_seqlens, index=index,
                               layout=layout)

    def replicated(self) -> ReplicatedBatch:
        """The replicated layout of the same trajectories (each one causal sequence), for baselines
        and equivalence checks: ``x_rep = x_packed[index]``."""
        return self._replicated

    def __repr__(self) -> str:
        return f"TrajectoryBatch(trajectories={self.num_trajectories}, rho={self.rho:.2f}, layout={self.layout})"


class _Node:
    """A trie segment: tokens ``seq[lo:hi]`` of one trajectory's array, children by first token
    (dicts keep insertion order: children in order of first occurrence)."""

    __slots__ = ("seq", "lo", "hi", "children", "index")

    def __init__(self, seq: np.ndarray, lo: int, hi: int, children: Dict[int, "_Node"]):
        self.seq, self.lo, self.hi, self.children = seq, lo, hi, children


def _insert(roots: Dict[int, _Node], seq: np.ndarray) -> None:
    """Add ``seq`` to the compressed trie: follow the segments it matches, split the one it leaves
    inside, and hang its rest as a new leaf, or extend the leaf it runs past (so that every inner
    segment branches: no segment has a single child). Ending inside a segment splits nothing.
    A segment's ``lo`` is its first token's position, the same in every sequence through it."""
    children, i = roots, 0
    while i < len(seq):
        node = children.get(int(seq[i]))
        if node is None:
            children[int(seq[i])] = _Node(seq, i, len(seq), {})
            return
        n = min(node.hi - node.lo, len(seq) - i)
        matched = n if n == 1 else _common_prefix(node.seq[node.lo:node.lo + n], seq[i:i + n])
        if matched == node.hi - node.lo and not node.children:  # runs past a leaf: the leaf grows
            node.seq, node.hi = seq, max(node.hi, len(seq))
            return
        if matched < n:  # the sequences branch inside the segment
            tail = _Node(node.seq, node.lo + matched, node.hi, node.children)
            node.hi, node.children = node.lo + matched, {int(node.seq[node.lo + matched]): tail}
        i += matched
        children = node.children


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two arrays of the same length."""
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else len(a)


def _path(roots: Dict[int, _Node], seq: np.ndarray) -> List[Tuple[_Node, int]]:
    """(segment, tokens of it used) along ``seq``'s path, root first."""
    out, children, i = [], roots, 0
    while i < len(seq):
        node = children[int(seq[i])]
        take = min(node.hi - node.lo, len(seq) - i)
        out.append((node, take))
        i += take
        children = node.children
    return out


def trajectory_groups(trajectories: Sequence[Trajectory]) -> List[List[int]]:
    """Per group (by ``Trajectory.group``, in order of first occurrence; one group when the
    trajectories have none), the input numbers of its trajectories: the nesting (per group, per
    trajectory) of per-trajectory results in ``megatron_dualkv.rl``, whose flat order (group by
    group) a plan's ``response_index`` and the advantages of a plan's input follow."""
    number: Dict = {}
    out: List[List[int]] = []
    for i, trajectory in enumerate(trajectories):
        g = number.setdefault(trajectory.group, len(number))
        if g == len(out):
            out.append([])
        out[g].append(i)
    return out


def pack_trajectories(trajectories: Sequence[Trajectory], pad_to_multiple_of: int = 1,
                      pad_token_id: int = 0) -> TrajectoryBatch:
    """Pack trajectories as prefix trees, one per group (+ padding to a multiple of ``pad_to_multiple_of``).

    Groups are packed in order of first occurrence, each group's trees root by root, children in
    order of first occurrence: the output is a function of the input order only.

    Raises ValueError on an empty batch, an empty trajectory, non-integer or negative token ids
    (the vocabulary bound is checked where the model is known), a loss mask of the wrong length or
    with values other than 0/1, a non-numeric reward, rewards or groups given for some trajectories
    only, or a total length that overflows int32 indexing.
    """
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("pack_trajectories: no trajectories given")
    seqs = [_trajectory_tokens(t, i) for i, t in enumerate(trajectories)]
    loss_masks = [_loss_mask(t, i, len(seq)) for i, (t, seq) in enumerate(zip(trajectories, seqs))]
    rewards = _rewards(trajectories)
    groups = _all_or_none(trajectories, "group")
    members_of = trajectory_groups(trajectories)
    group_index = [0] * len(trajectories)
    for g, members in enumerate(members_of):
        for i in members:
            group_index[i] = g

    forests: List[Dict[int, _Node]] = [{} for _ in members_of]  # per group, its roots by first token
    for seq, g in zip(seqs, group_index):
        _insert(forests[g], seq)

    # DFS numbering, iteratively (a deep tree must not hit the recursion limit)
    lens, parents, pieces, start = [], [], [], 0
    for roots in forests:
        stack = [(node, -1) for node in reversed(roots.values())]
        while stack:
            node, parent = stack.pop()
            node.index = (len(lens), start)
            lens.append(node.hi - node.lo)
            parents.append(parent)
            pieces.append(node.seq[node.lo:node.hi])
            start += node.hi - node.lo
            stack += [(child, node.index[0]) for child in reversed(node.children.values())]
    padded = -(-start // pad_to_multiple_of) * pad_to_multiple_of
    layout = TreeLayout(tuple(lens), tuple(parents), padded - start)  # checks int32 first
    if padded > start:
        pieces.append(np.full(padded - start, pad_token_id, dtype=np.int64))

    index, segments = [], []
    for seq, g in zip(seqs, group_index):
        path = _path(forests[g], seq)
        index.append(torch.from_numpy(np.concatenate([np.arange(n.index[1], n.index[1] + take) for n, take in path])))
        segments.append(tuple(n.index[0] for n, _ in path))
    return TrajectoryBatch(
        tokens=torch.from_numpy(np.concatenate(pieces)),
        layout=layout,
        trajectory_index=index,
        predictor_index=predictor_index(layout),
        loss_masks=loss_masks,
        rewards=rewards,
        groups=groups,
        group_index=torch.tensor(group_index, dtype=torch.long),
        trajectory_segments=tuple(segments),
    )


def held_path_len(trajectories: Sequence[Trajectory]) -> int:
    """The length L of the path the trajectories of one tree hold with prefix reuse
    (``rl.prefix_reuse``; 0: none): their longest common prefix, cut at the first position any of
    them trains (the token at position L is predicted from the path's held last hidden state, so
    it may be trained; one inside the path could not be, as the path's forward computes no
    log-probs) and so that each keeps a token after it."""
    seqs = [_trajectory_tokens(t, i) for i, t in enumerate(trajectories)]
    held = min(len(seq) for seq in seqs) - 1
    for seq in seqs[1:]:
        held = min(held, _common_prefix(seqs[0][:held], seq[:held]))
    for i, (t, seq) in enumerate(zip(trajectories, seqs)):
        trained = torch.nonzero(_loss_mask(t, i, len(seq))[1 : held + 1])
        if len(trained):
            held = int(trained[0]) + 1
    return held


def predictor_index(layout: TreeLayout) -> torch.Tensor:
    """(T,) int64: the packed index of the token before each token along its path, -1 at a root's start."""
    out = torch.arange(-1, layout.total_tokens - 1)
    for node in layout.nodes:
        if node.parent >= 0:
            parent = layout.nodes[node.parent]
            out[node.start] = parent.start + parent.length - 1
        else:
            out[node.start] = -1
    return out


def _trajectory_tokens(traj, i: int) -> np.ndarray:
    if not isinstance(traj, Trajectory):
        raise ValueError(f"trajectory {i}: expected a Trajectory, got {type(traj).__name__}")
    seq = token_ids(traj.tokens, f"trajectory {i} tokens").numpy()
    if seq.size == 0:
        raise ValueError(f"trajectory {i}: empty tokens")
    return seq


def _loss_mask(traj: Trajectory, i: int, length: int) -> torch.Tensor:
    if traj.loss_mask is None:
        return torch.ones(length, dtype=torch.bool)
    mask = traj.loss_mask
    mask = mask.cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if mask.ndim != 1 or mask.size != length:
        raise ValueError(f"trajectory {i}: loss_mask has shape {mask.shape}, expected ({length},) like its tokens")
    if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"trajectory {i}: loss_mask values must be 0/1 or bools")
    return torch.from_numpy(mask.astype(bool))


def _all_or_none(trajectories: Sequence[Trajectory], name: str) -> Optional[Tuple]:
    """Every trajectory's ``name`` field, None when no trajectory sets it; ValueError when some do."""
    values = tuple(getattr(t, name) for t in trajectories)
    missing = [i for i, v in enumerate(values) if v is None]
    if len(missing) == len(values):
        return None
    if missing:
        given = next(i for i, v in enumerate(values) if v is not None)
        raise ValueError(f"pack_trajectories: either every trajectory has a {name} or none does "
                         f"(trajectory {given} has one, trajectory {missing[0]} has none)")
    return values


def _rewards(trajectories: Sequence[Trajectory]) -> Optional[torch.Tensor]:
    rewards = _all_or_none(trajectories, "reward")
    if rewards is None:
        return None
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise ValueError(f"trajectory {i}: reward must be a number, got {r!r} ({type(r).__name__})")
    return torch.tensor(rewards, dtype=torch.float32)
