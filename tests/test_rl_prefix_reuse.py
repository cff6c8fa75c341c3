"""Prefix reuse (rl.prefix_reuse): a group split into response micro-batches that share one prompt
forward and backward gives the one-micro-batch step's log-probs, losses and gradients, at float64
on the CPU, through Megatron's schedule."""
import pytest
import torch

from megatron_dualkv import pack_groups
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, RLMicroBatch, forward_backward, forward_logprobs, pack_prefix_reuse
from rollouts import make_groups, perturbed

SHAPE = (11, [5, 1, 7, 3, 4])
PARTS = [[0, 1], [2], [3, 4]]


@pytest.fixture(scope="module", params=["qwen3-tiny"])
def model(request):
    return build_model(request.param, moe_aux_loss_coeff=0.0).double()


def whole_and_parts(model, parts, pad=1, seed=0):
    """The group as one RLMicroBatch and as prefix-reuse parts, with the same old / reference
    log-probs and the whole group's advantages."""
    group = make_groups([SHAPE], seed=seed)[0]
    batch = pack_groups([group], pad_to_multiple_of=pad)
    with torch.no_grad():
        current = forward_logprobs(model, batch)
    old, ref = perturbed(current, 0.3, seed), perturbed(current, 0.1, seed + 10)
    advantages = GRPOLoss().advantages(batch.rewards)
    whole = RLMicroBatch(batch, old, ref, advantages=advantages)
    pieces = pack_prefix_reuse(group, parts, pad_to_multiple_of=pad)
    split = [RLMicroBatch(piece, [[old[0][i] for i in part]], [[ref[0][i] for i in part]], advantages=advantages[part])
             for piece, part in zip(pieces, parts)]
    return whole, split


def step(model, micro_batches, loss_fn):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, micro_batches, loss_fn, with_entropy=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
@pytest.mark.parametrize("parts", [PARTS, [[4, 2, 0, 1, 3]]], ids=["3 parts", "1 part"])
def test_prefix_reuse_equals_one_micro_batch(model, loss, parts):
    whole, split = whole_and_parts(model, parts)
    responses, tokens = len(SHAPE[1]), sum(SHAPE[1])
    count = responses if loss == "grpo" else tokens
    make = (lambda n: GRPOLoss(clip_eps=0.2, kl_coef=0.05, normalizer=n)) if loss == "grpo" else (
        lambda n: DAPOLoss(normalizer=n))
    (one,), one_grads = step(model, [whole], make(count))
    outputs, grads = step(model, split, make(count / len(parts)))
    for out, part in zip(outputs, parts):
        for got, i in zip(out.logprobs[0], part):
            torch.testing.assert_close(got, one.logprobs[0][i], rtol=0, atol=1e-12)
        for got, i in zip(out.entropy[0], part):
            torch.testing.assert_close(got, one.entropy[0][i], rtol=0, atol=1e-12)
    # the schedule averages the parts' losses
    torch.testing.assert_close(sum(out.loss for out in outputs) / len(parts), one.loss, rtol=1e-12, atol=1e-14)
    assert grads.keys() == one_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=1e-10, atol=1e-13, msg=name)
