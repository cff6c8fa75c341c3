"""The short conv's Triton kernels on a GPU at a Qwen3.5-like shape: bf16 within 2x the gather +
conv1d path's bf16 error (both against float64), and bitwise-reproducible gradients."""
import pytest
import torch

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv.layout import DualKVLayout
from megatron_dualkv.ops.causal_conv1d import causal_conv1d_func

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _group_inputs(channels=1024, width=4, seed=0):
    layout = DualKVLayout((1021,), ((193, 1, 2, 250, 3) * 3 + (77,),), pad_len=5).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(layout.total_tokens, channels, device="cuda", dtype=torch.float64, generator=g)
    weight = torch.randn(channels, width, device="cuda", dtype=torch.float64, generator=g) / width**0.5
    dout = torch.randn(layout.total_tokens, channels, device="cuda", dtype=torch.float64, generator=g)
    return layout, x, weight, dout


def _output_and_grads(x, weight, layout, dout, use_kernel):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = causal_conv1d_func(x, weight, layout, None, "silu", use_kernel=use_kernel)
    return (y, *torch.autograd.grad(y, (x, weight), dout.to(y.dtype)))


def test_bf16_within_twice_the_pytorch_error():
    layout, x, weight, dout = _group_inputs()
    ours = _output_and_grads(x.bfloat16(), weight.bfloat16(), layout, dout, True)
    torch_path = _output_and_grads(x.bfloat16(), weight.bfloat16(), layout, dout, False)
    exact = _output_and_grads(x, weight, layout, dout, False)
    for name, a, b, want in zip(("y", "dx", "dweight"), ours, torch_path, exact):
        assert a.dtype == torch.bfloat16
        assert_within_twice_the_reference_error(name, a, b, want, 1e-3)


def test_gradients_are_bitwise_reproducible():
    layout, x, weight, dout = _group_inputs(seed=1)
    first, second = (_output_and_grads(x.bfloat16(), weight.bfloat16(), layout, dout, True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
