"""The Triton RMSNorm (Gemma's float32 norm) against PyTorch ops: float64 on CPU (interpreter),
and the flash-attention style bound in low precision (the GPU in bf16 when there is one)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.ops.rms_norm import rms_norm_func, rms_norm_reference


def inputs(shape, weight_kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=g)).to(DEVICE, dtype)
    weight = None if weight_kind == "none" else (0.5 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    dy = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    return x, weight, dy


def run(norm, x, weight, dy, zero_centered):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight) if t is not None]
    y = norm(leaves[0], leaves[1] if weight is not None else None, 1e-6, zero_centered)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return (y, *grads)


@given(
    st.sampled_from([(1, 1), (5, 7), (3, 2, 37), (2, 1, 4, 256), (17, 300), (4, 1025)]),
    st.sampled_from(["none", "weight", "zero_centered"]),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_float64(shape, weight_kind):
    x, weight, dy = inputs(shape, weight_kind, torch.float32)
    zero_centered = weight_kind == "zero_centered"
    got = run(rms_norm_func, x, weight, dy, zero_centered)
    want = run(rms_norm_reference, *(t.double() if t is not None else None for t in (x, weight, dy)), zero_centered)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


@pytest.mark.parametrize("weight_kind", ["none", "weight", "zero_centered"])
def test_low_precision_within_twice_the_pytorch_error(weight_kind):
    """Error against float64 at most 2x that of the same ops in PyTorch at the same precision."""
    shape = (64, 5376) if DEVICE == "cuda" else (6, 1, 2, 48)
    x, weight, dy = inputs(shape, weight_kind, LOW, seed=1)
    zero_centered = weight_kind == "zero_centered"
    exact = run(rms_norm_reference, *(t.double() if t is not None else None for t in (x, weight, dy)), zero_centered)
    ours = run(rms_norm_func, x, weight, dy, zero_centered)
    torch_ops = run(rms_norm_reference, x, weight, dy, zero_centered)
    for name, a, b, e in zip(("y", "dx", "dw"), ours, torch_ops, exact):
        assert a.dtype == LOW, name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-3)


def test_gradients_are_bitwise_reproducible():
    x, weight, dy = inputs((40, 1, 96), "weight", torch.float32, seed=2)
    first, second = (run(rms_norm_func, x, weight, dy, False) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_inputs_say_what_is_wrong():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm_func(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="at most 65536"):
        rms_norm_func(torch.zeros(1, 65537, device=DEVICE), None, 1e-6)


def test_no_rows():
    x = torch.zeros(0, 1, 16, device=DEVICE, requires_grad=True)
    y = rms_norm_func(x, torch.ones(16, device=DEVICE), 1e-6)
    assert y.shape == x.shape
