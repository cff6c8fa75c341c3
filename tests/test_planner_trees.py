"""plan_micro_batches on trajectories (prefix trees): every trajectory once with its whole path,
budgets, the union's tokens and cost against the packed layout, trees kept whole when they fit,
a tree over the budget split into subtrees that carry their path, bad input named by trajectory,
and exactness: the planned micro-batches accumulate the loss and gradients of the whole batch."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import Trajectory, pack_trajectories, plan_micro_batches, trajectory_groups
from megatron_dualkv.models import build_model
from megatron_dualkv.planner import DEFAULT_ATTENTION_WEIGHT
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, RLMicroBatch, ResponseTokens, forward_backward, trajectory_logprobs
from strategies import trajectory_sets
from test_planner import grads_of, run_planned
from test_rl_trees import with_rewards


def distinct_prefixes(trajectories):
    """Tokens of the maximal prefix trees of ``trajectories``: their distinct prefixes per group."""
    return len({(t.group, tuple(t.tokens[:n])) for t in trajectories for n in range(1, len(t.tokens) + 1)})


@st.composite
def planning_inputs(draw):
    trajectories = draw(trajectory_sets(max_groups=4, max_segment=6, max_segments=12))
    longest = max(len(t.tokens) for t in trajectories)
    max_tokens = draw(st.integers(longest, max(longest, distinct_prefixes(trajectories) + 3)))
    weight = draw(st.sampled_from([0.0, DEFAULT_ATTENTION_WEIGHT, 0.01]))
    return trajectories, max_tokens, draw(st.integers(1, 4)), weight


@settings(max_examples=200, deadline=None)
@given(planning_inputs())
def test_tree_plan_invariants(inputs):
    trajectories, max_tokens, dp_size, weight = inputs
    plan = plan_micro_batches(trajectories, max_tokens, dp_size, attention_weight=weight)
    groups = trajectory_groups(trajectories)
    flat = [i for members in groups for i in members]  # the flat (group by group) order of the input
    group_number = [g for g, members in enumerate(groups) for _ in members]
    assert plan.dp_size == dp_size and {len(mbs) for mbs in plan.ranks} == {plan.num_micro_batches}
    seen, micro_batch_of = [], {}
    for rank, micro_batches in enumerate(plan.ranks):
        for mb in micro_batches:
            if mb.is_padding:
                assert mb.num_tokens == 0 and mb.cost == 0 and mb.response_index.numel() == 0
                continue
            index = mb.response_index.tolist()
            assert mb.trajectories == tuple(trajectories[flat[k]] for k in index)  # each with its whole path
            assert list(mb.source_groups) == sorted({group_number[k] for k in index})
            batch = mb.pack()
            # the micro-batch packs its trajectories group by group, in the plan's order
            assert ResponseTokens.of(batch).trajectory_of.tolist() == list(range(len(index)))
            assert mb.num_tokens == batch.num_tokens == distinct_prefixes(mb.trajectories) <= max_tokens
            assert mb.cost == pytest.approx(batch.num_tokens + weight * batch.layout.attention_pairs())
            seen += index
            micro_batch_of.update({flat[k]: (rank, id(mb)) for k in index})
    assert sorted(seen) == list(range(len(trajectories)))  # nothing lost, nothing duplicated
    # a tree (the trajectories of a group that start alike) that fits stays whole
    trees = {}
    for i, t in enumerate(trajectories):
        trees.setdefault((t.group, t.tokens[0]), []).append(i)
    if len(trees) >= dp_size:
        for tree in trees.values():
            if distinct_prefixes([trajectories[i] for i in tree]) <= max_tokens:
                assert len({micro_batch_of[i] for i in tree}) == 1
    if dp_size == 1 and distinct_prefixes(trajectories) <= max_tokens:
        assert plan.num_micro_batches == 1
    trained = [sum(1 for m in (t.loss_mask or [1] * len(t.tokens))[1:] if m) for t in trajectories]
    assert plan.rollout_tokens == sum(len(t.tokens) for t in trajectories)
    assert plan.packed_tokens == sum(mb.num_tokens for mbs in plan.ranks for mb in mbs)
    count = plan.num_micro_batches * dp_size
    assert plan.loss_normalizer("sequence-mean") == pytest.approx(max(1, sum(n > 0 for n in trained)) / count)
    assert plan.loss_normalizer("token-mean") == pytest.approx(max(1, sum(trained)) / count)


def subtree(prefix, branches, length=5, first=20):
    """Trajectories of a tree: ``prefix``, then ``branches`` turns of ``length`` tokens, each with two answers."""
    out = []
    for b in range(branches):
        turn = [first + 10 * b] * length
        out += [Trajectory(prefix + turn + [first + 10 * b + 1 + a] * length, group=0) for a in range(2)]
    return out


def test_a_tree_over_the_budget_is_split_into_subtrees_that_carry_their_path():
    root = list(range(10))
    trajectories = subtree(root, 2)  # 10 + 2 x (5 + 2 x 5) = 40 tokens
    plan = plan_micro_batches(trajectories, max_tokens=25)
    parts = [mb.trajectories for mb in plan.ranks[0]]
    assert parts == [tuple(trajectories[:2]), tuple(trajectories[2:])] and plan.packed_tokens == 50
    plan = plan_micro_batches(trajectories, max_tokens=20)  # a turn and its answers do not fit with the root
    assert [mb.trajectories for mb in plan.ranks[0]] == [(t,) for t in trajectories]
    assert [mb.num_tokens for mb in plan.ranks[0]] == [20] * 4
    plan = plan_micro_batches(trajectories, max_tokens=40, dp_size=2)  # halved for the second rank
    halves = [[tuple(trajectories[:2])], [tuple(trajectories[2:])]]
    assert [[mb.trajectories for mb in mbs] for mbs in plan.ranks] == halves
    # below a common path (the root, then a turn with three answers): the fewest parts that fit with
    # that path, two answers and the other with the root's other branch (the root and turn are 15
    # tokens, each answer and the other branch 5)
    deep = [*(Trajectory(root + [20] * 5 + [21 + a] * 5, group=0) for a in range(3)), Trajectory(root + [30] * 5, group=0)]
    plan = plan_micro_batches(deep, max_tokens=25)
    assert [mb.num_tokens for mb in plan.ranks[0]] == [25, 25]
    # a prefix of another trajectory goes with it and adds no token
    plan = plan_micro_batches([*trajectories, Trajectory(root[:4], group=0)], max_tokens=25)
    assert sorted(mb.num_tokens for mb in plan.ranks[0]) == [25, 25]


def test_a_trajectory_batch_plans_as_its_trajectories():
    trajectories = [Trajectory([1, 2, 3], [0, 1, 1], 1.0, "a"), Trajectory([1, 2, 4, 5], [1, 1, 1, 1], 0.0, "a"),
                    Trajectory([6, 7], [1, 1], 0.5, "b")]
    plan = plan_micro_batches(pack_trajectories(trajectories, pad_to_multiple_of=8), max_tokens=5, dp_size=2)
    want = plan_micro_batches(trajectories, max_tokens=5, dp_size=2)
    def shape(p):
        return [[(mb.source_groups, mb.source_responses, mb.num_tokens) for mb in mbs] for mbs in p.ranks]

    def content(p):
        return [[(list(t.tokens), [bool(m) for m in t.loss_mask], t.reward, t.group) for t in mb.trajectories]
                for mbs in p.ranks for mb in mbs]

    assert shape(plan) == shape(want) == [[((0,), ((0, 1),), 5)], [((1,), ((0,),), 2)]]
    assert content(plan) == content(want)


@pytest.mark.parametrize(
    "trajectories, max_tokens, message",
    [
        ([Trajectory([1, 2]), Trajectory([])], 10, r"trajectory 1: empty tokens"),
        ([Trajectory([1, 2]), Trajectory([1, 2, 3], [1, 0])], 10, r"trajectory 1: loss_mask has shape \(2,\)"),
        ([Trajectory([1, 2]), Trajectory([1, 2, 3, 4])], 3, r"trajectory 1 has 4 tokens, more than max_tokens=3"),
        ([Trajectory([1, 2], group=0), Trajectory([3])], 10, r"either every trajectory has a group or none does"),
    ],
)
def test_bad_trajectories_are_named_by_their_input_number(trajectories, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(trajectories, max_tokens)


# ---------------------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def model():
    return build_model("qwen3-tiny")


def behaviour_inputs(model, batch, numbers):
    """old and reference log-probs of the trained tokens, near the model's own and the same for a
    trajectory wherever it is packed (seeded by ``numbers``: its place in the whole input)."""
    tokens = ResponseTokens.of(batch)
    with torch.no_grad():
        full = trajectory_logprobs(model, batch)
    old, ref = [], []
    for i in tokens.trajectory_of.tolist():
        t = torch.nonzero(batch.loss_masks[i][1:]).squeeze(1)
        phase = (1.3 * numbers[i] + 0.7 * t.float()).to(full[i].device)
        old.append(full[i][t] + 0.3 * torch.sin(phase))
        ref.append(full[i][t] + 0.1 * torch.sin(2.0 + phase))
    return tokens.split(torch.cat(old)), tokens.split(torch.cat(ref))


def run_whole(model, trajectories, loss_fn):
    batch = pack_trajectories(trajectories, pad_to_multiple_of=4)
    flat = [i for members in trajectory_groups(trajectories) for i in members]
    old, ref = behaviour_inputs(model, batch, {i: k for k, i in enumerate(flat)})
    model.zero_grad(set_to_none=True)
    (out,) = forward_backward(model, [RLMicroBatch(batch, old, ref)], loss_fn)
    return out.loss, grads_of(model)


LOSSES = {"grpo-seq-kl": GRPOLoss(clip_eps=0.2, kl_coef=0.05), "dapo": DAPOLoss()}


@pytest.mark.parametrize("loss_name", list(LOSSES))
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_planned_micro_batches_reproduce_the_whole_batch(model, loss_name, data):
    """Trees split over micro-batches and ranks (each part with its path), group advantages taken
    on whole groups, the plan's normaliser: the loss and gradients of one micro-batch of everything."""
    trajectories = data.draw(trajectory_sets(max_groups=3, max_segment=4, max_segments=9, grouped=True))
    trajectories = with_rewards(trajectories, data.draw(st.integers(0, 99)))
    longest = max(len(t.tokens) for t in trajectories)
    max_tokens = data.draw(st.integers(longest, max(longest, distinct_prefixes(trajectories) // 2)))
    plan = plan_micro_batches(trajectories, max_tokens, dp_size=data.draw(st.integers(1, 3)))
    whole_loss, whole_grads = run_whole(model, trajectories, LOSSES[loss_name])
    groups = trajectory_groups(trajectories)
    advantages = LOSSES[loss_name].advantages([torch.tensor([trajectories[i].reward for i in g]) for g in groups])
    loss, grads = run_planned(model, advantages, LOSSES[loss_name], plan, behaviour_inputs)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)
