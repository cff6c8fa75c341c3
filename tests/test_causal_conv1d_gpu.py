"""The short causal convolution's Triton kernels on a GPU, in bf16 at their own blocks: the output and
every gradient within 2x the error of the gather + conv1d path at the same precision (both against
the float64 reference), on a 16-response group of Qwen3.5-like widths and on fuzzed small groups and
trees; bitwise reproducible gradients; and offsets past 2^31 elements."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv.layout import DualKVLayout, TreeLayout
from megatron_dualkv.ops.causal_conv1d import causal_conv1d_func, causal_conv1d_reference
from strategies import layout_lengths, tree_lengths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# 16 responses after a prompt, a few shorter than the window (their successors read the prompt's tail
# past them): 4,038 tokens
GROUP = DualKVLayout((1024,), ((190, 1, 300, 2, 177, 250, 64, 199, 3, 256, 210, 123, 301, 190, 222, 333),))


def _inputs(tokens, channels, width, with_bias, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, dy = (torch.randn(tokens, channels, device="cuda", generator=gen) for _ in range(2))
    weight = torch.randn(channels, width, device="cuda", generator=gen) / width ** 0.5
    bias = torch.randn(channels, device="cuda", generator=gen) if with_bias else None
    return tuple(None if t is None else t.to(dtype) for t in (x, weight, bias, dy))


def _output_and_grads(x, weight, bias, dy, layout, activation, use_kernel, reference=False):
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    run = causal_conv1d_reference if reference else lambda *a: causal_conv1d_func(*a, use_kernel=use_kernel)
    y = run(leaves[0], leaves[1], layout.to("cuda"), leaves[2] if bias is not None else None, activation)
    return (y, *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


def _check_bf16(layout, channels, width, with_bias, activation, seed, eps):
    inputs = _inputs(layout.total_tokens, channels, width, with_bias, seed)
    ours = _output_and_grads(*inputs, layout, activation, use_kernel=True)
    torch_path = _output_and_grads(*inputs, layout, activation, use_kernel=False)
    exact = _output_and_grads(*(None if t is None else t.double() for t in inputs), layout, activation, None,
                              reference=True)
    for name, a, b, e in zip(("y", "dx", "dweight", "dbias"), ours, torch_path, exact):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, e, eps)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_a_group_within_twice_the_pytorch_error(with_bias):
    """Qwen3.5's conv (K = 4, SiLU, no bias) at 1,024 channels; and with a bias."""
    _check_bf16(GROUP, 1024, 4, with_bias, "silu", seed=0, eps=1e-3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tree=st.booleans(), width=st.integers(1, 5), channels=st.sampled_from([3, 37, 200]),
       with_bias=st.booleans(), activation=st.sampled_from([None, "silu"]), seed=st.integers(0, 2**16))
def test_fuzzed_layouts_within_twice_the_pytorch_error(data, tree, width, channels, with_bias, activation, seed):
    """Groups (responses shorter than the window, padding) and trees (one-token segments, children
    packed apart from their parent). eps: half a bf16 rounding of the largest value, which the kernels
    may round the other way where the PyTorch path happens to be exact."""
    if tree:
        layout = TreeLayout(*tree_lengths(data.draw, max_segments=10, max_len=40), pad_len=data.draw(st.integers(0, 7)))
    else:
        lens = layout_lengths(data.draw, max_groups=3, max_prompt=60, max_responses=6, max_response=40)
        layout = DualKVLayout(*lens, pad_len=data.draw(st.integers(0, 7)))
    _check_bf16(layout, channels, width, with_bias, activation, seed, eps=1e-2)


def test_the_gradients_are_bitwise_reproducible():
    inputs = _inputs(GROUP.total_tokens, 1024, 4, True, seed=1)
    first, second = (_output_and_grads(*inputs, GROUP, "silu", use_kernel=True) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_offsets_past_two_to_the_31_elements():
    """A group whose last rows lie past 2^31 elements of (T, 8192) gives, bitwise, what it gives alone
    (the kernels' per-row sums do not depend on where the rows are packed; dweight's partials do)."""
    channels, alone = 8192, DualKVLayout((1000,), ((30_000, 40_000),))
    packed = DualKVLayout((200_000, 1000), ((), (30_000, 40_000)))
    assert packed.total_tokens * channels > 2**31
    x, weight, _, dy = _inputs(packed.total_tokens, channels, 4, False, seed=2)
    y, dx, _ = _output_and_grads(x, weight, None, dy, packed, "silu", use_kernel=True)
    rows = slice(200_000, None)
    y_alone, dx_alone, _ = _output_and_grads(x[rows], weight, None, dy[rows], alone, "silu", use_kernel=True)
    assert torch.equal(y[rows], y_alone) and torch.equal(dx[rows], dx_alone)
