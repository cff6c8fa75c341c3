"""The output gate x * sigmoid(gate) against PyTorch ops: float64 on CPU (Triton interpreter), the
flash-attention style bound in low precision (bf16 on the GPU when there is one), and what it keeps
for the backward: x and the gate on every path, where Megatron's gate, once Dynamo gives up on it,
keeps the float32 sigmoid."""
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.transformer.attention import Attention

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.ops.output_gate import output_gate_func, output_gate_reference


def inputs(shape, dtype, seed=0):
    """x (..., H) and the gate as Megatron's heads (..., H / 2, 2), non-contiguous: a slice of a
    wider tensor, as the gate is of linear_qkv's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    wide = (3 * torch.randn(*shape[:-1], 3 * shape[-1], generator=g)).to(DEVICE, dtype)
    gate = wide[..., : shape[-1]].unflatten(-1, (shape[-1] // 2, 2))
    dy = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    return x, gate, dy


def run(gate_fn, x, gate, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate)]
    y = gate_fn(*leaves)
    return (y, *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


def gate_with(use_triton):
    return lambda x, gate: output_gate_func(x, gate, use_triton=use_triton)


def megatrons_gate():
    """Megatron's ``Attention._apply_output_gate`` as written, without its ``torch.compile``."""
    fn = getattr(Attention._apply_output_gate, "__wrapped__", None)
    if fn is None:
        pytest.skip("this megatron-core's output gate is not a wrapped compiled function")
    return fn


@given(st.sampled_from([(1, 2), (5, 14), (3, 2, 74), (2, 1, 2050), (17, 1, 600)]), st.booleans())
@settings(max_examples=8, deadline=None)
def test_matches_float64(shape, use_triton):
    """Both paths; sizes shorter than, and not a multiple of, a program's block."""
    x, gate, dy = inputs(shape, torch.float32)
    got = run(gate_with(use_triton), x, gate, dy)
    want = run(output_gate_reference, x.double(), gate.double(), dy.double())
    for name, a, b in zip(("y", "dx", "dgate"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6 * (1 + b.abs().max().item()), msg=name)


def test_low_precision_within_twice_the_pytorch_error():
    """Error against float64 at most 2x that of the same ops in PyTorch at the same precision."""
    shape = (512, 1, 4096) if DEVICE == "cuda" else (6, 1, 96)
    x, gate, dy = inputs(shape, LOW, seed=1)
    exact = run(output_gate_reference, x.double(), gate.double(), dy.double())
    ours = run(gate_with(True), x, gate, dy)
    torch_ops = run(output_gate_reference, x, gate, dy)
    for name, a, b, e in zip(("y", "dx", "dgate"), ours, torch_ops, exact):
        assert a.dtype == LOW, name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-3)


@pytest.mark.parametrize("use_triton", [False, True])
def test_megatrons_gate_forward_bitwise_and_gradients_to_rounding(use_triton):
    """The same float32 math as Megatron's function, rounded once: the forward bit for bit on the
    PyTorch path; the gradients, whose float32 products autograd orders differently, to one
    rounding of the inputs' dtype."""
    x, gate, dy = inputs((7, 1, 64), LOW, seed=2)
    megatron = run(partial(megatrons_gate(), None), x, gate, dy)
    ours = run(gate_with(use_triton), x, gate, dy)
    if not use_triton:
        assert torch.equal(ours[0], megatron[0])
    for name, a, b in zip(("y", "dx", "dgate"), ours, megatron):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6, msg=name)


def saved_for_backward(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        fn(*args)
    return saved


@pytest.mark.parametrize("use_triton", [False, True])
def test_keeps_x_and_the_gate_only(use_triton):
    x, gate, _ = inputs((5, 1, 32), LOW)
    x.requires_grad_(), gate.requires_grad_()
    saved = saved_for_backward(gate_with(use_triton), x, gate)
    assert saved == [((5, 1, 32), LOW), ((5, 1, 32), LOW)]


def test_megatrons_compiled_gate_keeps_the_float32_sigmoid_once_dynamo_gives_up():
    """Why the op exists: past Dynamo's recompile limit Megatron's gate runs eagerly and keeps the
    float32 sigmoid (twice as large as the gate it replaces), so a memory count built on the
    compiled graph would not hold; the op keeps the same tensors either way."""
    compiled = torch.compile(megatrons_gate(), dynamic=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for tokens in (3, 4):  # the second shape is past the limit of one graph
            x, gate, _ = inputs((tokens, 1, 32), torch.bfloat16)
            x.requires_grad_(), gate.requires_grad_()
            megatron = saved_for_backward(partial(compiled, None), x, gate)
    torch._dynamo.reset()
    assert ((4, 1, 32), torch.float32) in megatron
    assert saved_for_backward(output_gate_func, x, gate) == [((4, 1, 32), torch.bfloat16)] * 2


def test_bad_input_names_the_problem():
    x = torch.zeros(4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="the gate has 6 elements, x 32"):
        output_gate_func(x, torch.zeros(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="the gate is torch.float64"):
        output_gate_func(x, torch.zeros(4, 1, 8, device=DEVICE, dtype=torch.float64))


def test_no_tokens():
    x = torch.zeros(0, 1, 16, device=DEVICE, requires_grad=True)
    assert output_gate_func(x, torch.zeros(0, 1, 4, 4, device=DEVICE)).shape == (0, 1, 16)
