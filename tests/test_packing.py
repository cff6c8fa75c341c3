import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv import PackedBatch, RolloutGroup, pack_groups
from strategies import rollout_groups


@given(rollout_groups(), st.sampled_from([1, 3, 8, 64]))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_round_trip_and_positions(groups, multiple):
    batch = pack_groups(groups, pad_to_multiple_of=multiple)
    assert isinstance(batch, PackedBatch)
    unpadded = sum(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
    assert batch.num_tokens % multiple == 0 and 0 <= batch.num_tokens - unpadded < multiple
    assert batch.layout.pad_len == batch.num_tokens - unpadded
    for g, (prompt, responses) in zip(groups, batch.unpack(batch.tokens)):
        assert prompt.tolist() == list(g.prompt)
        assert [r.tolist() for r in responses] == [list(r) for r in g.responses]
    for g, (prompt_pos, response_pos) in zip(groups, batch.unpack(batch.position_ids)):
        P = len(g.prompt)
        assert prompt_pos.tolist() == list(range(P))
        for r, pos in zip(g.responses, response_pos):
            assert pos.tolist() == list(range(P, P + len(r)))
    pad = batch.layout.pad_len
    if pad:
        assert batch.position_ids[-pad:].tolist() == list(range(pad))
        assert not batch.loss_mask[-pad:].any()
    for (prompt_mask, response_masks) in batch.unpack(batch.loss_mask):
        assert not prompt_mask.any() and all(m.all() for m in response_masks)


@given(rollout_groups())
@settings(max_examples=40, deadline=None)
def test_replicated_layout(groups):
    batch = pack_groups(groups, pad_to_multiple_of=5)
    rep = batch.replicated()
    seqs = rep.split(rep.tokens)
    expected = [list(g.prompt) + list(r) for g in groups for r in g.responses]
    assert [s.tolist() for s in seqs] == expected
    for s, pos, mask, g_r in zip(seqs, rep.split(rep.position_ids), rep.split(rep.loss_mask),
                                 [(g, r) for g in groups for r in g.responses]):
        assert pos.tolist() == list(range(len(s)))
        assert mask.tolist() == [False] * len(g_r[0].prompt) + [True] * len(g_r[1])
    assert torch.equal(batch.tokens[rep.index], rep.tokens)
    assert torch.equal(batch.position_ids[rep.index], rep.position_ids)
    assert rep.tokens.numel() == sum(len(s) for s in expected)


@given(rollout_groups())
@settings(max_examples=40, deadline=None)
def test_rho_and_pair_ratio(groups):
    batch = pack_groups(groups, pad_to_multiple_of=7)
    rep_tokens = sum(len(g.prompt) + len(r) for g in groups for r in g.responses)
    packed_tokens = sum(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
    assert batch.rho == pytest.approx(rep_tokens / packed_tokens)
    # pair ratio from the dense masks themselves
    rep_pairs = int(batch.replicated().layout.dense_mask().sum())
    unpadded = pack_groups(groups)
    assert batch.attention_pair_ratio == pytest.approx(rep_pairs / int(unpadded.layout.dense_mask().sum()))


def test_rho_formula_uniform():
    N, P, R = 16, 8, 3
    batch = pack_groups([RolloutGroup([1] * P, [[2] * R] * N)])
    assert batch.rho == pytest.approx(N * (P + R) / (P + N * R))


def test_accepts_tensors_numpy_and_ranges_and_rewards():
    batch = pack_groups([
        RolloutGroup(torch.tensor([5, 6], dtype=torch.int32), [np.array([1, 2]), range(3, 5)], rewards=[1.0, 0.0]),
        RolloutGroup([7], [[8]], rewards=[0.5]),
    ])
    assert batch.tokens.tolist() == [5, 6, 1, 2, 3, 4, 7, 8]
    assert batch.tokens.dtype == torch.long
    assert [r.tolist() for r in batch.rewards] == [[1.0, 0.0], [0.5]]


@pytest.mark.parametrize(
    "groups, message",
    [
        ([], "no rollout groups"),
        ([RolloutGroup([], [[1]])], "empty prompt"),
        ([RolloutGroup([1], [])], "no responses"),
        ([RolloutGroup([1], [[2], []])], "response 1 is empty"),
        ([RolloutGroup([1.5], [[2]])], "must be integers"),
        ([RolloutGroup([1], [["a"]])], "must be integers"),
        ([RolloutGroup([True], [[2]])], "must be integers"),
        ([RolloutGroup(torch.tensor([1.0]), [[2]])], "integer tensor"),
        ([RolloutGroup([-1], [[2]])], "negative token id"),
        ([RolloutGroup([1], [[2]], rewards=[1.0, 2.0])], "2 rewards for 1 responses"),
        ([RolloutGroup([1], [[2]], rewards=[1.0]), RolloutGroup([1], [[2]])], "every group has rewards"),
        ([RolloutGroup(range(2**31), [[2]])], "overflow int32"),
        (["not a group"], "expected a RolloutGroup"),
    ],
)
def test_bad_input(groups, message):
    with pytest.raises(ValueError, match=message):
        pack_groups(groups)


@pytest.mark.parametrize("multiple", [0, -2, 1.5])
def test_bad_pad_multiple(multiple):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pack_groups([RolloutGroup([1], [[2]])], pad_to_multiple_of=multiple)


def test_unpack_rejects_wrong_length():
    batch = pack_groups([RolloutGroup([1], [[2]])])
    with pytest.raises(ValueError, match="rows"):
        batch.unpack(torch.zeros(5))
