"""DualKVSelfAttention (megatron_dualkv.mcore.self_attention): q and k normed and rotated by our code
on both layouts. On the CPU the step is Megatron's SelfAttention's bit for bit; on CUDA Qwen3's q/k
norm + RoPE is one Triton op (``ops.rms_norm_rope``, tested against float64 in
test_rms_norm_rope.py)."""
import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from flash_check import DEVICE
from megatron_dualkv.mcore import self_attention
from megatron_dualkv.mcore.self_attention import DualKVSelfAttention
from test_recompute import grpo_step, reference


@pytest.mark.parametrize("layout", ["packed", "replicated"])
@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_the_step_is_megatrons_self_attentions(card, layout):
    """Bit for bit on the CPU (float32 on the GPU, where the norm and RoPE are our kernel) the step of
    the same model with Megatron's SelfAttention in every layer, which rotates the packed layout
    segment by segment."""
    if DEVICE == "cuda" and card == "qwen3-moe-tiny":
        pytest.skip("on the GPU the fused norm's rounding can flip a near tie of the top-k router")
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
    for name in ("rms_norm_rope_reference", "rms_norm_rope_func"):
        function = getattr(self_attention, name)
        monkeypatch.setattr(self_attention, name, lambda *a, _f=function: calls.append(a[0].shape) or _f(*a))
    model, batches, _, _ = reference(card, ())
    layers = model.config.num_layers
    calls.clear()
    for layout in ("packed", "replicated"):
        with torch.no_grad():
            grpo_step(model, batches[:1], layout)
    assert len(calls) == (2 * 2 * layers if fused else 0)
