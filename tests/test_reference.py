"""The reference DualKV attention against plain causal attention on the replicated layout (float64),
for prompt/response groups and for prefix trees of trajectories."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, dualkv_attn_func, pack_groups, pack_trajectories
from megatron_dualkv.ops.reference import dualkv_attention_reference
from strategies import rollout_groups, trajectory_sets


def causal_attention(q, k, v, scale, window=None, softcap=None):
    """One sequence, (S, H, D), plain causal attention written out (GQA by head repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[0])
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= i[:, None] - i[None, :] < window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def replicated_attention(batch, q, k, v, scale, window=None, softcap=None):
    """Causal attention per replicated sequence, then one copy of every packed token's output."""
    rep = batch.replicated()
    outs = [
        causal_attention(*(rep.split(x[rep.index])[i] for x in (q, k, v)), scale, window, softcap)
        for i in range(len(rep.cu_seqlens) - 1)
    ]
    out_rep = torch.cat(outs)
    first = torch.empty(batch.num_tokens, dtype=torch.long)
    first[rep.index] = torch.arange(rep.index.numel())  # any copy: they are all equal
    real = batch.num_tokens - batch.layout.pad_len
    return out_rep[first[:real]]


def random_qkv(T, hq, hkv, d, dtype=torch.float64, requires_grad=True):
    return [torch.randn(T, h, d, dtype=dtype, requires_grad=requires_grad) for h in (hq, hkv, hkv)]


@given(
    rollout_groups(),
    st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    st.sampled_from([4, 8]),
    st.one_of(st.none(), st.integers(1, 8)),
    st.one_of(st.none(), st.floats(0.5, 5.0)),
    st.sampled_from([1, 8]),
)
@settings(max_examples=50, deadline=None)
def test_reference_matches_replicated_causal(groups, heads, d, window, softcap, multiple):
    batch = pack_groups(groups, pad_to_multiple_of=multiple)
    T, real = batch.num_tokens, batch.num_tokens - batch.layout.pad_len
    q, k, v = random_qkv(T, *heads, d)
    scale = 0.7 / d**0.5
    out = dualkv_attention_reference(q, k, v, batch.layout, scale, window, softcap)
    expected = replicated_attention(batch, q, k, v, scale, window, softcap)
    torch.testing.assert_close(out[:real], expected, rtol=1e-10, atol=1e-10)

    grad = torch.randn(real, heads[0], d, dtype=torch.float64)
    got = torch.autograd.grad(out[:real], (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a[:real], b[:real], rtol=1e-10, atol=1e-10, msg=f"d{name}")


@given(
    trajectory_sets(),
    st.sampled_from([(1, 1), (4, 2)]),
    st.one_of(st.none(), st.integers(1, 8)),
    st.one_of(st.none(), st.floats(0.5, 5.0)),
    st.sampled_from([1, 8]),
)
@settings(max_examples=25, deadline=None)
def test_reference_on_trees_matches_replicated_causal(trajectories, heads, window, softcap, multiple):
    """Prefix trees: every trajectory is one causal sequence of the replicated layout."""
    batch = pack_trajectories(trajectories, pad_to_multiple_of=multiple)
    T, real = batch.num_tokens, batch.num_tokens - batch.layout.pad_len
    q, k, v = random_qkv(T, *heads, 4)
    out = dualkv_attn_func(q, k, v, batch.layout, 0.6, window, softcap)  # "auto": the reference on CPU
    expected = replicated_attention(batch, q, k, v, 0.6, window, softcap)
    torch.testing.assert_close(out[:real], expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn(real, heads[0], 4, dtype=torch.float64)
    got = torch.autograd.grad(out[:real], (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a[:real], b[:real], rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_padding_attends_only_to_itself():
    layout = DualKVLayout((2,), ((1,),), 3)
    q, k, v = random_qkv(6, 2, 1, 4, requires_grad=False)
    out = dualkv_attention_reference(q, k, v, layout)
    alone = causal_attention(q[3:], k[3:], v[3:], 0.5)
    torch.testing.assert_close(out[3:], alone)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(q=torch.zeros(5, 2, 4)), ValueError, "do not match the layout's 6"),
        (dict(k=torch.zeros(6, 2, 4), v=torch.zeros(6, 2, 4), q=torch.zeros(6, 3, 4)), ValueError, "multiple of key/value heads"),
        (dict(q=torch.zeros(6, 2, 8)), ValueError, "head_dim"),
        (dict(q=torch.zeros(6, 2)), ValueError, "tokens, heads, head_dim"),
        (dict(v=torch.zeros(6, 2, 4)), ValueError, "k and v shapes differ"),
        (dict(q=torch.zeros(6, 2, 4, dtype=torch.float64)), ValueError, "dtypes differ"),
        (dict(window_size=0), ValueError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
        (dict(layout="nope"), TypeError, "DualKVLayout or a TreeLayout"),
        (dict(backend="cuda-magic"), ValueError, "unknown DualKV attention backend"),
    ],
)
def test_bad_input(kwargs, error, message):
    args = dict(q=torch.zeros(6, 2, 4), k=torch.zeros(6, 1, 4), v=torch.zeros(6, 1, 4),
                layout=DualKVLayout((2,), ((1,),), 3))
    args.update(kwargs)
    with pytest.raises(error, match=message):
        dualkv_attn_func(**args)
