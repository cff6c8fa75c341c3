"""PPO mini-batches and epochs (megatron_dualkv.rl.ppo): the mini-batches' groups, advantages and
normalisers against direct computations, and the ratio of later updates against an independent
forward of the model after the earlier ones."""
import math

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_dualkv import RolloutGroup, pack_groups, plan_micro_batches
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import (
    DAPOLoss, GRPOLoss, forward_backward, forward_logprobs, forward_only, plan_mini_batches, ppo_updates,
)
from rollouts import make_groups

SHAPES = [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1]), (3, [1]), (4, [2, 2, 3]), (2, [5, 1])]


def test_mini_batches_hold_consecutive_groups_with_their_advantages():
    groups = make_groups(SHAPES)
    loss_fn = DAPOLoss()
    advantages = loss_fn.advantages([torch.tensor(g.rewards) for g in groups])
    minis = plan_mini_batches(groups, 3, 16, advantages, dp_size=2, dp_rank=1)
    assert [mini.group_index for mini in minis] == [(0, 1), (2, 3), (4, 5)]
    flat = advantages.tolist()
    offsets = [0, 3, 5, 7, 8, 11, 13]
    for mini in minis:
        own = list(mini.group_index)
        want = plan_micro_batches([groups[g] for g in own], 16, 2)
        layout = lambda plan: [[(mb.source_groups, mb.source_responses) for mb in rank] for rank in plan.ranks]  # noqa: E731
        assert layout(mini.plan) == layout(want) and mini.planned == mini.plan.ranks[1]
        for planned, mb in zip(mini.planned, mini.micro_batches):
            assert mb.is_padding == planned.is_padding and mb.batch.num_tokens == planned.pack().num_tokens
            if not planned.is_padding:  # each response's advantage, found by its group and number
                expected = [flat[offsets[own[g]] + i] for g, rs in zip(planned.source_groups, planned.source_responses) for i in rs]
                assert mb.advantages.tolist() == pytest.approx(expected)
        tokens = sum(len(r) for g in own for r in groups[g].responses)
        assert mini.loss_fn(loss_fn).normalizer == pytest.approx(tokens / (want.num_micro_batches * 2))


def test_share_and_with_logprobs_follow_the_plan():
    groups = make_groups(SHAPES[:2])
    per_group = [[torch.full((len(r),), 10.0 * g + i) for i, r in enumerate(group.responses)] for g, group in enumerate(groups)]
    advantages = torch.zeros(5)
    (mini,) = plan_mini_batches(groups, 1, 10, advantages)  # group 0 (5 + 8 tokens) is split
    shares = mini.share(per_group)
    assert len(shares) == len(mini.micro_batches) > 1
    for planned, share in zip(mini.planned, shares):
        assert [[x[0].item() for x in group] for group in share] == [
            [10.0 * mini.group_index[g] + i for i in rs] for g, rs in zip(planned.source_groups, planned.source_responses)
        ]
    with_rollout = mini.with_logprobs(rollout=shares)
    assert all(mb.rollout_logprobs is share and mb.old_logprobs is None for mb, share in zip(with_rollout.micro_batches, shares))
    with pytest.raises(ValueError, match="old_logprobs: 1 entries for"):
        mini.with_logprobs(old=shares[:1])
    on_policy = mini.with_logprobs(rollout=shares, on_policy=True)
    assert all(mb.on_policy and mb.old_logprobs is None and mb.rollout_logprobs is share
               for mb, share in zip(on_policy.micro_batches, shares))
    assert not any(mb.on_policy for mb in with_rollout.micro_batches)
    with pytest.raises(ValueError, match="with_logprobs: on_policy takes the update's own log-probs as the old ones"):
        mini.with_logprobs(old=shares, on_policy=True)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda g, a: plan_mini_batches(g, 4, 64, a), "6 rollout groups do not split into 4 mini-batches"),
        (lambda g, a: plan_mini_batches(g, 0, 64, a), "num_mini_batches must be a positive int"),
        (lambda g, a: plan_mini_batches(g, 2, 64, a[:3]), r"one value per response of the rollout batch \(13\)"),
        (lambda g, a: plan_mini_batches(g, 2, 64, a, dp_size=2, dp_rank=2), r"dp_rank must be in \[0, 2\)"),
    ],
)
def test_bad_mini_batches(call, message):
    groups = make_groups(SHAPES)
    with pytest.raises(ValueError, match=message):
        call(groups, torch.zeros(13))


@pytest.fixture
def policy():
    model = build_model("qwen3-tiny", seed=5)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-2, clip_grad=0.0), [ddp])
    return ddp, optimizer


def independent_logprobs(model, groups):
    """Per group, per response: the replicated layout, each group in a batch of its own."""
    with torch.no_grad():
        return [forward_logprobs(model, pack_groups([group]), layout="replicated")[0] for group in groups]


@pytest.mark.parametrize("mini_batches, epochs", [(2, 1), (1, 2)])
def test_update_ratio_is_that_of_the_model_after_the_earlier_updates(policy, mini_batches, epochs):
    """Behaviour log-probs once, before update 1; update 2's per-response ratio is the token mean
    of exp(new - old), new from an independent forward of the model after update 1, and its
    gradient that of its mini-batch's loss alone."""
    ddp, optimizer = policy
    groups = [RolloutGroup(g.prompt, g.responses, [float(i % 2) for i in range(len(g.responses))]) for g in make_groups(SHAPES[:4])]
    loss_fn = GRPOLoss(clip_eps=0.2)
    advantages = loss_fn.advantages([torch.tensor(g.rewards) for g in groups])
    minis = plan_mini_batches(groups, mini_batches, 1024, advantages)
    assert all(len(mini.micro_batches) == 1 for mini in minis)  # one micro-batch: its outputs follow the groups
    old = independent_logprobs(ddp.module, groups)
    behaviour = forward_only(ddp, minis)
    minis = [mini.with_logprobs(old=[out.logprobs for out in outs]) for mini, outs in zip(minis, behaviour)]
    updates = ppo_updates(ddp, optimizer, minis, loss_fn, epochs)
    first = next(updates)
    assert (first.epoch, first.index) == (0, 0)
    first_ratios = torch.cat(first.outputs[0].metrics["ratio_mean"])
    assert first_ratios.tolist() == pytest.approx([1.0] * len(first_ratios), abs=1e-6)  # the behaviour policy itself
    new = independent_logprobs(ddp.module, groups)
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    second = next(updates)
    # its gradient is that of its own mini-batch at the weights after update 1, nothing accumulated
    fresh = build_model("qwen3-tiny", seed=5)
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(weights[n])
    forward_backward(fresh, second.mini_batch.micro_batches, second.mini_batch.loss_fn(loss_fn))
    for n, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.main_grad, fresh.get_parameter(n).grad, rtol=1e-4, atol=1e-7, msg=n)
    assert (second.epoch, second.index) == ((0, 1) if mini_batches == 2 else (1, 0))
    got = torch.cat(second.outputs[0].metrics["ratio_mean"]).tolist()
    want = [torch.exp(n - o).mean().item() for g in second.mini_batch.group_index for n, o in zip(new[g], old[g])]
    assert got == pytest.approx(want, rel=1e-5)
    assert max(abs(r - 1) for r in want) > 1e-3, "update 1 must move the policy"
    assert next(updates, None) is None
    assert math.isfinite(second.outputs[0].loss.item())
