"""plan_micro_batches: nothing lost or duplicated, budgets, balance, padding, bad input, and
exactness: the planned micro-batches accumulate the loss and gradients of the whole batch."""
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import CostModel, RolloutGroup, pack_groups, plan_micro_batches
from megatron_dualkv.models import build_model
from megatron_dualkv.planner import DEFAULT_ATTENTION_WEIGHT
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, RLMicroBatch, forward_backward, forward_logprobs
from strategies import rollout_groups


def with_rewards(groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [RolloutGroup(x.prompt, x.responses, torch.rand(len(x.responses), generator=g).round(decimals=1).tolist())
            for x in groups]


def expected_cost(prompt_len, response_lens, weight):
    p = prompt_len
    pairs = p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in response_lens)
    return p + sum(response_lens) + weight * pairs


@st.composite
def planning_inputs(draw):
    groups = with_rewards(draw(rollout_groups(max_groups=7, max_prompt=30, max_responses=6, max_response=30)))
    longest = max(len(g.prompt) + max(map(len, g.responses)) for g in groups)
    total = sum(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
    max_tokens = draw(st.integers(longest, max(longest, total + 5)))
    dp_size = draw(st.integers(1, 4))
    weight = draw(st.sampled_from([0.0, DEFAULT_ATTENTION_WEIGHT, 0.01]))
    return groups, max_tokens, dp_size, weight


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_plan_invariants(inputs):
    groups, max_tokens, dp_size, weight = inputs
    plan = plan_micro_batches(groups, max_tokens, dp_size, attention_weight=weight)
    offsets = [0]
    for g in groups:
        offsets.append(offsets[-1] + len(g.responses))

    assert plan.dp_size == dp_size and {len(mbs) for mbs in plan.ranks} == {plan.num_micro_batches}
    seen, item_costs, item_count = [], [], [0] * dp_size
    for rank, micro_batches in enumerate(plan.ranks):
        for mb in micro_batches:
            if mb.is_padding:
                assert mb.num_tokens == 0 and mb.cost == 0 and mb.response_index.numel() == 0
                continue
            assert mb.num_tokens <= max_tokens
            assert mb.num_tokens == sum(len(g.prompt) + sum(map(len, g.responses)) for g in mb.groups)
            assert mb.pack().num_tokens == mb.num_tokens
            index = []
            for sub, g, responses in zip(mb.groups, mb.source_groups, mb.source_responses):
                source = groups[g]
                assert list(sub.prompt) == list(source.prompt)  # every sub-group carries its whole prompt
                assert [list(r) for r in sub.responses] == [list(source.responses[i]) for i in responses]
                assert list(sub.rewards) == [source.rewards[i] for i in responses]
                assert list(responses) == sorted(responses)
                seen += [(g, i) for i in responses]
                index += [offsets[g] + i for i in responses]
                item_costs.append(expected_cost(len(source.prompt), [len(source.responses[i]) for i in responses], weight))
                item_count[rank] += 1
            assert mb.response_index.tolist() == index
            assert mb.select_responses(torch.arange(offsets[-1])).tolist() == index
            assert mb.cost == pytest.approx(sum(item_costs[-len(mb.groups):]))
    # nothing lost, nothing duplicated
    assert sorted(seen) == [(g, i) for g, group in enumerate(groups) for i in range(len(group.responses))]
    # a group that fits the budget stays whole unless a rank would otherwise have nothing to do
    if len(groups) >= dp_size:
        for g, group in enumerate(groups):
            if len(group.prompt) + sum(map(len, group.responses)) <= max_tokens:
                assert sum(1 for mbs in plan.ranks for mb in mbs for s in mb.source_groups if s == g) == 1
    # padding only where a rank has fewer (sub-)groups than micro-batches; no more micro-batches than needed
    for rank, micro_batches in enumerate(plan.ranks):
        assert sum(mb.is_padding for mb in micro_batches) == max(0, plan.num_micro_batches - item_count[rank])
    assert plan.num_micro_batches <= max(1, max(item_count))
    # balance: longest-processing-time-first bound, at most twice the ideal
    total, largest = sum(item_costs), max(item_costs)
    assert max(plan.rank_costs) <= total / dp_size + largest * (1 + 1e-9)
    assert max(plan.rank_costs) <= 2 * max(total / dp_size, largest) * (1 + 1e-9)
    # token accounting
    rollout = sum(len(g.responses) * len(g.prompt) + sum(map(len, g.responses)) for g in groups)
    assert plan.rollout_tokens == rollout
    assert plan.packed_tokens == sum(mb.num_tokens for mbs in plan.ranks for mb in mbs)
    assert plan.rho == pytest.approx(rollout / plan.packed_tokens)
    assert plan.loss_normalizer("sequence-mean") == pytest.approx(offsets[-1] / (plan.num_micro_batches * dp_size))
    response_tokens = sum(sum(map(len, g.responses)) for g in groups)
    assert plan.loss_normalizer("token-mean") == pytest.approx(response_tokens / (plan.num_micro_batches * dp_size))


def test_a_group_over_the_budget_is_split_into_balanced_sub_groups_with_the_prompt():
    group = RolloutGroup(list(range(10)), [[i] * 10 for i in range(6)], rewards=[0, 1, 0, 1, 0, 1])
    plan = plan_micro_batches([group], max_tokens=40, dp_size=1)
    assert plan.num_micro_batches == 2
    for mb in plan.ranks[0]:
        assert [list(g.prompt) for g in mb.groups] == [list(range(10))]
        assert len(mb.groups[0].responses) == 3 and mb.num_tokens == 40
    assert plan.packed_tokens == 80 and plan.rho == pytest.approx(120 / 80)


def test_a_rank_without_work_gets_half_a_group_or_padding():
    four = RolloutGroup([1, 2], [[3], [4, 5], [6], [7, 8]], rewards=[1, 0, 1, 0])
    plan = plan_micro_batches([four], max_tokens=100, dp_size=2)
    assert plan.num_micro_batches == 1
    assert [mb.source_responses for (mb,) in plan.ranks] == [((0, 1),), ((2, 3),)]
    assert plan.rank_costs[0] == pytest.approx(plan.rank_costs[1])

    one = RolloutGroup([1, 2], [[3]], rewards=[1.0])
    plan = plan_micro_batches([one], max_tokens=100, dp_size=2)
    (real,), (padding,) = plan.ranks
    assert not real.is_padding and padding.is_padding
    batch = padding.pack(pad_to_multiple_of=4, pad_token_id=7)
    assert batch.tokens.tolist() == [7, 7, 7, 7] and batch.layout.response_lens == ((1,),)
    assert batch.rewards[0].tolist() == [0.0]
    assert padding.select_responses(torch.tensor([5.0, 6.0])).tolist() == [0.0]


def test_every_rank_gets_the_same_number_of_micro_batches():
    groups = [RolloutGroup([1] * 8, [[2] * 8] * 3, rewards=[0, 1, 0]) for _ in range(5)]  # 32 tokens each
    plan = plan_micro_batches(groups, max_tokens=64, dp_size=2)  # ranks hold 3 and 2 groups
    assert plan.num_micro_batches == 2
    assert sorted(sum(not mb.is_padding for mb in mbs) for mbs in plan.ranks) == [2, 2]
    assert sorted(mb.num_tokens for mbs in plan.ranks for mb in mbs) == [32, 32, 32, 64]


def test_cost_model_of_a_model_config():
    model = build_model("qwen3-tiny")
    cost = CostModel.from_config(model.config, model.vocab_size)
    h, layers, ffn, heads, kv, d, vocab = 64, 2, 128, 4, 2, 16, 256
    per_layer = 2 * h * d * (2 * heads + 2 * kv) + 2 * h * ffn * 3
    assert cost.token_flops == layers * per_layer + 2 * h * vocab
    assert cost.pair_flops == layers * 4 * heads * d
    batch = pack_groups([RolloutGroup([1, 2, 3], [[4, 5], [6]])], pad_to_multiple_of=8)
    pairs = (1 + 2 + 3) + (4 + 5) + 4  # positions 0..2, then 3..4 and 3
    assert cost.layout_flops(batch.layout) == cost.token_flops * 6 + cost.pair_flops * pairs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be a positive int"),
        (dict(max_tokens=True), "max_tokens must be a positive int"),
        (dict(max_tokens=2.5), "max_tokens must be a positive int"),
        (dict(dp_size=0), "dp_size must be a positive int"),
        (dict(attention_weight=-1.0), "attention_weight must be >= 0"),
        (dict(max_tokens=5), r"group 1: its prompt \(3 tokens\) plus its longest response \(3\) is 6 tokens, more than max_tokens=5"),
        (dict(groups=[]), "no rollout groups"),
        (dict(groups=[RolloutGroup([1], [[2]], [1.0]), RolloutGroup([1], [[2]])]), "every group has rewards or none"),
        (dict(groups=[RolloutGroup([1], [])]), "group 0: needs a non-empty prompt and at least one response"),
        (dict(groups=[RolloutGroup([1], [[2], [3]], [1.0])]), "group 0: 1 rewards for 2 responses"),
    ],
)
def test_bad_input(kwargs, message):
    args = dict(groups=[RolloutGroup([1], [[2]]), RolloutGroup([1, 2, 3], [[4], [5, 6, 7]])], max_tokens=100, dp_size=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_micro_batches(**args)


# ---------------------------------------------------------------------------------------- exactness
def noise(response_ids, response_lens, scale, phase):
    """Deterministic per-token offsets keyed by (flat response id of the whole batch, token position)."""
    return [scale * torch.sin(phase + 1.3 * rid + 0.7 * torch.arange(n, dtype=torch.float32))
            for rid, n in zip(response_ids, response_lens)]


def behaviour_inputs(model, batch, response_ids):
    """old (and reference) log-probs near the model's own, the same for a response wherever it is packed."""
    with torch.no_grad():
        current = [r for group in forward_logprobs(model, batch) for r in group]
    lens = [len(r) for r in current]
    old = [c + n.to(c.device) for c, n in zip(current, noise(response_ids, lens, 0.3, 0.0))]
    ref = [c + n.to(c.device) for c, n in zip(current, noise(response_ids, lens, 0.1, 2.0))]
    return nest(old, batch), nest(ref, batch)


def nest(flat, batch):
    out, start = [], 0
    for rs in batch.layout.response_lens:
        out.append(flat[start : start + len(rs)])
        start += len(rs)
    return out


def run_whole(model, groups, loss_fn):
    batch = pack_groups(groups, pad_to_multiple_of=4)
    advantages = loss_fn.advantages(batch.rewards)
    old, ref = behaviour_inputs(model, batch, list(range(len(advantages))))
    model.zero_grad(set_to_none=True)
    (out,) = forward_backward(model, [RLMicroBatch(batch, old, ref, advantages)], loss_fn)
    return out.loss, grads_of(model)


def run_planned(model, advantages, loss_fn, plan, behaviour=behaviour_inputs, normalize=True):
    """Every DP rank's micro-batches through the schedule in one process, each with its part of the
    whole batch's ``advantages`` and ``behaviour(model, batch, response ids)``'s old and reference
    log-probs; DDP's mean over ranks by hand."""
    if normalize:
        loss_fn = dataclasses.replace(loss_fn, normalizer=plan.loss_normalizer(loss_fn.aggregation))
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for micro_batches in plan.ranks:
        rl_batches = []
        for mb in micro_batches:
            batch = mb.pack(pad_to_multiple_of=4)
            if mb.is_padding:  # its own log-probs: ratio 1 and KL 0 at zero advantage
                rl_batches.append(RLMicroBatch(batch, is_padding=True))
                continue
            old, ref = behaviour(model, batch, mb.response_index.tolist())
            rl_batches.append(RLMicroBatch(batch, old, ref, mb.select_responses(advantages)))
        outputs = forward_backward(model, rl_batches, loss_fn)
        loss += sum(out.loss for out in outputs) / (plan.num_micro_batches * plan.dp_size)
    return loss, {name: grad / plan.dp_size for name, grad in grads_of(model).items()}


def group_advantages(loss_fn, groups):
    return loss_fn.advantages([torch.tensor(g.rewards) for g in groups])


def grads_of(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny"])
def model(request):
    # MoE: no load-balancing loss, whose router statistics depend on what shares a micro-batch
    return build_model(request.param, moe_aux_loss_coeff=0.0)


LOSSES = {
    "grpo-seq-kl": GRPOLoss(clip_eps=0.2, kl_coef=0.05),
    "grpo-token": GRPOLoss(clip_eps=0.2, aggregation="token-mean"),
    "dapo": DAPOLoss(),
}


@pytest.mark.parametrize("loss_name", list(LOSSES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_planned_micro_batches_reproduce_the_whole_batch(model, loss_name, data):
    loss_fn = LOSSES[loss_name]
    groups = with_rewards(data.draw(rollout_groups(max_groups=4, max_prompt=9, max_responses=4, max_response=7, vocab=256)),
                          seed=data.draw(st.integers(0, 99)))
    longest = max(len(g.prompt) + max(map(len, g.responses)) for g in groups)
    total = sum(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
    max_tokens = data.draw(st.integers(longest, max(longest, total // 2)))
    plan = plan_micro_batches(groups, max_tokens, dp_size=data.draw(st.integers(1, 3)))
    whole_loss, whole_grads = run_whole(model, groups, loss_fn)
    loss, grads = run_planned(model, group_advantages(loss_fn, groups), loss_fn, plan)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padding_micro_batches_leave_the_loss_and_gradients_exact(model):
    groups = [RolloutGroup([1, 2, 3, 4], [[5, 6, 7], [8, 9]], [1.0, 0.0]), RolloutGroup([1, 2], [[3], [4]], [0.0, 1.0]),
              RolloutGroup([5, 6], [[7], [8]], [1.0, 0.0]), RolloutGroup([9], [[10], [11]], [0.0, 1.0])]
    plan = plan_micro_batches(groups, max_tokens=10, dp_size=2)
    assert [[mb.is_padding for mb in mbs] for mbs in plan.ranks] == [[False, True], [False, False]]
    loss_fn = LOSSES["grpo-seq-kl"]
    whole_loss, whole_grads = run_whole(model, groups, loss_fn)
    loss, grads = run_planned(model, group_advantages(loss_fn, groups), loss_fn, plan)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_the_global_normalizer_the_split_is_not_exact(model):
    """The check above can fail: micro-batch means are not the whole batch's mean."""
    groups = with_rewards([RolloutGroup([1, 2, 3], [[4], [5, 6, 7, 8], [9, 10]]), RolloutGroup([11], [[12, 13], [14]])])
    plan = plan_micro_batches(groups, max_tokens=8, dp_size=1)
    assert plan.num_micro_batches > 1
    loss_fn = LOSSES["dapo"]
    whole_loss, _ = run_whole(model, groups, loss_fn)
    loss, _ = run_planned(model, group_advantages(loss_fn, groups), loss_fn, plan, normalize=False)
    assert not math.isclose(loss.item(), whole_loss.item(), rel_tol=1e-3)
