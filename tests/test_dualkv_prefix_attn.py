"""dualkv_prefix_attn_func: responses against a prompt K/V operand held apart, against the float64
dense-mask reference on the concatenated layout ([P][R1]..[RN] per group, ``dualkv_attn_func``):
the reference backend exactly, the Triton kernels on CPU (interpreter, tiny shapes) within the flash
bound (2x the same-precision PyTorch error, plus a small epsilon)."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, PrefixedLayout, TreeLayout, dualkv_prefix_attn_func
from megatron_dualkv.ops.reference import dualkv_attention_reference
from flash_check import assert_within_twice_the_reference_error
from strategies import rollout_groups, tree_lengths


def concatenated_and_prefixed(prompt_lens, response_lens, pad_len, hq, hkv, d, dtype, backend, seed=0,
                              device="cpu", **kw):
    """Groups: (reference on the whole layout restricted to the response rows, the prefix op on
    ``device``): out, dq, dk, dv of the response rows and d(prefix k), d(prefix v); the
    reference's in float64, the op's on the CPU."""
    whole = DualKVLayout(prompt_lens, response_lens, pad_len)
    prompt_rows, response_rows = [], []
    for start, length, _, prefix in whole.segments[: len(whole.segments) - (pad_len > 0)]:
        (response_rows if prefix else prompt_rows).append(torch.arange(start, start + length))
    rows = torch.cat(response_rows + [torch.arange(whole.total_tokens - pad_len, whole.total_tokens)])
    prefixed = PrefixedLayout(prompt_lens, response_lens, pad_len)
    return held_apart(whole, prefixed, torch.cat(prompt_rows), rows, hq, hkv, d, dtype, backend, seed, device, **kw)


def tree_and_prefixed(prefix_len, segment_lens, segment_parents, pad_len, hq, hkv, d, dtype, backend, seed=0,
                      device="cpu", **kw):
    """A prefix tree whose root (its shared path, ``prefix_len`` tokens) is held: the same
    comparison with the rest of the tree, ``segment_parents`` -1 for a segment under the root."""
    whole = TreeLayout((prefix_len, *segment_lens), (-1, *(p + 1 if p >= 0 else 0 for p in segment_parents)), pad_len)
    prefixed = PrefixedLayout((prefix_len,), (segment_lens,), pad_len, segment_parents=(segment_parents,))
    rows = torch.arange(prefix_len, whole.total_tokens)
    return held_apart(whole, prefixed, torch.arange(prefix_len), rows, hq, hkv, d, dtype, backend, seed, device, **kw)


def held_apart(whole, prefixed, prompt, rows, hq, hkv, d, dtype, backend, seed, device, **kw):
    g = torch.Generator().manual_seed(seed)
    T = whole.total_tokens
    q, k, v = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, generator=g, dtype=torch.float64)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    # only the micro-batch's rows carry an output gradient: the prompt rows' own attention is not this op's
    mask = torch.zeros_like(dout)
    mask[rows] = 1.0
    out = dualkv_attention_reference(*x, whole, **kw)
    dq, dk, dv = torch.autograd.grad(out, x, dout * mask)
    want = (out[rows], dq[rows], dk[rows], dv[rows], dk[prompt], dv[prompt])

    prefixed = prefixed.to(device)
    y = ([t[rows].to(device, dtype).requires_grad_() for t in (q, k, v)]
         + [t[prompt].to(device, dtype).requires_grad_() for t in (k, v)])
    out = dualkv_prefix_attn_func(*y, prefixed, backend=backend, **kw)
    got = (out, *torch.autograd.grad(out, y, dout[rows].to(device, dtype)))
    return tuple(t.cpu() for t in got), want


NAMES = ("out", "dq", "dk", "dv", "d prefix_k", "d prefix_v")


@given(
    rollout_groups(max_groups=3, max_prompt=13, max_responses=3, max_response=9, vocab=2),
    st.integers(0, 3),
    st.sampled_from([(1, 1), (2, 1), (6, 2), (3, 3)]),
    st.sampled_from([3, 8]),
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.floats(1.0, 10.0)),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reference_equals_the_concatenated_layout(groups, pad_len, heads, d, window, softcap):
    lengths = tuple(len(g.prompt) for g in groups), tuple(tuple(map(len, g.responses)) for g in groups)
    got, want = concatenated_and_prefixed(*lengths, pad_len, *heads, d, torch.float64, "reference",
                                          window_size=window, softcap=softcap, softmax_scale=0.8 / d**0.5)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@given(st.data(), st.integers(1, 9), st.integers(0, 3), st.sampled_from([(1, 1), (6, 2)]),
       st.one_of(st.none(), st.integers(1, 20)), st.one_of(st.none(), st.floats(1.0, 10.0)))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_reference_equals_the_whole_tree(data, prefix_len, pad_len, heads, window, softcap):
    """The rest of a prefix tree against its held root: each token sees the root (up to the
    window), its ancestors in the micro-batch and itself, as in the whole tree."""
    lens, parents = tree_lengths(data.draw, max_segments=6, max_len=6)
    got, want = tree_and_prefixed(prefix_len, lens, parents, pad_len, *heads, 8, torch.float64, "reference",
                                  window_size=window, softcap=softcap, softmax_scale=0.7 / 8**0.5)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_a_tree_under_a_held_prefix_is_laid_out_after_it():
    layout = PrefixedLayout((5,), ((2, 3, 1),), 2, segment_parents=((-1, 0, -1),))
    assert layout.is_tree and not PrefixedLayout((5,), ((2, 3),)).is_tree
    assert [(n.position, n.parent) for n in layout.nodes] == [(5, -1), (7, 0), (5, -1), (0, -1)]
    with pytest.raises(ValueError, match="segments must be in DFS order"):
        PrefixedLayout((5,), ((2, 3, 1),), segment_parents=((-1, -1, 0),))
    with pytest.raises(ValueError, match="1 segment_parents tuples for 2 groups"):
        PrefixedLayout((5, 3), ((2,), (1,)), segment_parents=((-1,),))


def test_bad_prefix_operand_is_named():
    layout = PrefixedLayout((4,), ((2, 3),))
    q, k, v = (torch.zeros(5, 2, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"prefix_k must be \(4 prefix tokens, 2 heads, 8\)"):
        dualkv_prefix_attn_func(q, k, v, torch.zeros(3, 2, 8), torch.zeros(4, 2, 8), layout)
    with pytest.raises(TypeError, match="PrefixedLayout"):
        dualkv_prefix_attn_func(q, k, v, k, v, DualKVLayout((1,), ((4,),)))


def lengths_of(groups):
    return tuple(len(g.prompt) for g in groups), tuple(tuple(map(len, g.responses)) for g in groups)


triton_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on CPU run under TRITON_INTERPRET=1 (conftest sets it)")


@triton_interpreter
@given(
    rollout_groups(max_groups=3, max_prompt=37, max_responses=3, max_response=21, vocab=2),
    st.integers(0, 3),
    st.sampled_from([(1, 1), (2, 1), (6, 2), (3, 3)]),
    st.sampled_from([8, 24]),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.floats(1.0, 10.0)),
    st.sampled_from([torch.float32, torch.float16]),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_triton_within_the_flash_bound(groups, pad_len, heads, d, window, softcap, dtype):
    kw = dict(window_size=window, softcap=softcap, softmax_scale=0.8 / d**0.5)
    lengths = lengths_of(groups)
    ours, exact = concatenated_and_prefixed(*lengths, pad_len, *heads, d, dtype, "triton", **kw)
    same_precision, _ = concatenated_and_prefixed(*lengths, pad_len, *heads, d, dtype, "reference", **kw)
    eps = 1e-5 if dtype == torch.float32 else 1e-3
    for name, a, b, r in zip(NAMES, ours, same_precision, exact):
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, r, eps)


@triton_interpreter
def test_triton_with_unequal_blocks_per_pass_within_the_flash_bound(monkeypatch):
    """The passes' blocks as on a GPU, each its own (the forward's query tiles 32 rows, dQ's 16, dK/dV's
    key tiles 32 against query blocks of 16, as the window's dK/dV blocks): every table follows its
    pass's blocks."""
    from megatron_dualkv.ops import dualkv_prefix_attn
    from megatron_dualkv.ops.dualkv_attn import KernelConfig

    blocks = {"fwd": KernelConfig(32, 16, 1, 1), "dq": KernelConfig(16, 32, 1, 1), "dkdv": KernelConfig(32, 16, 1, 1),
              "dkdv_window": KernelConfig(16, 32, 1, 1)}
    monkeypatch.setattr(dualkv_prefix_attn, "kernel_config", lambda name, *args: blocks[name])
    kw = dict(window_size=45, softmax_scale=0.8 / 8**0.5)
    lengths = ((70, 9), ((33, 40), (21,)))
    ours, exact = concatenated_and_prefixed(*lengths, 3, 2, 1, 8, torch.float32, "triton", **kw)
    same_precision, _ = concatenated_and_prefixed(*lengths, 3, 2, 1, 8, torch.float32, "reference", **kw)
    for name, a, b, r in zip(NAMES, ours, same_precision, exact):
        assert_within_twice_the_reference_error(name, a, b, r, 1e-5)


@triton_interpreter
@given(st.data(), st.integers(1, 30), st.sampled_from([(2, 1), (3, 3)]), st.one_of(st.none(), st.integers(1, 30)),
       st.sampled_from([torch.float32, torch.float16]))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_triton_on_trees_within_the_flash_bound(data, prefix_len, heads, window, dtype):
    lens, parents = tree_lengths(data.draw, max_segments=5, max_len=12)
    kw = dict(window_size=window, softmax_scale=0.8 / 8**0.5)
    ours, exact = tree_and_prefixed(prefix_len, lens, parents, 3, *heads, 8, dtype, "triton", **kw)
    same_precision, _ = tree_and_prefixed(prefix_len, lens, parents, 3, *heads, 8, dtype, "reference", **kw)
    eps = 1e-5 if dtype == torch.float32 else 1e-3
    for name, a, b, r in zip(NAMES, ours, same_precision, exact):
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, r, eps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (None, 30.0)])
def test_triton_on_the_gpu_within_the_flash_bound(d, window, softcap):
    """The compiled kernels in bf16 on odd sizes: two groups, prompts over several key tiles,
    responses that end mid-tile, padding, GQA 4."""
    kw = dict(window_size=window, softcap=softcap, softmax_scale=0.8 / d**0.5)
    lengths = (517, 200), ((129, 77, 300), (65,))
    ours, exact = concatenated_and_prefixed(*lengths, 7, 8, 2, d, torch.bfloat16, "triton", device="cuda", **kw)
    same_precision, _ = concatenated_and_prefixed(*lengths, 7, 8, 2, d, torch.bfloat16, "reference", device="cuda", **kw)
    for name, a, b, r in zip(NAMES, ours, same_precision, exact):
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, r, 1e-3)
    tree = (300, (129, 77, 64, 200), (-1, 0, 0, -1))
    ours, exact = tree_and_prefixed(*tree, 7, 8, 2, d, torch.bfloat16, "triton", device="cuda", **kw)
    same_precision, _ = tree_and_prefixed(*tree, 7, 8, 2, d, torch.bfloat16, "reference", device="cuda", **kw)
    for name, a, b, r in zip(NAMES, ours, same_precision, exact):
        assert_within_twice_the_reference_error(f"tree {name}", a, b, r, 1e-3)
