"""DualKVSelfAttention (megatron_dualkv.mcore.self_attention): q and k normed and rotated by our code
on both layouts. On the CPU the step is Megatron's SelfAttention's bit for bit; the fused q/k norm +
RoPE (``rms_norm_rope``, compiled on CUDA) against float64 math, and within 2x the error of the
same ops in PyTorch in low precision."""
import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.mcore import cpu_compat, norms, self_attention
from megatron_dualkv.mcore.self_attention import DualKVSelfAttention, rms_norm_rope
from test_recompute import grpo_step, reference


def rotated_float64(x, weight, eps, freqs, mscale):
    """RMSNorm then RoPE written out on float64: y = x / sqrt(mean(x^2) + eps) * w, then
    (y1, y2) -> (y1 cos - y2 sin, y2 cos + y1 sin) over the two halves of the head."""
    x, weight, freqs = x.double(), weight.double(), freqs.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
    half = y.size(-1) // 2
    y1, y2 = y[..., :half], y[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat((y1 * c1 - y2 * s1, y2 * c2 + y1 * s2), dim=-1)


def inputs(shape, dtype, seed=0, device=DEVICE):
    """x [s, b, heads, d], its weight and upstream gradient, frequencies [s, 1, 1, d] as Megatron's
    rotary table gives them (one half repeated)."""
    s, _, _, d = shape
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*shape, generator=g)).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
    return x, weight, rope_freqs(s, d).to(device), torch.randn(*shape, generator=g).to(device, dtype)


def rope_freqs(s, d):
    """[s, 1, 1, d] frequencies of positions 0..s-1 as Megatron's rotary table gives them."""
    half = torch.arange(s, dtype=torch.float32)[:, None] * 10000 ** (-torch.arange(0, d, 2) / d)
    return torch.cat((half, half), dim=-1)[:, None, None, :]


def run(function, x, weight, freqs, dy, mscale=1.0):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight)]
    y = function(*leaves, 1e-6, freqs, mscale)
    return (y, *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


@pytest.mark.parametrize("shape, mscale", [((7, 1, 4, 16), 1.0), ((5, 3, 2, 64), 1.25), ((33, 1, 1, 128), 1.0)])
def test_rms_norm_rope_is_the_norm_then_the_rotation(shape, mscale):
    x, weight, freqs, dy = inputs(shape, torch.float32)
    fused = self_attention.fused_rms_norm_rope if DEVICE == "cuda" else rms_norm_rope
    got = run(fused, x, weight, freqs, dy, mscale)
    want = run(rotated_float64, x.double(), weight.double(), freqs, dy.double(), mscale)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


def test_rms_norm_rope_in_low_precision_within_twice_the_pytorch_error():
    """Compiled on a GPU (bf16): at most 2x the error of the eager ops against float64."""
    x, weight, freqs, dy = inputs((300, 1, 8, 128) if DEVICE == "cuda" else (12, 1, 2, 32), LOW, seed=1)
    exact = run(rotated_float64, x.double(), weight.double(), freqs, dy.double())
    fused = self_attention.fused_rms_norm_rope if DEVICE == "cuda" else rms_norm_rope
    ours, eager = run(fused, x, weight, freqs, dy), run(rms_norm_rope, x, weight, freqs, dy)
    for name, a, b, e in zip(("y", "dx", "dw"), ours, eager, exact):
        assert a.dtype == LOW, name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-3)


@pytest.mark.parametrize("layout", ["packed", "replicated"])
@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_the_step_is_megatrons_self_attentions(card, layout):
    """Bit for bit on the CPU (float32 on the GPU, where the norm and RoPE are compiled) the step of
    the same model with Megatron's SelfAttention in every layer, which rotates the packed layout
    segment by segment."""
    if DEVICE == "cuda" and card == "qwen3-moe-tiny":
        pytest.skip("on the GPU the compiled norm's rounding can flip a near tie of the top-k router")
    model, batches, _, _ = reference(card, ())
    with_ours = grpo_step(model, batches, layout)
    for layer in model.decoder.layers:
        layer.self_attention.__class__ = SelfAttention
    try:
        with_megatrons = grpo_step(model, batches, layout)
    finally:
        for layer in model.decoder.layers:
            layer.self_attention.__class__ = DualKVSelfAttention
    same = torch.equal if DEVICE == "cpu" else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    for got, want in zip(with_ours[0], with_megatrons[0], strict=True):
        assert same(got.loss, want.loss)
        assert all(same(a, b) for ga, gb in zip(got.logprobs, want.logprobs) for a, b in zip(ga, gb))
    assert all(same(with_ours[1][name], grad) for name, grad in with_megatrons[1].items())


@pytest.mark.parametrize("card, fused", [("qwen3-tiny", True), ("gemma3-tiny", False)])
def test_the_norm_and_rope_are_fused_where_the_norm_is_torchs(card, fused, monkeypatch):
    """Qwen3's q/k norms (torch's RMSNorm) run with RoPE in one function on both layouts, q and k
    of every layer, forward-only too; Gemma's (its own float32 norm) keep the norm and Megatron's
    rotation apart."""
    calls = []
    for name in ("rms_norm_rope", "fused_rms_norm_rope"):
        function = getattr(self_attention, name)
        monkeypatch.setattr(self_attention, name, lambda *a, _f=function: calls.append(a[0].shape) or _f(*a))
    model, batches, _, _ = reference(card, ())
    layers = model.config.num_layers
    calls.clear()
    for layout in ("packed", "replicated"):
        with torch.no_grad():
            grpo_step(model, batches[:1], layout)
    assert len(calls) == (2 * 2 * layers if fused else 0)


def test_rms_norm_rope_traces_as_one_graph_of_any_size():
    """What torch.compile sees: one graph (no break) for every size, with autograd (AOT's joint graph)
    and without; through the eager AOT backend, which runs the traced graph, on CPU tensors. (On CUDA
    that backend hands torch's fused RMSNorm kernel an unresolved symbolic size, torch 2.11; inductor,
    the backend `fused_rms_norm_rope` compiles with, decomposes the norm and runs in the GPU tests above.)"""
    import torch._dynamo

    torch._dynamo.reset()
    traced = torch.compile(rms_norm_rope, backend="aot_eager", dynamic=True, fullgraph=True)
    for shape in [(7, 1, 4, 16), (9, 1, 2, 16), (5, 3, 4, 16)]:
        x, weight, freqs, dy = inputs(shape, torch.float32, device="cpu")
        for got, want in zip(run(traced, x, weight, freqs, dy, 1.5), run(rms_norm_rope, x, weight, freqs, dy, 1.5)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(traced(x, weight, 1e-6, freqs, 1.5), rms_norm_rope(x, weight, 1e-6, freqs, 1.5))


def qkv_views(d=32, groups=2, per_group=4):
    """q [s, b, heads, d] and k [s, b, groups, d] as DualKVSelfAttention gets them from linear_qkv's
    output, for both layouts' batches (1 packed, 2 replicated) and two lengths."""
    for s, b in ((40, 1), (56, 1), (40, 2), (56, 2)):
        qkv = torch.randn(s, b, groups, (per_group + 2) * d)
        q, k, _ = torch.split(qkv, [per_group * d, d, d], dim=3)
        yield q.reshape(s, b, groups * per_group, d)
        yield k


def rms_norm(x, weight, eps):
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


COMPILED = {  # wrapper: its module, the compiled function's name, the eager function, its other arguments
    "fused_rms_norm_rope": (self_attention, "_compiled_rms_norm_rope", rms_norm_rope,
                            lambda x: (rope_freqs(x.size(0), x.size(-1)), 1.25)),
    "_rms_norm": (norms, "_compiled_rms_norm", rms_norm, lambda x: ()),
}


@pytest.fixture
def without_cpu_compat():
    """torch.compile as on a GPU machine: without the CPU runs' device mode (a TorchFunctionMode,
    which dynamo traces and guards on)."""
    enabled = cpu_compat.cpu_compat_enabled()
    cpu_compat.disable_cpu_compat()
    yield
    if enabled:
        cpu_compat.enable_cpu_compat()


@pytest.mark.parametrize("wrapper", sorted(COMPILED))
def test_the_compiled_wrappers_stay_under_the_graph_limit_on_both_layouts(wrapper, monkeypatch, without_cpu_compat):
    """torch.compile guards on strides, on a batch of one and on views, and runs eager past its limit
    of graphs (8). Called on q and k of both layouts, each with autograd (x requiring its gradient
    or not) and without, the wrappers stay under it (q stays a view, k becomes a copy); the function
    compiled on its inputs as they come reaches it."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    module, name, eager, extra = COMPILED[wrapper]
    graphs = {}
    for wrapped in (True, False):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(eager, backend=counter, dynamic=True)
        monkeypatch.setattr(module, name, compiled)
        function = getattr(module, wrapper) if wrapped else compiled
        for x in qkv_views():
            weight = 1 + 0.1 * torch.randn(x.size(-1))
            for grad_mode, x_grad in ((True, True), (True, False), (False, False)):
                with torch.set_grad_enabled(grad_mode):
                    args = (x.clone().requires_grad_(x_grad) if x_grad else x, weight.requires_grad_(grad_mode), 1e-6)
                    torch.testing.assert_close(function(*args, *extra(x)), eager(*args, *extra(x)), rtol=1e-6, atol=1e-6)
        graphs[wrapped] = counter.frame_count
    torch._dynamo.reset()
    assert graphs[True] < torch._dynamo.config.recompile_limit == graphs[False], graphs
