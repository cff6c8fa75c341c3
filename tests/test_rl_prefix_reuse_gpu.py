"""Prefix reuse on a GPU, in bf16, on the CUDA paths the CPU tests do not run (the native and
Triton attention kernels, the short conv's Triton kernels, fla's delta rule where it is usable):
the parts' log-probs and every gradient within twice the one-micro-batch step's own bf16 error,
both against the float64 step (the ops' PyTorch math, on the GPU)."""
import pytest
import torch

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv import pack_groups
from megatron_dualkv.rl import GRPOLoss, RLMicroBatch, pack_prefix_reuse
from rollouts import make_groups
from test_qwen3_next_gpu import bf16_model_and_exact_copy
from test_rl_prefix_reuse import step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPE, PARTS = (300, [60, 1, 90, 3, 45]), [[0, 1], [2], [3, 4]]


def _step(model, micro_batches, normalizer):
    """``step``'s log-probs (the group's responses in the micro-batches' order) and gradients, float64 on the CPU."""
    outputs, grads = step(model, micro_batches, GRPOLoss(normalizer=normalizer))
    return (torch.cat([lp.detach().cpu().double() for out in outputs for lp in out.logprobs[0]]),
            {name: grad.cpu().double() for name, grad in grads.items()})


@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3_5-tiny"])
def test_parts_within_twice_the_whole_step_s_bf16_error(card):
    model, exact = bf16_model_and_exact_copy(card)  # a slow decay: the prompt's state reaches far into each response
    group = make_groups([SHAPE], seed=3)[0]
    advantages = GRPOLoss().advantages([torch.tensor(group.rewards)])
    whole = [RLMicroBatch(pack_groups([group]), on_policy=True, advantages=advantages)]
    parts = [RLMicroBatch(batch, on_policy=True, advantages=advantages[part])
             for batch, part in zip(pack_prefix_reuse(group, PARTS), PARTS)]
    responses = len(SHAPE[1])
    want_logprobs, want_grads = _step(exact, whole, responses)
    whole_logprobs, whole_grads = _step(model, whole, responses)
    part_logprobs, part_grads = _step(model, parts, responses / len(PARTS))
    order = [i for part in PARTS for i in part]  # the parts' responses, in their order
    starts = torch.tensor([0, *SHAPE[1]]).cumsum(0)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in order])
    assert_within_twice_the_reference_error("log-probs", part_logprobs, whole_logprobs[rows], want_logprobs[rows], 1e-3)
    assert part_grads.keys() == whole_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert_within_twice_the_reference_error(name, part_grads[name], whole_grads[name], want, 1e-3)
