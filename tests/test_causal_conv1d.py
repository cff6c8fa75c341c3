"""The short causal convolution's reference on the packed layout (``ops.causal_conv1d``): a
segment's window reaches back along its path, so every trajectory gives what it gives alone, and a
shared tail's gradient is the sum over its children; the sum is the written-out one."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv.layout import DualKVLayout, TreeLayout
from megatron_dualkv.ops.causal_conv1d import GatherRows, RowGatherPlan, causal_conv1d_func, causal_conv1d_reference
from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from strategies import layout_lengths, tree_lengths


def _inputs(tokens, channels=3, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, weight, bias)]


def _check_trajectories_alone(layout, width, seed):
    x, weight, bias = _inputs(layout.total_tokens, width=width, seed=seed)
    out = causal_conv1d_reference(x, weight, layout, bias, "silu")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    packed_loss, alone_loss = 0.0, 0.0
    for node in layout.nodes:
        index = [t for start, length in node.ancestors for t in range(start, start + length)]
        offset = len(index)
        index += range(node.start, node.start + node.length)
        alone = causal_conv1d_reference(x[index], weight, DualKVLayout((len(index),), ((),)), bias, "silu")
        own = slice(node.start, node.start + node.length)
        torch.testing.assert_close(out[own], alone[offset:], rtol=1e-12, atol=1e-12)
        if node.subtree_end == node.start + node.length:  # a leaf: its trajectory's loss
            packed_loss = packed_loss + (weights[own] * out[own]).sum()
            alone_loss = alone_loss + (weights[own] * alone[offset:]).sum()
    for got, want in zip(torch.autograd.grad(packed_loss, (x, weight, bias)),
                         torch.autograd.grad(alone_loss, (x, weight, bias))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), width=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_groups_give_each_response_after_its_own_prompt(data, width, seed):
    prompt_lens, response_lens = layout_lengths(data.draw, max_groups=3, max_prompt=7, max_responses=3, max_response=5)
    _check_trajectories_alone(DualKVLayout(prompt_lens, response_lens, pad_len=data.draw(st.integers(0, 3))), width, seed)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), width=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_trees_give_each_trajectory_alone(data, width, seed):
    _check_trajectories_alone(TreeLayout(*tree_lengths(data.draw, max_segments=8, max_len=5)), width, seed)


def test_a_response_sees_the_end_of_its_prompt():
    """Written out: the first token of a response reads the last K-1 tokens of its prompt."""
    layout = DualKVLayout((5,), ((2, 2),))
    x, weight, bias = (t.detach() for t in _inputs(layout.total_tokens, width=3))
    out = causal_conv1d_reference(x, weight, layout, bias)
    for response_start in (5, 7):  # both responses follow the prompt's tokens 3 and 4
        window = torch.stack([x[3], x[4], x[response_start]])
        torch.testing.assert_close(out[response_start], bias + (weight * window.T).sum(1))
    torch.testing.assert_close(out[0], bias + weight[:, 2] * x[0])  # zeros before the root


@pytest.mark.parametrize("args, match", [
    (lambda x, w, b: (x[:-1], w), r"x must be \(tokens, channels\) with the layout's 9 tokens"),
    (lambda x, w, b: (x, w[:2]), r"weight must be \(channels, width\) = \(3, K\), got \(2, 4\)"),
    (lambda x, w, b: (x, w, b[:2]), r"bias must be \(channels,\) = \(3,\), got \(2,\)"),
    (lambda x, w, b: (x, w, b, "gelu"), r"activation must be one of \['silu'\] or None, got 'gelu'"),
])
def test_bad_inputs_name_what_is_wrong(args, match):
    layout = DualKVLayout((5,), ((2, 2),))
    x, weight, bias = (t.detach() for t in _inputs(layout.total_tokens))
    a = args(x, weight, bias)
    with pytest.raises(ValueError, match=match):
        causal_conv1d_reference(a[0], a[1], layout, *a[2:])


@settings(max_examples=25, deadline=None)
@given(data=st.data(), width=st.integers(1, 5), seed=st.integers(0, 2**16), activation=st.sampled_from([None, "silu"]))
def test_the_fast_path_is_the_reference(data, width, seed, activation):
    """``causal_conv1d_func`` (one gather, one conv over every segment after its carried-in rows)
    against the reference's per-segment windows: outputs and every gradient, on fuzzed trees."""
    layout = TreeLayout(*tree_lengths(data.draw, max_segments=8, max_len=5))
    x, weight, bias = _inputs(layout.total_tokens, width=width, seed=seed)
    want = causal_conv1d_reference(x, weight, layout, bias, activation)
    got = causal_conv1d_func(x, weight, layout, bias, activation)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=want.dtype)
    for a, b in zip(torch.autograd.grad(got, (x, weight, bias), dout), torch.autograd.grad(want, (x, weight, bias), dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_gather_sums_a_shared_row_in_a_fixed_order():
    """Row 1 is read three times, row 0 never, -1 reads zeros: the gradient of row 1 is the sum of
    its three readers', added in the order they are read, and a zero row passes nothing back."""
    plan = RowGatherPlan.build(torch.tensor([1, 2, -1, 1, 1]), rows=3)
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    out = GatherRows.apply(x, plan)
    torch.testing.assert_close(out, torch.stack([x[1], x[2], torch.zeros(2, dtype=x.dtype), x[1], x[1]]))
    grad = torch.randn(5, 2, dtype=torch.float64)
    (dx,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(dx, torch.stack([torch.zeros(2, dtype=x.dtype), (grad[0] + grad[3]) + grad[4], grad[1]]),
                               rtol=0, atol=0)


def _group_or_tree(draw):
    if draw(st.booleans()):
        prompt_lens, response_lens = layout_lengths(draw, max_groups=2, max_prompt=6, max_responses=5, max_response=5)
        return DualKVLayout(prompt_lens, response_lens, pad_len=draw(st.integers(0, 3)))
    return TreeLayout(*tree_lengths(draw, max_segments=7, max_len=4), pad_len=draw(st.integers(0, 2)))


def _kernel_and_exact(x, weight, bias, layout, activation, dout):
    """The kernels' output and gradients (on the GPU where there is one, else the interpreter), and the
    float64 reference's, on the same values."""
    layout, dout = layout.to(DEVICE), dout.to(DEVICE)
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, weight, bias) if t is not None]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    with_bias = bias is not None
    got = causal_conv1d_func(inputs[0], inputs[1], layout, inputs[2] if with_bias else None, activation, use_kernel=True)
    want = causal_conv1d_reference(exact[0], exact[1], layout, exact[2] if with_bias else None, activation)
    return ((got, *torch.autograd.grad(got, inputs, dout.to(got.dtype))),
            (want, *torch.autograd.grad(want, exact, dout.double())))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), width=st.integers(1, 5), channels=st.sampled_from([1, 3, 37, 130]), seed=st.integers(0, 2**16),
       activation=st.sampled_from([None, "silu"]), with_bias=st.booleans())
def test_the_kernels_are_the_reference(data, width, channels, seed, activation, with_bias):
    """The Triton kernels (float32, the interpreter) against the float64 reference: the output and the
    gradients of x, the weight and the bias, on fuzzed groups (padding, responses shorter than the
    window, several responses reading one prompt's tail) and trees; channel counts over and under a
    block's 128."""
    layout = _group_or_tree(data.draw)
    x, weight, bias = (t.detach().float() for t in _inputs(layout.total_tokens, channels, width, seed))
    dout = torch.randn(layout.total_tokens, channels, generator=torch.Generator().manual_seed(seed + 1))
    got, want = _kernel_and_exact(x, weight, bias if with_bias else None, layout, activation, dout)
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


def test_a_prompt_tail_read_by_every_response_gets_all_their_gradients():
    """Five responses of 1, 2, 1, 5 and 3 tokens read the prompt's last three rows (width 4), the
    short ones with the previous response's rows nowhere in their windows: the tail's gradient sums
    every reader, the first response's (packed next to it) and the other four's (listed)."""
    layout = DualKVLayout((6,), ((1, 2, 1, 5, 3),)).to(DEVICE)
    x, weight, bias = (t.detach().float() for t in _inputs(layout.total_tokens, 5, 4, seed=3))
    dout = torch.randn(layout.total_tokens, 5, generator=torch.Generator().manual_seed(4))
    got, want = _kernel_and_exact(x, weight, bias, layout, "silu", dout)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-5)
    table = layout.derived(("causal_conv1d_taps", 4, layout.device), lambda: None)
    # the readers packed away from the prompt's rows 3-5 (the first response follows it at once): the
    # later responses' first token for row 3; their first and (where they have one) second for row 4;
    # up to three tokens of each for row 5
    assert (table.far_start[4:7] - table.far_start[3:6]).tolist() == [4, 1 + 2 + 2 + 2, 2 + 1 + 3 + 3]


def test_the_kernels_in_low_precision_stay_within_twice_the_pytorch_error():
    """float16 on the interpreter (bf16 on a GPU): the kernels' output and gradients within 2x the
    gather + conv1d path's error at the same precision, both against float64."""
    layout = DualKVLayout((9, 4), ((3, 1, 6), (2,)), pad_len=2).to(DEVICE)
    x, weight, bias = (t.detach().to(DEVICE) for t in _inputs(layout.total_tokens, 37, 4, seed=5))
    dout = torch.randn(layout.total_tokens, 37, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(DEVICE)
    low = [t.to(LOW).requires_grad_() for t in (x, weight, bias)]
    exact = [t.clone().requires_grad_() for t in (x, weight, bias)]
    results = []
    for use_kernel, tensors in ((True, low), (False, [t.detach().clone().requires_grad_() for t in low]), (False, exact)):
        y = causal_conv1d_func(*tensors[:2], layout, tensors[2], "silu", use_kernel=use_kernel)
        results.append((y, *torch.autograd.grad(y, tensors, dout.to(y.dtype))))
    for name, ours, reference, want in zip(("y", "dx", "dweight", "dbias"), *results):
        assert ours.dtype == LOW
        assert_within_twice_the_reference_error(name, ours, reference, want, 1e-3)


def test_the_kernels_backward_is_bitwise_reproducible():
    layout = TreeLayout((4, 2, 3, 1, 5), (-1, 0, 0, 2, -1)).to(DEVICE)
    x, weight, bias = (t.detach().float().to(DEVICE).requires_grad_() for t in _inputs(layout.total_tokens, 37, 4, seed=7))
    dout = torch.randn(layout.total_tokens, 37, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    runs = [torch.autograd.grad(causal_conv1d_func(x, weight, layout, bias, "silu", use_kernel=True), (x, weight, bias),
                                dout) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_float64_takes_the_exact_path():
    """The kernels accumulate in float32: float64 runs the gather + conv1d path by default (on a GPU
    too: exact to float64 rounding), and asking for the kernels is refused by name."""
    layout = DualKVLayout((5,), ((3, 2),)).to(DEVICE)
    x, weight, bias = (t.detach().to(DEVICE) for t in _inputs(layout.total_tokens, 37, 4, seed=9))
    torch.testing.assert_close(causal_conv1d_func(x, weight, layout, bias, "silu"),
                               causal_conv1d_reference(x, weight, layout, bias, "silu"), rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="the kernels accumulate in float32; float64 runs the gather"):
        causal_conv1d_func(x, weight, layout, bias, "silu", use_kernel=True)


def test_a_weight_on_another_device_is_named():
    layout = DualKVLayout((3,), ((2,),))
    x, weight, bias = _inputs(layout.total_tokens, 2, 4)
    with pytest.raises(ValueError, match=r"x is on cpu, weight on meta, bias on cpu: one device"):
        causal_conv1d_func(x, weight.to("meta"), layout, bias)


def test_the_kernels_refuse_a_width_they_do_not_take():
    layout = DualKVLayout((3,), ((2,),))
    x, weight, _ = _inputs(layout.total_tokens, 2, 9)
    with pytest.raises(ValueError, match="the kernels take widths up to 8, got 9; pass use_kernel=False"):
        causal_conv1d_func(x.float(), weight.float(), layout, use_kernel=True)
