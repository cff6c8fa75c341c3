"""forward_backward (megatron_dualkv.rl.step): the packed layout against the replicated oracle
through Megatron's schedule, for the tiny dense and MoE models."""
import pytest
import torch

from megatron_dualkv.models import build_model
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, RLMicroBatch, ResponseTokens, forward_backward, forward_logprobs
from megatron_dualkv import PlannedMicroBatch
from rollouts import max_abs_diff, perturbed, rl_micro_batches

SHAPES = [
    [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1])],
    [(3, [1]), (9, [2, 7, 3, 1]), (2, [4])],
]


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny"])
def model(request):
    # exact MoE comparison: fp32, no token dropping (Megatron's default), no load-balancing loss,
    # whose token statistics differ between layouts (packed prompts count once, not N times)
    return build_model(request.param, moe_aux_loss_coeff=0.0)




def run(model, batches, loss_fn, layout):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, loss_fn, layout=layout, with_entropy=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


@pytest.mark.parametrize("loss_fn", [GRPOLoss(clip_eps=0.2, kl_coef=0.05), DAPOLoss()], ids=["grpo", "dapo"])
def test_packed_equals_replicated(model, loss_fn):
    batches = rl_micro_batches(model, SHAPES)
    packed, packed_grads = run(model, batches, loss_fn, "packed")
    replicated, replicated_grads = run(model, batches, loss_fn, "replicated")
    for p, r in zip(packed, replicated):
        assert max_abs_diff(p.logprobs, r.logprobs) < 2e-6
        assert max_abs_diff(p.entropy, r.entropy) < 2e-6
        torch.testing.assert_close(p.loss, r.loss, rtol=1e-5, atol=1e-6)
        for name in p.metrics:
            torch.testing.assert_close(torch.cat(p.metrics[name]), torch.cat(r.metrics[name]), rtol=1e-5, atol=1e-6)
    assert packed_grads.keys() == replicated_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, replicated_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().max() > 0 for g in packed_grads.values())


def test_gradient_is_the_mean_over_micro_batches_of_the_loss(model):
    """What the schedule backpropagates: (loss_1 + loss_2) / 2 of the loss on forward_logprobs."""
    batches, loss_fn = rl_micro_batches(model, SHAPES), GRPOLoss(clip_eps=0.2, kl_coef=0.05)
    outputs, grads = run(model, batches, loss_fn, "packed")
    total = 0
    for mb, out in zip(batches, outputs):
        tokens = ResponseTokens.from_layout(mb.batch.layout)
        logprobs = tokens.flatten(forward_logprobs(model, mb.batch))
        result = loss_fn(logprobs, tokens.flatten(mb.old_logprobs), loss_fn.advantages(mb.batch.rewards), tokens,
                         tokens.flatten(mb.ref_logprobs))
        torch.testing.assert_close(out.loss, result.loss.detach())
        total = total + result.loss / len(batches)
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    model.zero_grad(set_to_none=True)


def test_forward_only_collects_logprobs_without_gradients(model):
    batches = [RLMicroBatch(mb.batch) for mb in rl_micro_batches(model, SHAPES)]
    outputs = forward_backward(model, batches)
    for mb, out in zip(batches, outputs):
        assert max_abs_diff(out.logprobs, forward_logprobs(model, mb.batch)) < 1e-6
        assert out.loss is None and out.entropy is None and not out.logprobs[0][0].requires_grad
    assert all(p.grad is None for p in model.parameters())


def test_given_advantages_replace_the_rewards(model):
    mb = rl_micro_batches(model, SHAPES)[0]
    advantages = torch.linspace(-1, 1, mb.batch.layout.num_responses)
    out = forward_backward(model, [RLMicroBatch(mb.batch, mb.old_logprobs, advantages=advantages)], GRPOLoss())[0]
    assert torch.cat(out.metrics["advantage"]).tolist() == pytest.approx(advantages.tolist())
    model.zero_grad(set_to_none=True)


def test_padding_micro_batches_add_no_loss_and_no_gradient(model):
    """A padding micro-batch (a plan's dummy) needs no log-probs and adds exactly nothing, even to a
    KL term: the schedule's mean over two micro-batches is half the real one's gradient."""
    mb = rl_micro_batches(model, SHAPES)[0]
    loss_fn = GRPOLoss(clip_eps=0.2, kl_coef=0.1)
    _, alone = run(model, [mb], loss_fn, "packed")
    padding = RLMicroBatch(PlannedMicroBatch((), (), (), torch.zeros(0, dtype=torch.long), 0, 0.0).pack(8), is_padding=True)
    outputs, with_padding = run(model, [mb, padding], loss_fn, "packed")
    assert outputs[1].loss.item() == 0.0 and set(outputs[1].metrics) == {"entropy"}
    # Bit for bit on the CPU. On the GPU the same check failed at rtol 1e-6 after this module's other
    # tests, and passed in a process of its own (PERF_NOTES.md, run DV): which norm kernels run
    # (compiled, or eager past torch.compile's graph limit) depends on what was compiled before. A
    # padding micro-batch's gradient would be of the order of the gradient itself.
    rtol = 1e-5 if next(model.parameters()).is_cuda else 0.0
    for name, grad in alone.items():
        torch.testing.assert_close(with_padding[name], grad / 2, rtol=rtol, atol=rtol * 1e-3, msg=name)


def test_rollout_logprobs_reach_the_loss(model):
    """RLMicroBatch.rollout_logprobs: the loss's rollout mismatch and truncated importance weights,
    as a direct call of the loss on forward_logprobs computes them."""
    mb = rl_micro_batches(model, SHAPES)[0]
    rollout = perturbed(mb.old_logprobs, 0.2, seed=3)
    loss_fn = GRPOLoss(clip_eps=0.2, kl_coef=0.05, tis_cap=1.1)
    (out,), _ = run(model, [RLMicroBatch(mb.batch, mb.old_logprobs, mb.ref_logprobs, rollout_logprobs=rollout)], loss_fn, "packed")
    tokens = ResponseTokens.from_layout(mb.batch.layout)
    with torch.no_grad():
        want = loss_fn(tokens.flatten(forward_logprobs(model, mb.batch)), tokens.flatten(mb.old_logprobs),
                       loss_fn.advantages(mb.batch.rewards), tokens, tokens.flatten(mb.ref_logprobs), tokens.flatten(rollout))
    torch.testing.assert_close(out.loss, want.loss)
    gap = (tokens.flatten(mb.old_logprobs) - tokens.flatten(rollout)).abs()
    torch.testing.assert_close(torch.cat(out.metrics["rollout_mismatch"]), tokens.response_mean(gap))
    with pytest.raises(ValueError, match=r"tis_cap=1.1 \(truncated importance sampling\) needs rollout_logprobs"):
        forward_backward(model, [mb], loss_fn)
    model.zero_grad(set_to_none=True)


def test_on_policy_takes_the_current_logprobs_as_the_old_ones(model):
    """RLMicroBatch.on_policy: the loss, metrics and gradients of the same micro-batch given the
    current log-probs (a separate forward) as its old ones, with a ratio of exactly 1."""
    mb = rl_micro_batches(model, SHAPES)[0]
    loss_fn = GRPOLoss(clip_eps=0.2, kl_coef=0.05)
    with torch.no_grad():
        current = forward_logprobs(model, mb.batch)
    (own,), own_grads = run(model, [RLMicroBatch(mb.batch, ref_logprobs=mb.ref_logprobs, on_policy=True)], loss_fn, "packed")
    (given,), given_grads = run(model, [RLMicroBatch(mb.batch, current, mb.ref_logprobs)], loss_fn, "packed")
    torch.testing.assert_close(own.loss, given.loss, rtol=1e-6, atol=1e-7)
    assert torch.cat(own.metrics["ratio_mean"]).eq(1).all()
    for name in given.metrics:
        torch.testing.assert_close(torch.cat(own.metrics[name]), torch.cat(given.metrics[name]), rtol=1e-5, atol=1e-6)
    for name, grad in given_grads.items():
        torch.testing.assert_close(own_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().max() > 0 for g in own_grads.values())


def test_bad_input(model):
    mb = rl_micro_batches(model, SHAPES)[0]
    with pytest.raises(ValueError, match="needs the micro-batch's old_logprobs"):
        forward_backward(model, [RLMicroBatch(mb.batch)], GRPOLoss())
    with pytest.raises(ValueError, match="an on_policy micro-batch takes the current log-probs as its old ones"):
        forward_backward(model, [RLMicroBatch(mb.batch, mb.old_logprobs, on_policy=True)], GRPOLoss())
    other = rl_micro_batches(model, SHAPES)[1]
    with pytest.raises(ValueError, match="old_logprobs: group 0 has 1 responses, the batch has 3"):
        forward_backward(model, [RLMicroBatch(mb.batch, other.old_logprobs)], GRPOLoss())
    with pytest.raises(ValueError, match="rollout_logprobs: group 0 has 1 responses, the batch has 3"):
        forward_backward(model, [RLMicroBatch(mb.batch, mb.old_logprobs, rollout_logprobs=other.old_logprobs)], GRPOLoss())
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        forward_backward(model, [RLMicroBatch(mb.batch, mb.old_logprobs)], GRPOLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="micro-batches must be RLMicroBatch items, got PackedBatch"):
        forward_backward(model, [mb.batch], GRPOLoss())
    with pytest.raises(ValueError, match="no micro-batches"):
        forward_backward(model, [])
    model.zero_grad(set_to_none=True)


def test_megatron_ddp_and_optimizer_loop():
    """The README's loop: Megatron DDP, Megatron optimizer, GRPO on packed micro-batches. On-policy
    GRPO raises the log-prob of the rewarded response of a group and lowers the other's."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dualkv import RolloutGroup, pack_groups

    model = build_model("qwen3-tiny", seed=11)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    groups = [RolloutGroup([1, 2, 3], [[4, 5], [6, 7, 8]], rewards=[1.0, 0.0]),
              RolloutGroup([9], [[10], [11, 12]], rewards=[0.0, 1.0])]
    micro_batches = [pack_groups(groups[:1], pad_to_multiple_of=8), pack_groups(groups[1:], pad_to_multiple_of=8)]
    before = [forward_logprobs(ddp, b) for b in micro_batches]
    for _ in range(3):
        with torch.no_grad():
            old = [forward_logprobs(ddp, b) for b in micro_batches]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(ddp, [RLMicroBatch(b, old_logprobs=o) for b, o in zip(micro_batches, old)], GRPOLoss())
        assert optimizer.step()[0]
    after = [forward_logprobs(ddp, b) for b in micro_batches]
    change = [[(a.sum() - b.sum()).item() for a, b in zip(ga[0], gb[0])] for ga, gb in zip(after, before)]
    assert change[0][0] > 0 > change[0][1] and change[1][1] > 0 > change[1][0], change
