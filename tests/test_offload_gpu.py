"""``mcore.offload`` on the GPU: the side streams, page-locked pieces and ``record_stream`` that the CPU
tests (tests/test_offload.py) do not run. Offloaded layers give the step of the model that keeps
them, and what they saved leaves the device by the end of the forward."""
import pytest
import torch

from megatron_dualkv.mcore.offload import LayerOffload
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import GRPOLoss, forward_backward
from megatron_dualkv.rl.host_stash import HostStash
from rollouts import rl_micro_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [[(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1])], [(3, [1]), (9, [2, 7, 3, 1]), (2, [4])]]


def _chain(offloader, x, offloaded, device):
    for position in range(1, 7):
        with offloader.layer(position, position in offloaded, device, 2) as mark_output:
            x = torch.tanh(x @ x.t() / x.shape[1]) @ x + x
        mark_output(x)
    return x


def test_offloaded_layers_leave_the_device_and_give_the_same_gradient_bitwise(fresh_offload):
    device = torch.device("cuda", torch.cuda.current_device())
    x0 = torch.randn(2048, 1024, device=device, requires_grad=True)
    kept = LayerOffload(HostStash(pin=True))
    base = torch.cuda.memory_allocated()
    out = _chain(kept, x0, set(), device)
    torch.cuda.synchronize()
    without = torch.cuda.memory_allocated() - base
    out.sum().backward()
    want, x0.grad = x0.grad.clone(), None
    del out
    base = torch.cuda.memory_allocated()
    out = _chain(fresh_offload, x0, {1, 2, 3}, device)
    torch.cuda.synchronize()
    torch.empty(1, device=device)  # the allocator takes back what the copies out held at its next call
    offloaded = torch.cuda.memory_allocated() - base
    # each layer saves x, x @ x.t() (its tanh), and tanh's output: 8 + 16 + 16 MiB... half the layers go
    assert offloaded < 0.6 * without, (offloaded, without)
    out.sum().backward()
    torch.testing.assert_close(x0.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3_5-tiny"])
def test_offloaded_layers_give_the_step_of_selective_recompute_in_bf16(fresh_offload, card):
    selective = build_model(card, dtype=torch.bfloat16, recompute="selective")
    offloaded = build_model(card, dtype=torch.bfloat16, recompute="offload", recompute_layers=1,
                            offload_min_bytes=0)  # the tiny models' tensors are small
    offloaded.load_state_dict(selective.state_dict())
    batches = rl_micro_batches(selective, SHAPES)
    results = []
    for model in (selective, offloaded):
        model.zero_grad(set_to_none=True)
        outputs = forward_backward(model, batches, GRPOLoss(clip_eps=0.2, kl_coef=0.05))
        results.append((outputs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert fresh_offload.stash.taken_bytes > 0
    (want_outputs, want_grads), (outputs, grads) = results
    for got, want in zip(outputs, want_outputs, strict=True):
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            torch.testing.assert_close(torch.cat(g), torch.cat(w), rtol=0, atol=0)
    for name, want in want_grads.items():  # the same kernels on the same data: equal up to atomics' order
        error = (grads[name].float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
        assert error < 1e-2, f"{name}: relative gradient error {error:.3g}"
