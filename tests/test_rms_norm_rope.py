"""The Triton RMSNorm + RoPE (Qwen3's q and k) against float64 math written out: on CPU in float32
(interpreter), and the flash-attention style bound in low precision (the GPU in bf16 when there is
one), on contiguous heads and on k as a strided view of linear_qkv's output."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.ops.rms_norm_rope import rms_norm_rope_func, rms_norm_rope_reference


def rotated_float64(x, weight, eps, freqs, mscale=1.0):
    """RMSNorm then RoPE written out on float64: y = x / sqrt(mean(x^2) + eps) * w, then
    (y1, y2) -> (y1 cos - y2 sin, y2 cos + y1 sin) over the two halves of the head."""
    x, weight = x.double(), weight.double()
    freqs = freqs.double().reshape(x.size(0), *[1] * (x.dim() - 2), x.size(-1))
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
    half = y.size(-1) // 2
    y1, y2 = y[..., :half], y[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((y1 * c1 - y2 * s1, y2 * c2 + y1 * s2), dim=-1)


def rope_freqs(s, d):
    """[s, 1, 1, d] frequencies of positions 0..s-1 as Megatron's rotary table gives them."""
    half = torch.arange(s, dtype=torch.float32)[:, None] * 10000 ** (-torch.arange(0, d, 2) / d)
    return torch.cat((half, half), dim=-1)[:, None, None, :]


def inputs(shape, dtype, seed=0, device=DEVICE, strided=False):
    """x [s, b, heads, d] (with ``strided``: k's view of a [s, b, heads, 3 d] qkv-like tensor), its
    weight and upstream gradient, and frequencies [s, 1, 1, d]: Megatron's (one half repeated) plus
    noise, so that the halves differ and a kernel that mixes up their angles fails."""
    s, b, heads, d = shape
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(s, b, heads, 3 * d if strided else d, generator=g)
    x = x.to(device, dtype)[..., d: 2 * d] if strided else x.to(device, dtype)
    weight = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
    freqs = rope_freqs(s, d) + 0.5 * torch.randn(s, 1, 1, d, generator=g)
    return x, weight, freqs.to(device), torch.randn(*shape, generator=g).to(device, dtype)


def run(function, x, weight, freqs, dy, mscale=1.0):
    x = x.detach().requires_grad_()  # a leaf view keeps its strides
    weight = weight.detach().clone().requires_grad_()
    y = function(x, weight, 1e-6, freqs, mscale)
    return (y, *torch.autograd.grad(y, (x, weight), dy.to(y.dtype)))


@given(
    st.sampled_from([(1, 1, 1, 2), (7, 1, 4, 16), (5, 3, 2, 10), (33, 1, 1, 128), (3, 2, 5, 6), (4, 1, 3, 130)]),
    st.sampled_from([1.0, 1.25]),
    st.booleans(),
    st.sampled_from([rms_norm_rope_func, rms_norm_rope_reference]),
)
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_float64(shape, mscale, strided, function):
    """The kernel, and the PyTorch ops of the CPU path."""
    x, weight, freqs, dy = inputs(shape, torch.float32, strided=strided)
    got = run(function, x, weight, freqs, dy, mscale)
    want = run(rotated_float64, x.double(), weight.double(), freqs, dy.double(), mscale)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


@pytest.mark.parametrize("strided", [False, True])
def test_low_precision_within_twice_the_pytorch_error(strided):
    """Error against float64 at most 2x that of torch's norm and Megatron's rotation at the same
    precision."""
    shape = (300, 2, 8, 128) if DEVICE == "cuda" else (12, 1, 2, 32)
    x, weight, freqs, dy = inputs(shape, LOW, seed=1, strided=strided)
    exact = run(rotated_float64, x.double(), weight.double(), freqs, dy.double())
    ours, torch_ops = run(rms_norm_rope_func, x, weight, freqs, dy), run(rms_norm_rope_reference, x, weight, freqs, dy)
    for name, a, b, e in zip(("y", "dx", "dw"), ours, torch_ops, exact):
        assert a.dtype == LOW, name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-3)


def test_a_strided_view_gives_the_bits_of_its_copy():
    x, weight, freqs, dy = inputs((6, 2, 3, 16), torch.float32, seed=2, strided=True)
    assert not x.is_contiguous()
    for a, b in zip(run(rms_norm_rope_func, x, weight, freqs, dy), run(rms_norm_rope_func, x.contiguous(), weight, freqs, dy)):
        assert torch.equal(a, b)


def test_gradients_are_bitwise_reproducible():
    x, weight, freqs, dy = inputs((40, 1, 3, 32), torch.float32, seed=3)
    first, second = (run(rms_norm_rope_func, x, weight, freqs, dy) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_the_weight_may_be_float32_beside_low_precision_heads():
    """As the local spec builds Qwen3's q/k norms: float32 weights, bf16 activations."""
    x, weight, freqs, dy = inputs((9, 1, 2, 16), LOW, seed=4)
    y, dx, dw = run(rms_norm_rope_func, x, weight.float(), freqs, dy)
    assert y.dtype == dx.dtype == LOW and dw.dtype == torch.float32
    exact = run(rotated_float64, x.double(), weight.double(), freqs, dy.double())
    torch.testing.assert_close(dw.double(), exact[2], rtol=2e-2, atol=2e-2 * exact[2].abs().max().item())


def test_bad_inputs_say_what_is_wrong():
    x, weight, freqs, _ = inputs((4, 1, 2, 8), torch.float32)
    with pytest.raises(ValueError, match="an even d"):
        rms_norm_rope_func(torch.zeros(4, 1, 2, 7, device=DEVICE), torch.ones(7, device=DEVICE), 1e-6, freqs[..., :7])
    with pytest.raises(ValueError, match="an even d <= 1024"):
        rms_norm_rope_func(torch.zeros(1, 1026, device=DEVICE), torch.ones(1026, device=DEVICE), 1e-6,
                           torch.zeros(1, 1026, device=DEVICE))
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm_rope_func(x, weight[:4], 1e-6, freqs)
    with pytest.raises(ValueError, match=r"one row of 8 angles per token, \[4, 8\]"):
        rms_norm_rope_func(x, weight, 1e-6, freqs[:3])
    with pytest.raises(ValueError, match=r"one row of 8 angles per token"):
        rms_norm_rope_func(x, weight, 1e-6, freqs.expand(4, 1, 2, 8))
    with pytest.raises(ValueError, match="take no gradient"):
        rms_norm_rope_func(x, weight, 1e-6, freqs.clone().requires_grad_())


def test_no_tokens():
    x, weight, freqs, _ = inputs((4, 1, 2, 8), torch.float32)
    y = rms_norm_rope_func(x[:0].requires_grad_(), weight, 1e-6, freqs[:0])
    assert y.shape == (0, 1, 2, 8)
