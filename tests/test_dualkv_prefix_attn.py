"""dualkv_prefix_attn_func: responses against a prompt K/V operand held apart, against the float64
dense-mask reference on the concatenated layout ([P][R1]..[RN] per group, ``dualkv_attn_func``):
the reference backend exactly, the Triton kernels on CPU (interpreter, tiny shapes) within the flash
bound (2x the same-precision PyTorch error, plus a small epsilon)."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, PrefixedLayout, dualkv_prefix_attn_func
from megatron_dualkv.ops.reference import dualkv_attention_reference
from flash_check import assert_within_twice_the_reference_error
from strategies import rollout_groups


def split_inputs(prompt_lens, response_lens, pad_len, hq, hkv, d, seed=0):
    """Random q/k/v of the concatenated layout, and the index of its response tokens and of its
    prompt tokens in packed order."""
    whole = DualKVLayout(prompt_lens, response_lens, pad_len)
    g = torch.Generator().manual_seed(seed)
    T = whole.total_tokens
    q, k, v = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, generator=g, dtype=torch.float64)
    prompt_rows, response_rows = [], []
    for start, length, _, prefix in whole.segments[: len(whole.segments) - (pad_len > 0)]:
        (response_rows if prefix else prompt_rows).append(torch.arange(start, start + length))
    pad_rows = [torch.arange(T - pad_len, T)]
    return whole, (q, k, v, dout), torch.cat(prompt_rows), torch.cat(response_rows + pad_rows)


def concatenated_and_prefixed(prompt_lens, response_lens, pad_len, hq, hkv, d, dtype, backend, seed=0,
                              device="cpu", **kw):
    """(reference on the whole layout restricted to the response rows, the prefix op on ``device``):
    out, dq, dk, dv of the response rows and d(prefix k), d(prefix v); the reference's in float64,
    the op's on the CPU."""
    whole, (q, k, v, dout), prompt, rows = split_inputs(prompt_lens, response_lens, pad_len, hq, hkv, d, seed)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    # only response rows carry an output gradient: the prompt rows' own attention is not this op's
    mask = torch.zeros_like(dout)
    mask[rows] = 1.0
    out = dualkv_attention_reference(*x, whole, **kw)
    dq, dk, dv = torch.autograd.grad(out, x, dout * mask)
    want = (out[rows], dq[rows], dk[rows], dv[rows], dk[prompt], dv[prompt])

    prefixed = PrefixedLayout(prompt_lens, response_lens, pad_len).to(device)
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
