"""The Triton GeGLU (Gemma's MLP activation) against PyTorch ops: float64 on CPU (interpreter), and
the flash-attention style bound in low precision (the GPU in bf16 when there is one)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.ops.geglu import geglu_func, geglu_reference


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(DEVICE, dtype)
    return x, dy


def run(activation, x, dy):
    leaf = x.detach().clone().requires_grad_()
    y = activation(leaf)
    return y, *torch.autograd.grad(y, leaf, dy.to(y.dtype))


@given(st.sampled_from([(1, 2), (5, 14), (3, 2, 74), (2, 1, 3, 2050), (17, 600)]))
@settings(max_examples=8, deadline=None)
def test_matches_float64(shape):
    """Shapes with halves shorter than, and not a multiple of, a program's block."""
    x, dy = inputs(shape, torch.float32)
    got = run(geglu_func, x, dy)
    want = run(geglu_reference, x.double(), dy.double())
    for name, a, b in zip(("y", "dx"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


def test_low_precision_within_twice_the_pytorch_error():
    """Error against float64 at most 2x that of the same ops in PyTorch at the same precision."""
    shape = (64, 2, 2 * 5376) if DEVICE == "cuda" else (6, 1, 96)
    x, dy = inputs(shape, LOW, seed=1)
    exact = run(geglu_reference, x.double(), dy.double())
    ours = run(geglu_func, x, dy)
    torch_ops = run(geglu_reference, x, dy)
    for name, a, b, e in zip(("y", "dx"), ours, torch_ops, exact):
        assert a.dtype == LOW, name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-3)


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="must be even"):
        geglu_func(torch.zeros(2, 7, device=DEVICE))


def test_no_rows():
    x = torch.zeros(0, 1, 16, device=DEVICE, requires_grad=True)
    assert geglu_func(x).shape == (0, 1, 8)
