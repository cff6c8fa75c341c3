"""The gated delta rule's reference on the packed layout (``ops.gated_delta_rule``): each segment
continues from its parent's final state, so every trajectory gives what it gives alone, and a
shared prefix's gradient is the sum over the trajectories that read it; the update is the
published equation written as a matrix product. The chunked PyTorch rule (``torch_chunk_varlen``),
run level by level, is that recurrence in float64, gradients included; the backend choice takes
fla only where it runs."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv.layout import DualKVLayout, TreeLayout
from megatron_dualkv.ops import gated_delta_rule as gdr
from megatron_dualkv.ops.gated_delta_rule import (
    _check_kernel_inputs,
    fla_installed,
    fla_usable,
    gated_delta_rule_func,
    gated_delta_rule_reference,
    run_by_level,
    torch_chunk_varlen,
)
from strategies import layout_lengths, tree_lengths


def _inputs(tokens, heads=2, dk=3, dv=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dk, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(tokens, heads, dk, generator=gen, dtype=dtype), dim=-1)  # as the models' L2 norm
    v = torch.randn(tokens, heads, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(tokens, heads, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(tokens, heads, generator=gen, dtype=dtype))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _path(layout, i):
    """The packed indices of the trajectory from the root to segment i, and where segment i starts in it."""
    node = layout.nodes[i]
    index = [t for start, length in node.ancestors for t in range(start, start + length)]
    return index + list(range(node.start, node.start + node.length)), len(index)


def _leaves(layout):
    return [i for i, n in enumerate(layout.nodes) if n.subtree_end == n.start + n.length]


def _check_trajectories_alone(layout, seed):
    inputs = _inputs(layout.total_tokens, seed=seed)
    out, finals = gated_delta_rule_reference(*inputs, layout)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    packed_loss, alone_loss = 0.0, 0.0
    for i, node in enumerate(layout.nodes):
        index, offset = _path(layout, i)
        alone, alone_final = gated_delta_rule_reference(*(t[index] for t in inputs), DualKVLayout((len(index),), ((),)))
        own = slice(node.start, node.start + node.length)
        torch.testing.assert_close(out[own], alone[offset:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(finals[i], alone_final[0], rtol=1e-12, atol=1e-12)
        if i in _leaves(layout):
            packed_loss = packed_loss + (weights[own] * out[own]).sum()
            alone_loss = alone_loss + (weights[own] * alone[offset:]).sum()
    # each leaf's loss reads its ancestors' tokens once per trajectory: their gradients add up
    for got, want in zip(torch.autograd.grad(packed_loss, inputs), torch.autograd.grad(alone_loss, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_groups_give_each_response_after_its_own_prompt(data, seed):
    prompt_lens, response_lens = layout_lengths(data.draw, max_groups=3, max_prompt=7, max_responses=3, max_response=5)
    pad = data.draw(st.integers(0, 3))
    _check_trajectories_alone(DualKVLayout(prompt_lens, response_lens, pad_len=pad), seed)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_trees_give_each_trajectory_alone(data, seed):
    _check_trajectories_alone(TreeLayout(*tree_lengths(data.draw, max_segments=8, max_len=5)), seed)


def test_the_update_is_the_published_equation():
    """h_t = alpha_t (I - beta_t k_t k_t^T) h_{t-1} + beta_t k_t v_t^T, o_t = h_t^T q_t scale, as
    matrices, from an initial state; one head, a segment of three tokens."""
    q, k, v, g, beta = (t.detach() for t in _inputs(3, heads=1, dk=2, dv=3, seed=5))
    h = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out, final = gated_delta_rule_reference(q, k, v, g, beta, DualKVLayout((3,), ((),)), scale=0.5, initial_state=h)
    state, eye = h[0], torch.eye(2, dtype=torch.float64)
    for t in range(3):
        kt, alpha, b = k[t, 0][:, None], torch.exp(g[t, 0]), beta[t, 0]
        state = alpha * (eye - b * kt @ kt.T) @ state + b * kt @ v[t, 0][None, :]
        torch.testing.assert_close(out[t, 0], state.T @ (0.5 * q[t, 0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final[0, 0], state, rtol=1e-12, atol=1e-12)


def test_roots_start_from_the_initial_state_and_children_from_their_parent():
    layout = DualKVLayout((2, 3), ((1, 2), ()))
    inputs = [t.detach() for t in _inputs(layout.total_tokens, seed=7)]
    h0 = torch.randn(2, 3, 4, dtype=torch.float64)
    out, finals = gated_delta_rule_reference(*inputs, layout, initial_state=h0)
    second_root = slice(5, 8)  # the second group's prompt, after the first's (2 tokens) and its responses (1, 2)
    alone, _ = gated_delta_rule_reference(*(t[second_root] for t in inputs), DualKVLayout((3,), ((),)), initial_state=h0)
    torch.testing.assert_close(out[second_root], alone)
    zero, _ = gated_delta_rule_reference(*(t[second_root] for t in inputs), DualKVLayout((3,), ((),)))
    assert not torch.allclose(alone, zero)


@pytest.mark.parametrize("change, match", [
    (lambda i, layout: (i[0][:-1], *i[1:]), "q has 9 tokens, the layout 10"),
    (lambda i, layout: (i[0], i[1][:, :1], *i[2:]), "k has 1 heads, q 2"),
    (lambda i, layout: (*i[:3], i[3].float(), i[4]), "g is torch.float32 on cpu, q torch.float64 on cpu"),
    (lambda i, layout: (*i[:4], i[4][:, :, None]), r"beta must be a 2-d \(tokens, heads\) tensor"),
    (lambda i, layout: (i[0], i[1][:, :, :2], *i[2:]), r"k's shape \(10, 2, 2\) differs from q's \(10, 2, 3\)"),
])
def test_bad_inputs_name_what_is_wrong(change, match):
    layout = DualKVLayout((4,), ((3, 3),))
    inputs = [t.detach() for t in _inputs(layout.total_tokens)]
    with pytest.raises(ValueError, match=match):
        gated_delta_rule_reference(*change(inputs, layout), layout)


def test_a_bad_initial_state_or_scale_is_refused():
    layout = DualKVLayout((4,), ((3,),))
    inputs = [t.detach() for t in _inputs(layout.total_tokens)]
    with pytest.raises(ValueError, match=r"initial_state must be \(heads, Dk, Dv\) = \(2, 3, 4\), got \(2, 4, 3\)"):
        gated_delta_rule_reference(*inputs, layout, initial_state=torch.zeros(2, 4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must be positive"):
        gated_delta_rule_reference(*inputs, layout, scale=0.0)
    with pytest.raises(TypeError, match="layout must be a DualKVLayout or a TreeLayout"):
        gated_delta_rule_reference(*inputs, None)


def _reference_varlen(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial):
    """A stand-in for fla's varlen kernel with the same contract: each sequence from its own initial state."""
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist())):
        seq = DualKVLayout((end - start,), ((),))
        out, final = gated_delta_rule_reference(q[start:end], k[start:end], v[start:end], g[start:end],
                                                beta[start:end], seq, initial_state=None if initial is None else initial[i])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs), torch.cat(finals)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), with_initial=st.booleans(), groups=st.booleans())
def test_the_level_schedule_is_the_segment_recurrence(data, seed, with_initial, groups):
    """What the fla path runs, one varlen call per tree depth with the parents' final states as the
    initial ones, equals the segment-by-segment recurrence: outputs, final states, every gradient."""
    if groups:
        prompt_lens, response_lens = layout_lengths(data.draw, max_groups=3, max_prompt=7, max_responses=3,
                                                    max_response=5)
        layout = DualKVLayout(prompt_lens, response_lens, pad_len=data.draw(st.integers(0, 3)))
    else:
        layout = TreeLayout(*tree_lengths(data.draw, max_segments=8, max_len=5))
    inputs = _inputs(layout.total_tokens, seed=seed)
    h0 = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) if with_initial else None
    want = gated_delta_rule_reference(*inputs, layout, initial_state=h0)
    got = run_by_level(_reference_varlen, *inputs, layout, initial_state=h0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    leaves = inputs + ([h0] if with_initial else [])
    gen = torch.Generator().manual_seed(seed + 1)
    douts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in want]
    for a, b in zip(torch.autograd.grad(got, leaves, douts), torch.autograd.grad(want, leaves, douts)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_value_heads_share_their_key_head_and_qk_are_l2_normalised():
    """Grouped values (HV = 2 H): value head j reads key head j // 2, after q and k are normalised,
    as the reference on explicitly repeated, normalised heads."""
    layout = DualKVLayout((4,), ((3, 2),))
    q, k, _, _, _ = (t.detach() for t in _inputs(layout.total_tokens, heads=2))
    _, _, v, g, beta = (t.detach() for t in _inputs(layout.total_tokens, heads=4, seed=1))
    out, finals = gated_delta_rule_func(q, k, v, g, beta, layout, qk_l2norm=True)
    norm = lambda x: (x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, dim=1)  # noqa: E731
    want, want_finals = gated_delta_rule_reference(norm(q), norm(k), v, g, beta, layout)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(finals, want_finals, rtol=1e-12, atol=1e-12)


def test_what_the_kernel_cannot_take_is_named():
    layout = DualKVLayout((4,), ((3,),))
    q, k, v, g, beta = (t.detach() for t in _inputs(layout.total_tokens))
    with pytest.raises(ValueError, match="v's 3 heads must be a multiple of q's 2"):
        gated_delta_rule_func(q, k, torch.cat([v, v[:, :1]], 1), g, beta, layout)
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_delta_rule_func(q, k, v, g, beta, layout, backend="cuda")
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v)]
    with pytest.raises(ValueError, match="float64 runs on the torch and reference backends"):
        _check_kernel_inputs(q, k, v, g, beta, layout, None, None)
    with pytest.raises(ValueError, match="g .* must be float32"):
        _check_kernel_inputs(*bf16, g, beta, layout, None, None)
    with pytest.raises(ValueError, match="keeps states in float32; initial_state is torch.bfloat16"):
        _check_kernel_inputs(*bf16, g.float(), beta.float(), layout, None, torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="runs on CUDA"):
        _check_kernel_inputs(*bf16, g.float(), beta.float(), layout, None, None)


def _layout(draw, groups):
    if groups:
        prompt_lens, response_lens = layout_lengths(draw, max_groups=3, max_prompt=9, max_responses=3, max_response=6)
        return DualKVLayout(prompt_lens, response_lens, pad_len=draw(st.integers(0, 3)))
    return TreeLayout(*tree_lengths(draw, max_segments=6, max_len=9))


@settings(max_examples=20, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), with_initial=st.booleans(), groups=st.booleans(),
       qk_l2norm=st.booleans())
def test_the_chunked_rule_is_the_recurrence(data, seed, with_initial, groups, qk_l2norm):
    """``torch_chunk_varlen`` (chunks of 4, so segments shorter than, equal to and several chunks
    long, padded to whole chunks) run by level equals the reference recurrence in float64 on grouped
    values (HV = 2 H): outputs, final states, every gradient."""
    layout = _layout(data.draw, groups)
    q, k, _, _, _ = _inputs(layout.total_tokens, heads=2, seed=seed)
    _, _, v, g, beta = _inputs(layout.total_tokens, heads=4, seed=seed + 1)
    h0 = torch.randn(4, 3, 4, dtype=torch.float64, requires_grad=True) if with_initial else None
    got = run_by_level(torch_chunk_varlen(0.6, qk_l2norm, chunk_size=4), q, k, v, g, beta, layout, initial_state=h0)
    norm = (lambda x: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)) if qk_l2norm else (lambda x: x)
    want = gated_delta_rule_reference(norm(q).repeat_interleave(2, 1), norm(k).repeat_interleave(2, 1), v, g, beta,
                                      layout, scale=0.6, initial_state=h0)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    leaves = [q, k, v, g, beta] + ([h0] if with_initial else [])
    gen = torch.Generator().manual_seed(seed + 2)
    douts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in want]
    for a, b in zip(torch.autograd.grad(got, leaves, douts), torch.autograd.grad(want, leaves, douts)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_torch_backend_keeps_v_dtype_and_float32_states():
    """bf16 q, k, v with float32 decay, beta and state (the layers' dtypes): the output in bf16 and
    the final states in float32, within bf16 roundings of the float64 recurrence."""
    layout = DualKVLayout((70,), ((9, 66),))
    q, k, v, g, beta = (t.detach() for t in _inputs(layout.total_tokens, heads=2, dk=8, dv=8, seed=3))
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    out, finals = gated_delta_rule_func(*low, g.float(), beta.float(), layout, backend="torch")
    assert out.dtype == torch.bfloat16 and finals.dtype == torch.float32
    want, want_finals = gated_delta_rule_reference(*(t.double() for t in low), g, beta, layout)
    torch.testing.assert_close(out.double(), want, rtol=0.02, atol=0.02)
    torch.testing.assert_close(finals.double(), want_finals, rtol=1e-4, atol=1e-4)


def test_the_torch_backend_matches_the_reference_backend():
    layout = TreeLayout((5, 70, 3, 66), (-1, 0, 0, -1))
    q, k, _, _, _ = (t.detach() for t in _inputs(layout.total_tokens, heads=1, seed=4))
    _, _, v, g, beta = (t.detach() for t in _inputs(layout.total_tokens, heads=2, seed=5))
    h0 = torch.randn(2, 3, 4, dtype=torch.float64)
    got = gated_delta_rule_func(q, k, v, g, beta, layout, initial_state=h0, qk_l2norm=True, backend="torch")
    want = gated_delta_rule_func(q, k, v, g, beta, layout, initial_state=h0, qk_l2norm=True, backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_what_the_torch_backend_cannot_take_is_named():
    layout = DualKVLayout((4,), ((3,),))
    q, k, v, g, beta = (t.detach() for t in _inputs(layout.total_tokens))
    with pytest.raises(ValueError, match="g .* must be float32 or float64, got torch.bfloat16"):
        gated_delta_rule_func(q, k, v, g.bfloat16(), beta, layout, backend="torch")
    with pytest.raises(ValueError, match="keeps states in float32 or float64; initial_state is torch.float16"):
        gated_delta_rule_func(q, k, v, g, beta, layout, initial_state=torch.zeros(2, 3, 4, dtype=torch.float16),
                              backend="torch")
    with pytest.raises(ValueError, match=r"initial_state must be \(value heads, Dk, Dv\) = \(2, 3, 4\)"):
        gated_delta_rule_func(q, k, v, g, beta, layout, initial_state=torch.zeros(2, 4, 3, dtype=torch.float64),
                              backend="torch")


@pytest.mark.parametrize("capability, triton, tilelang, usable", [
    ((9, 0), "3.6.0", False, False),  # torch 2.11's Triton on Hopper: fla's backward raises
    ((9, 0), "3.4.0", False, False),
    ((9, 0), "3.7.0", False, False),
    ((9, 0), "3.7.1", False, True),
    ((9, 0), "3.3.1", False, True),
    ((9, 0), "3.6.0", True, True),  # tilelang takes over the miscompiled kernels
    ((8, 0), "3.6.0", False, True),
    ((10, 0), "3.6.0", False, True),
])
def test_fla_is_usable_except_on_hopper_with_a_miscompiling_triton(capability, triton, tilelang, usable):
    assert fla_usable(capability, triton, tilelang) is usable


@pytest.mark.skipif(fla_installed(), reason="checks the message without fla")
def test_the_fla_backend_without_fla_says_what_to_install():
    layout = DualKVLayout((4,), ((3,),))
    inputs = [t.detach() for t in _inputs(layout.total_tokens)]
    with pytest.raises(ValueError, match=r"needs fla-core \(pip install 'megatron-dualkv\[hybrid\]'\)"):
        gated_delta_rule_func(*inputs, layout, backend="fla")


def _on_cuda(dtype):
    """What the backend choice reads of q, as on a GPU (there is none here)."""
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0))


@pytest.mark.parametrize("environment, dtype, want", [
    (((9, 0), "3.6.0", False), torch.bfloat16, "torch"),
    (((9, 0), "3.7.1", False), torch.bfloat16, "fla"),
    (((8, 0), "3.6.0", False), torch.bfloat16, "fla"),
    (((8, 0), "3.6.0", False), torch.float64, "torch"),  # a dtype fla does not take
])
def test_auto_takes_fla_on_cuda_only_where_it_is_usable_else_torch(monkeypatch, environment, dtype, want):
    monkeypatch.setattr(gdr, "fla_installed", lambda: True)
    monkeypatch.setattr(gdr, "_fla_environment", lambda device: environment)
    assert gdr._backend(_on_cuda(dtype), "auto") == want
    assert gdr._backend(torch.empty(0, dtype=dtype), "auto") == "torch"  # the CPU


def test_fla_where_it_miscompiles_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gdr, "fla_installed", lambda: True)
    monkeypatch.setattr(gdr, "_fla_environment", lambda device: ((9, 0), "3.6.0", False))
    with pytest.raises(ValueError, match=r"refuses compute capability \(9, 0\) \(Hopper\) with Triton 3.6.0, .* "
                                         r"install Triton >= 3.7.1 or tilelang, or use backend='torch'"):
        gdr._backend(_on_cuda(torch.bfloat16), "fla")


def test_the_environment_overrides_what_auto_picks(monkeypatch):
    monkeypatch.setattr(gdr, "fla_installed", lambda: True)
    monkeypatch.setattr(gdr, "_fla_environment", lambda device: ((9, 0), "3.7.1", False))
    monkeypatch.setenv("DUALKV_GDN_BACKEND", "torch")
    assert gdr._backend(_on_cuda(torch.bfloat16), "auto") == "torch"
    assert gdr._backend(_on_cuda(torch.bfloat16), "fla") == "fla"  # an explicit choice stands
    monkeypatch.setenv("DUALKV_GDN_BACKEND", "flash")
    with pytest.raises(ValueError, match="DUALKV_GDN_BACKEND must be one of .* got 'flash'"):
        gdr._backend(_on_cuda(torch.bfloat16), "auto")


def test_the_torch_backend_keeps_only_its_inputs():
    """Under grad, the chunked PyTorch rule keeps what fla's kernel keeps, its inputs (so the memory
    model's count of a GDN layer holds for both backends); its chunk intermediates, several times
    larger, are recomputed in the backward, which still gives the reference's gradients."""
    layout = DualKVLayout((40,), ((33, 17, 25),))
    inputs = _inputs(layout.total_tokens, heads=2, dk=8, dv=8, seed=3)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got, _ = run_by_level(torch_chunk_varlen(8**-0.5, False, chunk_size=8), *inputs, layout)
    input_bytes = sum(t.untyped_storage().nbytes() for t in inputs)
    # the inputs, the levels' final states and index tensors: not the (chunks, C, C) matrices
    assert sum(saved.values()) < 1.5 * input_bytes, (sum(saved.values()), input_bytes)
    want, _ = gated_delta_rule_reference(*inputs, layout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(want, inputs, dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
