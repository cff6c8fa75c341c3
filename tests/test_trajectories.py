"""pack_trajectories: prefix trees of trajectories against the replicated layout (each trajectory one
causal sequence), maximal sharing, and depth 1 against pack_groups."""
import inspect
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv import RolloutGroup, Trajectory, TrajectoryBatch, TreeLayout, pack_groups, pack_trajectories
from strategies import rollout_groups, trajectory_sets


def replicated_mask(batch: TrajectoryBatch, window=None) -> torch.Tensor:
    """The causal mask of every trajectory (and of the padding), mapped to packed indices."""
    T = batch.num_tokens
    mask = torch.zeros(T, T, dtype=torch.bool)
    sequences = list(batch.trajectory_index)
    if batch.layout.pad_len:
        sequences.append(torch.arange(T - batch.layout.pad_len, T))
    for index in sequences:
        i = torch.arange(index.numel())
        causal = i[None, :] <= i[:, None]
        if window is not None:
            causal &= i[:, None] - i[None, :] < window
        mask[index[:, None], index[None, :]] |= causal
    return mask


def prefixes(trajectories, group_of):
    """Distinct non-empty prefixes per group: the tokens a maximal prefix tree packs."""
    return {(group_of(t), tuple(t.tokens[:n])) for t in trajectories for n in range(1, len(t.tokens) + 1)}


@given(trajectory_sets(), st.sampled_from([1, 4, 16]), st.one_of(st.none(), st.integers(1, 6)))
@settings(max_examples=80, deadline=None)
def test_trees_match_the_replicated_layout(trajectories, multiple, window):
    batch = pack_trajectories(trajectories, pad_to_multiple_of=multiple)
    layout = batch.layout
    assert isinstance(layout, TreeLayout) and batch.num_tokens % multiple == 0
    assert 0 <= layout.pad_len < multiple
    real = batch.num_tokens - layout.pad_len
    # every trajectory, token by token, at positions 0..L-1
    for traj, index in zip(trajectories, batch.trajectory_index):
        assert batch.tokens[index].tolist() == list(traj.tokens)
        assert batch.position_ids[index].tolist() == list(range(len(traj.tokens)))
        assert batch.predictor_index[index].tolist() == [-1, *index[:-1].tolist()]
    assert torch.equal(batch.tokens[real:], torch.zeros(layout.pad_len, dtype=torch.long))
    # the attention rule of the tree is the union of the trajectories' causal masks
    assert torch.equal(layout.dense_mask(window), replicated_mask(batch, window))
    assert layout.attention_pairs(window) == int(layout.dense_mask(window).sum())
    # every packed token is used by some trajectory, once per distinct prefix of its group
    used = torch.zeros(batch.num_tokens, dtype=torch.bool)
    used[torch.cat(batch.trajectory_index)] = True
    assert used[:real].all() and not used[real:].any()
    groups = batch.group_index.tolist()
    assert real == len(prefixes(trajectories, lambda t: groups[trajectories.index(t)]))
    assert batch.rho == pytest.approx(sum(len(t.tokens) for t in trajectories) / real)


@given(trajectory_sets())
@settings(max_examples=60, deadline=None)
def test_trees_are_compact_and_deterministic(trajectories):
    batch = pack_trajectories(trajectories)
    layout, tokens = batch.layout, batch.tokens.tolist()
    children = {}
    for s, node in enumerate(layout.nodes):
        children.setdefault(node.parent, []).append(s)
    # siblings never start alike (roots only within a group: a group's trees are contiguous)
    group_of_token = torch.empty(batch.num_tokens, dtype=torch.long)
    for index, g in zip(batch.trajectory_index, batch.group_index.tolist()):
        group_of_token[index] = g
    for parent, kids in children.items():
        firsts = [(int(group_of_token[layout.nodes[s].start]), tokens[layout.nodes[s].start]) for s in kids]
        assert len(set(firsts)) == len(firsts), f"siblings of {parent} start alike"
        if parent >= 0:
            assert len(kids) >= 2, f"segment {parent} has a single child: it should have been merged"
    # a trajectory's segments are its path, root first
    for segments, index in zip(batch.trajectory_segments, batch.trajectory_index):
        assert [layout.nodes[s].parent for s in segments] == [-1, *segments[:-1]]
        node = layout.nodes[segments[-1]]
        assert node.start <= int(index[-1]) < node.start + node.length
    again = pack_trajectories(trajectories)
    assert torch.equal(again.tokens, batch.tokens) and again.layout.segment_parent == layout.segment_parent
    assert all(torch.equal(a, b) for a, b in zip(again.trajectory_index, batch.trajectory_index))


@given(trajectory_sets())
@settings(max_examples=40, deadline=None)
def test_metadata_and_replicated_batch(trajectories):
    batch = pack_trajectories(trajectories, pad_to_multiple_of=3)
    for traj, mask in zip(trajectories, batch.loss_masks):
        expected = [True] * len(traj.tokens) if traj.loss_mask is None else [bool(x) for x in traj.loss_mask]
        assert mask.tolist() == expected
    if trajectories[0].reward is None:
        assert batch.rewards is None
    else:
        assert batch.rewards.tolist() == [t.reward for t in trajectories]
    if trajectories[0].group is None:
        assert batch.groups is None and not batch.group_index.any()
    else:
        assert batch.groups == tuple(t.group for t in trajectories)
        first_seen = list(dict.fromkeys(batch.groups))
        assert batch.group_index.tolist() == [first_seen.index(g) for g in batch.groups]
    rep = batch.replicated()
    assert [s.tolist() for s in rep.split(rep.tokens)] == [list(t.tokens) for t in trajectories]
    assert [s.tolist() for s in rep.split(rep.position_ids)] == [list(range(len(t.tokens))) for t in trajectories]
    assert torch.equal(rep.loss_mask, torch.cat(batch.loss_masks))
    assert torch.equal(batch.tokens[rep.index], rep.tokens)


def test_groups_keep_their_own_trees_in_order_of_first_occurrence():
    trajectories = [Trajectory([1, 2, 3], group="b"), Trajectory([1, 2, 4], group="a"),
                    Trajectory([1, 2, 5], group="b"), Trajectory([1, 9], group="a")]
    batch = pack_trajectories(trajectories)
    # group "b" first: [1 2] then children [3], [5]; group "a": [1] then [2 4], [9]
    assert batch.tokens.tolist() == [1, 2, 3, 5, 1, 2, 4, 9]
    assert batch.layout.segment_parent == (-1, 0, 0, -1, 3, 3)
    assert batch.group_index.tolist() == [0, 1, 0, 1]
    assert [i.tolist() for i in batch.trajectory_index] == [[0, 1, 2], [4, 5, 6], [0, 1, 3], [4, 7]]


def test_ungrouped_trajectories_share_one_trie_and_may_end_inside_it():
    trajectories = [Trajectory([5, 6, 7, 8]), Trajectory([5, 6]), Trajectory([5, 6, 7, 8]), Trajectory([5, 6, 9])]
    batch = pack_trajectories(trajectories)
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9]
    assert batch.layout.segment_lens == (2, 2, 1) and batch.layout.segment_parent == (-1, 0, 0)
    assert batch.layout.max_depth == 1 and batch.layout.max_logical_len == 4
    assert batch.predictor_index.tolist() == [-1, 0, 1, 2, 1]
    assert batch.rho == pytest.approx(13 / 5)


def test_a_deep_tree_packs_without_recursion():
    """Each trajectory branches one token deeper than the last: a path of 300 segments, under a
    recursion limit that a recursive walk of it would exceed."""
    trajectories = [Trajectory([0] * n + [1]) for n in range(300)]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)
    try:
        batch = pack_trajectories(trajectories)
    finally:
        sys.setrecursionlimit(limit)
    assert batch.layout.max_depth == 298 and batch.num_tokens == 299 + 300  # the zeros once, every 1


@given(rollout_groups(max_responses=4), st.sampled_from([1, 8]))
@settings(max_examples=40, deadline=None)
def test_depth_one_trajectories_pack_like_pack_groups(groups, multiple):
    """Responses with distinct first tokens: the trie finds exactly pack_groups' prompts and responses."""
    groups = [RolloutGroup(g.prompt, [[100 + i, *r[1:]] for i, r in enumerate(g.responses)]) for g in groups]
    trajectories = [Trajectory([*g.prompt, *r], group=n) for n, g in enumerate(groups) for r in g.responses]
    tree = pack_trajectories(trajectories, pad_to_multiple_of=multiple)
    packed = pack_groups(groups, pad_to_multiple_of=multiple)
    assert torch.equal(tree.tokens, packed.tokens)
    assert torch.equal(tree.position_ids, packed.position_ids)
    assert torch.equal(tree.layout.dense_mask(), packed.layout.dense_mask())
    assert torch.equal(tree.layout.dense_mask(3), packed.layout.dense_mask(3))
    assert tree.rho == pytest.approx(packed.rho)


@pytest.mark.parametrize(
    "trajectories, message",
    [
        ([], "no trajectories"),
        ([Trajectory([1]), Trajectory([])], "trajectory 1: empty tokens"),
        ([Trajectory([1, 2], loss_mask=[1])], r"loss_mask has shape \(1,\), expected \(2,\)"),
        ([Trajectory([1, 2], loss_mask=[[1, 0]])], "loss_mask has shape"),
        ([Trajectory([1, 2], loss_mask=[1, 2])], "0/1 or bools"),
        ([Trajectory([1, 2], loss_mask=["a", "b"])], "0/1 or bools"),
        ([Trajectory([1.5])], "must be integers"),
        ([Trajectory([True])], "must be integers"),
        ([Trajectory(torch.tensor([1.0]))], "integer tensor"),
        ([Trajectory([3, -1])], "negative token id"),
        ([Trajectory([1], group=0), Trajectory([2])], "every trajectory has a group or none.*trajectory 1 has none"),
        ([Trajectory([1]), Trajectory([2], reward=1.0)], "every trajectory has a reward or none"),
        ([Trajectory([1], reward="high")], "reward must be a number"),
        (["not a trajectory"], "expected a Trajectory"),
    ],
)
def test_bad_input(trajectories, message):
    with pytest.raises(ValueError, match=message):
        pack_trajectories(trajectories)


@pytest.mark.parametrize("multiple", [0, -2, 1.5])
def test_bad_pad_multiple(multiple):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack_trajectories([Trajectory([1])], pad_to_multiple_of=multiple)


def test_accepts_tensors_numpy_and_ranges():
    batch = pack_trajectories([Trajectory(torch.tensor([5, 6], dtype=torch.int32), loss_mask=torch.tensor([0, 1])),
                               Trajectory(np.array([5, 7]), loss_mask=np.array([False, True])),
                               Trajectory(range(5, 9))])
    assert batch.tokens.tolist() == [5, 6, 7, 8, 7] and batch.tokens.dtype == torch.long
    assert [m.tolist() for m in batch.loss_masks] == [[False, True], [False, True], [True] * 4]


def test_to_device_moves_every_tensor():
    batch = pack_trajectories([Trajectory([1, 2], reward=1.0), Trajectory([1, 3], reward=0.0)]).to("meta")
    assert batch.tokens.device.type == "meta" and batch.layout.device.type == "meta"
    assert batch.trajectory_index[0].device.type == "meta" and batch.rewards.device.type == "meta"
