"""DualKVAttention (megatron_dualkv.mcore.attention) against dualkv_attn_func and Megatron's own
DotProductAttention, and its input errors."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from flash_check import DEVICE
from megatron_dualkv import dualkv_attn_func
from megatron_dualkv.mcore import DualKVAttention, DualKVPackedSeqParams, ParallelSizes, initialize_parallel_state
from megatron_dualkv.mcore.attention import replicated_attention
from megatron_dualkv.mcore.cpu_compat import enable_cpu_compat
from rollouts import make_batch


class FakeGroup:
    """Only the size of a tensor-parallel group matters to the constructor."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    enable_cpu_compat()
    initialize_parallel_state(ParallelSizes(), seed=0)


def config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                attention_dropout=0.0, hidden_dropout=0.0, activation_func=F.silu)
    base.update(kw)
    return TransformerConfig(**base)


def attention(cfg, layer_number=1, tp=1, **kw):
    return DualKVAttention(cfg, layer_number, AttnMaskType.causal, "self",
                           pg_collection=SimpleNamespace(tp=FakeGroup(tp)), **kw)


def qkv(T, hq, hkv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("softmax_scale", [None, 0.1])
@pytest.mark.parametrize("tp", [1, 2])
def test_runs_dualkv_attention_on_the_layout(softmax_scale, tp):
    """GQA with the heads of one tensor-parallel partition, default and explicit scale."""
    batch = make_batch()
    module = attention(config(), tp=tp, softmax_scale=softmax_scale)
    q, k, v = qkv(batch.num_tokens, 4 // tp, 2 // tp)
    out = module(q, k, v, None, packed_seq_params=DualKVPackedSeqParams.from_layout(batch.layout))
    want = dualkv_attn_func(q, k, v, batch.layout, softmax_scale=softmax_scale)
    assert out.shape == (batch.num_tokens, 4 // tp * 16)
    torch.testing.assert_close(out, want.reshape(batch.num_tokens, -1), rtol=0, atol=0)


def test_sliding_window_follows_the_layer_pattern():
    """window_size=(3, 0): keys q-3..q, i.e. a DualKV window of 4, on the layers the pattern marks."""
    batch = make_batch()
    cfg = config(window_size=(3, 0), window_attn_skip_freq=[1, 0])
    q, k, v = qkv(batch.num_tokens, 4, 2)
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    windowed = attention(cfg, layer_number=1)(q, k, v, None, packed_seq_params=params)
    full = attention(cfg, layer_number=2)(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(windowed, dualkv_attn_func(q, k, v, batch.layout, window_size=4).flatten(1))
    torch.testing.assert_close(full, dualkv_attn_func(q, k, v, batch.layout).flatten(1))
    assert not torch.allclose(windowed, full)


def test_softcap_from_a_config_that_defines_one():
    batch = make_batch()
    cfg = config()
    cfg.attn_logit_softcapping = 2.0
    q, k, v = qkv(batch.num_tokens, 4, 2)
    out = attention(cfg)(q, k, v, None, packed_seq_params=DualKVPackedSeqParams.from_layout(batch.layout))
    torch.testing.assert_close(out, dualkv_attn_func(q, k, v, batch.layout, softcap=2.0).flatten(1))


def sbhd_inputs(seed=1, s=9, b=3, hq=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    # where Megatron's attention takes its score buffer (the current CUDA device when there is one)
    q = torch.randn(s, b, hq, d, generator=g).to(DEVICE)
    k, v = torch.randn(2, s, b, hkv, d, generator=g).to(DEVICE)
    return q, k, v


def megatron_attention(cfg, q, k, v, softmax_scale=None):
    module = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=softmax_scale,
                                 pg_collection=SimpleNamespace(tp=FakeGroup(1)))
    return module(q, k, v, None)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_without_packed_params_it_is_megatrons_causal_attention(window):
    """The replicated baseline path, [s, b, h, d]: Megatron's DotProductAttention on the CPU, a fused
    kernel (replicated_attention) on a GPU."""
    cfg = config(window_size=window)
    q, k, v = sbhd_inputs()
    ours, theirs = attention(cfg)(q, k, v, None), megatron_attention(cfg, q, k, v)
    exact = dict(rtol=0, atol=0) if DEVICE == "cpu" else {}
    torch.testing.assert_close(ours, theirs, **exact)


@pytest.mark.parametrize("window, scale", [(None, None), (None, 0.3), (3, None), (1, 0.5)])
def test_replicated_attention_equals_megatrons(window, scale):
    """The fused path (SDPA, or FlexAttention for a window) against Megatron's own attention, float32
    (on the CPU also): GQA, an explicit scale, windows down to the token itself."""
    cfg = config(window_size=None if window is None else (window - 1, 0))
    q, k, v = sbhd_inputs(seed=2, s=11)
    got = replicated_attention(q, k, v, scale or 16**-0.5, window)
    torch.testing.assert_close(got, megatron_attention(cfg, q, k, v, scale), rtol=1e-4, atol=1e-5)


def test_replicated_attention_softcap_against_float64():
    q, k, v = (t.double() for t in sbhd_inputs(seed=3, s=7, b=2))
    scale, cap = 0.25, 1.5
    got = replicated_attention(*(t.float() for t in (q, k, v)), scale, softcap=cap)
    qh, kh, vh = q.permute(1, 2, 0, 3), *(t.permute(1, 2, 0, 3).repeat_interleave(2, 1) for t in (k, v))
    scores = cap * torch.tanh(qh @ kh.transpose(-1, -2) * scale / cap)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(7, 2, -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_input():
    batch = make_batch()
    module = attention(config())
    q, k, v = qkv(batch.num_tokens, 4, 2)
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    with pytest.raises(ValueError, match="query has 39 tokens but the DualKVLayout describes 40"):
        module(q[:-1], k[:-1], v[:-1], None, packed_seq_params=params)
    with pytest.raises(ValueError, match="needs the micro-batch's DualKVLayout"):
        thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.layout.cu_seqlens, cu_seqlens_kv=batch.layout.cu_seqlens)
        module(q, k, v, None, packed_seq_params=thd)
    with pytest.raises(ValueError, match="without packed_seq_params"):
        module(q, k, v, None)
    with pytest.raises(ValueError, match="4 heads per partition"):
        module(q[:, :2], k, v, None, packed_seq_params=params)
    with pytest.raises(ValueError, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=params)
    with pytest.raises(TypeError, match="DualKVLayout"):
        DualKVPackedSeqParams.from_layout(batch)


@pytest.mark.parametrize(
    "kwargs, tp, message",
    [
        (dict(num_attention_heads=6, num_query_groups=6), 4, r"num_attention_heads \(6\) is not divisible by the tensor-parallel size \(4\)"),
        (dict(num_query_groups=1), 2, r"num_query_groups \(1\) is not divisible"),
        (dict(attention_dropout=0.1), 1, "no attention dropout"),
        (dict(window_size=(4, 2)), 1, "right part must be 0"),
    ],
)
def test_bad_configuration(kwargs, tp, message):
    with pytest.raises(ValueError, match=message):
        attention(config(**kwargs), tp=tp)


def test_rejects_a_non_causal_mask():
    with pytest.raises(ValueError, match="causal"):
        DualKVAttention(config(), 1, AttnMaskType.no_mask, "self", pg_collection=SimpleNamespace(tp=FakeGroup(1)))
