"""The chunked gated delta rule's state scan (``ops.chunk_state_scan``): its Triton kernels (on the
GPU, or the interpreter on a machine without one) against the PyTorch loop at float64, outputs,
final state and the gradient of every input, within flash-attention's bound (2x the float32 loop's
error); the "triton" backend of ``gated_delta_rule_func`` against the reference recurrence on a
group and a tree; and the shapes the kernels cannot take, refused by name."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_check import DEVICE, assert_within_twice_the_reference_error
from megatron_dualkv.layout import DualKVLayout, TreeLayout
from megatron_dualkv.ops.chunk_state_scan import chunk_state_scan_func, chunk_state_scan_reference
from megatron_dualkv.ops.gated_delta_rule import gated_delta_rule_func, torch_chunk_varlen

NAMES = ("u0", "w", "read_state", "attention", "to_end", "chunk_decay", "state")
EPS = 1e-5


def _scan_inputs(lead, chunks, size, dk, dv, seed, device=DEVICE):
    """float64 inputs scaled as the rule's are: W and E small enough that the state stays bounded
    over the chunks, A lower triangular, the decay in (0, 1]; on the device the kernels run on."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*lead, *shape, generator=gen, dtype=torch.float64) * scale

    inputs = [randn(chunks, size, dv), randn(chunks, size, dk, scale=0.1), randn(chunks, size, dk),
              randn(chunks, size, size).tril(), randn(chunks, size, dk, scale=0.1),
              torch.rand(*lead, chunks, generator=gen, dtype=torch.float64), randn(dk, dv)]
    return [x.to(device) for x in inputs]


def _outputs_and_grads(inputs, d_out, d_final, dtype, **kw):
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    run = chunk_state_scan_func if kw else chunk_state_scan_reference
    out, final = run(*leaves, **kw)
    return (out, final, *torch.autograd.grad((out, final), leaves, (d_out.to(dtype), d_final.to(dtype))))


def _check_triton_scan(lead, chunks, size, dk, dv, seed):
    inputs = _scan_inputs(lead, chunks, size, dk, dv, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(*lead, chunks, size, dv, generator=gen, dtype=torch.float64).to(DEVICE)
    d_final = torch.randn(*lead, dk, dv, generator=gen, dtype=torch.float64).to(DEVICE)
    exact = _outputs_and_grads(inputs, d_out, d_final, torch.float64)
    loop = _outputs_and_grads(inputs, d_out, d_final, torch.float32)
    ours = _outputs_and_grads(inputs, d_out, d_final, torch.float32, backend="triton")
    for name, a, b, e in zip(("out", "final") + tuple("d" + n for n in NAMES), ours, loop, exact):
        assert a.shape == e.shape and a.dtype == torch.float32, name
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, e, EPS)


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), chunks=st.integers(1, 4), dk=st.sampled_from([16, 32]),
       dv=st.sampled_from([16, 24, 40]), seed=st.integers(0, 2**16))
def test_triton_scan_within_the_flash_bound(batch, chunks, dk, dv, seed):
    """Dv 24 and 40: several column blocks, the last partly masked."""
    _check_triton_scan((batch,), chunks, 16, dk, dv, seed)


@pytest.mark.parametrize("lead, size, dv", [((2, 3), 32, 16), ((), 64, 80)],
                         ids=["two-leading-dims-L32", "no-leading-dims-L64"])
def test_triton_scan_takes_any_leading_dims_and_chunk_sizes(lead, size, dv):
    _check_triton_scan(lead, 2, size, 16, dv, seed=5)


def test_the_bound_catches_a_scan_that_misses_one_decay():
    """The check above can fail: the loop with the last chunk's decay left out (d = 1) is caught."""
    inputs = _scan_inputs((2,), 3, 16, 16, 24, seed=1)
    wrong = [x.clone() for x in inputs]
    wrong[5][:, -1] = 1.0
    exact = chunk_state_scan_reference(*inputs)
    loop = chunk_state_scan_reference(*(x.float() for x in inputs))
    with pytest.raises(AssertionError, match="final"):
        assert_within_twice_the_reference_error("final", chunk_state_scan_reference(*wrong)[1].float(), loop[1],
                                                exact[1], EPS)


def test_auto_runs_the_loop_off_cuda():
    """No kernel on a CPU tensor unless asked for: float64 (which the kernels refuse) runs, and it
    is the loop itself."""
    inputs = _scan_inputs((2,), 3, 16, 16, 16, seed=2, device="cpu")
    for a, b in zip(chunk_state_scan_func(*inputs), chunk_state_scan_reference(*inputs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("size, dk, dv, dtype, match", [
    (16, 8, 16, torch.float32, r"Dk a power of two >= 16 \(one block of keys\), got Dk=8"),
    (16, 24, 16, torch.float32, r"Dk a power of two >= 16 \(one block of keys\), got Dk=24"),
    (16, 16, 8, torch.float32, r"Dv >= 16 \(tl.dot's smallest block\), got Dv=8"),
    (8, 16, 16, torch.float32, r"takes chunks of 16, 32, 64, got 8"),
    (16, 16, 16, torch.float64, r"takes float32, got torch.float64"),
])
def test_what_the_kernels_cannot_take_is_named(size, dk, dv, dtype, match):
    """backend="triton" refuses by name; "auto" runs the loop."""
    inputs = [x.to(dtype) for x in _scan_inputs((2,), 3, size, dk, dv, seed=3)]
    with pytest.raises(ValueError, match=match):
        chunk_state_scan_func(*inputs, backend="triton")
    assert chunk_state_scan_func(*inputs)[0].shape == (2, 3, size, dv)


@pytest.mark.parametrize("index, shape, match", [
    (1, (2, 3, 16, 16), r"w must be \(2, 3, 16, 32\) \(u0 is \(2, 3, 16, 16\), Dk=32 from state\), "
                        r"got \(2, 3, 16, 16\)"),
    (3, (2, 3, 16, 8), r"attention must be \(2, 3, 16, 16\)"),
    (4, (2, 3, 16, 8), r"to_end must be \(2, 3, 16, 32\)"),
    (5, (2, 4), r"chunk_decay must be \(2, 3\)"),
    (6, (3, 32, 16), r"state must be \(2, 32, 16\)"),
])
def test_mismatched_shapes_are_refused(index, shape, match):
    inputs = [x.float() for x in _scan_inputs((2,), 3, 16, 32, 16, seed=4, device="cpu")]
    inputs[index] = torch.zeros(shape)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=match):
            chunk_state_scan_func(*inputs, backend=backend)


def test_mixed_dtypes_and_unknown_backends_are_refused():
    inputs = [x.float() for x in _scan_inputs((2,), 3, 16, 16, 16, seed=4, device="cpu")]
    with pytest.raises(ValueError, match="chunk_decay is torch.float64 on cpu, u0 torch.float32 on cpu"):
        chunk_state_scan_func(*inputs[:5], inputs[5].double(), inputs[6])
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_state_scan_func(*inputs, backend="cuda")
    with pytest.raises(ValueError, match="scan must be one of"):
        torch_chunk_varlen(1.0, False, scan="cuda")


def test_the_kernels_off_the_interpreter_need_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = [x.float() for x in _scan_inputs((2,), 3, 16, 16, 16, seed=4, device="cpu")]
    with pytest.raises(ValueError, match="runs on CUDA, or on the CPU under TRITON_INTERPRET=1, not on cpu"):
        chunk_state_scan_func(*inputs, backend="triton")
    layout = DualKVLayout((4,), ((3,),))
    rule = _rule_inputs(layout.total_tokens, seed=0, device="cpu")
    with pytest.raises(ValueError, match="backend 'triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1"):
        gated_delta_rule_func(*rule, layout, backend="triton")


def _rule_inputs(tokens, heads=1, value_heads=2, dk=16, dv=16, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(tokens, value_heads, dv, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(tokens, value_heads, generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(tokens, value_heads, generator=gen, dtype=torch.float64))
    return tuple(x.to(device) for x in (q, k, v, g, beta))


def _rule_outputs_and_grads(inputs, layout, d_out, d_final, dtype, backend):
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    out, finals = gated_delta_rule_func(*leaves, layout, qk_l2norm=True, backend=backend)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (out, finals, *torch.autograd.grad((out, finals), leaves, (d_out.to(dtype), d_final.to(wide))))


@pytest.mark.parametrize("layout", [DualKVLayout((70,), ((9, 66),)), TreeLayout((5, 70, 20, 3), (-1, 0, 1, 0))],
                         ids=["group", "tree"])
def test_the_triton_backend_is_the_recurrence(layout):
    """Chunks of 64: a prompt of two chunks, responses shorter and longer than one, from its state;
    two value heads per key head. float32 against the float64 reference recurrence, within 2x the
    float32 torch backend's error (the same chunked form with the loop)."""
    inputs = _rule_inputs(layout.total_tokens, seed=6)
    gen = torch.Generator().manual_seed(7)
    d_out = torch.randn(layout.total_tokens, 2, 16, generator=gen, dtype=torch.float64).to(DEVICE)
    d_final = torch.randn(len(layout.nodes), 2, 16, 16, generator=gen, dtype=torch.float64).to(DEVICE)
    exact = _rule_outputs_and_grads(inputs, layout, d_out, d_final, torch.float64, "reference")
    loop = _rule_outputs_and_grads(inputs, layout, d_out, d_final, torch.float32, "torch")
    ours = _rule_outputs_and_grads(inputs, layout, d_out, d_final, torch.float32, "triton")
    for name, a, b, e in zip(("out", "finals", "dq", "dk", "dv", "dg", "dbeta"), ours, loop, exact):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, e, EPS)


def test_the_triton_backend_names_a_key_dim_its_scan_cannot_take():
    layout = DualKVLayout((4,), ((3,),))
    inputs = [x.float() for x in _rule_inputs(layout.total_tokens, dk=12)]
    with pytest.raises(ValueError, match="Dk a power of two >= 16 .*, got Dk=12"):
        gated_delta_rule_func(*inputs, layout, backend="triton")
