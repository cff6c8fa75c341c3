"""One Gemma-4-31B-dimension transformer layer of each type, forward and forward+backward:
DualKV attention on the packed layout vs the replicated layout with PyTorch's best attention.

The layers are those ``build_model`` makes (``models/gemma4-31b.json`` cut to one sliding and one
global layer, bf16): norms, QKV, attention, output projection, GeGLU MLP. Sliding layer: head dim
256, 16 key/value heads, window 1024. Global layer: head dim 512, 4 key/value heads, keys as
values. Packed: one group ``[P][R_1]..[R_N]``, T = P + N*R tokens, DualKV's default backend (the
native sm_90 kernels where they apply: both layers on Hopper; else Triton).
Replicated: N sequences ``[P][R_i]`` as a ``[P+R, N]`` batch, N*(P+R) tokens, the layer's core
attention swapped for one PyTorch backend (SDPA cuDNN / flash / memory-efficient, FlexAttention,
or the flash-attn package when installed); backends that cannot run a shape (flash and cuDNN stop
at head dim 256; SDPA has no sliding window but an explicit mask) are reported as errors.

Prints a table (median ms, peak memory above the inputs, DualKV speedup over the fastest baseline)
and writes CSV:

    python tools/bench_gemma_layer.py --out bench/            # N=16, P=8192, R=1024
    python tools/bench_gemma_layer.py --baselines none        # DualKV only (the baselines take minutes)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from bench_attention import bench, sbhd_attention, write_table  # noqa: E402  (tools/ is on sys.path when run as a script)
from megatron_dualkv.cli import ArgumentParser, add_layer_spec_flags, spec_kwargs  # noqa: E402
from tool_args import add_verbose_flag, comma_names  # noqa: E402
from megatron_dualkv import DualKVLayout  # noqa: E402
from megatron_dualkv.mcore import DualKVPackedSeqParams  # noqa: E402
from megatron_dualkv.models import ModelCard, build_model, load_card  # noqa: E402

LAYERS = {"sliding": 0, "global": 1}  # index in the two-layer model
BASELINES = {
    "sliding": ["flex", "flash_attn", "sdpa_efficient", "sdpa_cudnn"],
    "global": ["sdpa_efficient", "sdpa_cudnn", "sdpa_flash", "flex"],
}
KNOWN_BASELINES = sorted(set(sum(BASELINES.values(), [])))


def two_layer_model(card_name: str, **spec):
    """The card's architecture with one sliding and one global layer (small vocabulary: the
    embedding and output layer are not timed); spec: ``build_model``'s layer-spec arguments."""
    card = load_card(card_name)
    config = {**card.config, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 256}
    return build_model(ModelCard(f"{card.name}-2-layers", config), dtype=torch.bfloat16, **spec)


class ReplicatedCoreAttention(torch.nn.Module):
    """Core attention of the replicated ``[s, b, heads, dim]`` batch through one PyTorch backend
    (causal, optional left window of ``window`` positions, scores scaled by ``scale``)."""

    def __init__(self, method: str, window, scale: float, seq_len: int, device: torch.device):
        super().__init__()
        self.method, self.window, self.scale = method, window, scale
        if method == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            limit = window or 2**30
            self.block_mask = create_block_mask(lambda b, h, q, k: (k <= q) & (q - k < limit), None, None,
                                                seq_len, seq_len, device=device)
            self.flex = torch.compile(flex_attention, dynamic=False)
        elif method.startswith("sdpa") and window:
            q, k = torch.arange(seq_len, device=device)[:, None], torch.arange(seq_len, device=device)[None]
            self.band = (k <= q) & (q - k < window)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        return sbhd_attention(query, key, value, self._attend, repeat_kv=self.method != "flash_attn")

    def _attend(self, q, k, v):
        if self.method == "flex":
            return self.flex(q, k, v, block_mask=self.block_mask, scale=self.scale)
        if self.method == "flash_attn":
            from flash_attn import flash_attn_func

            window = (self.window - 1, 0) if self.window else (-1, -1)
            out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=self.scale, causal=True,
                                  window_size=window)
            return out.transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[self.method]
        with sdpa_kernel(backend):
            if self.window:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=self.band, scale=self.scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)


def measure(layer, x, **layer_kwargs):
    """Median forward (no grad, as a log-prob pass runs) and forward+backward ms, peak GiB above the inputs."""
    x = x.detach().requires_grad_()

    def forward():
        return layer(hidden_states=x, attention_mask=None, **layer_kwargs)[0]

    out = forward()
    dout = torch.randn_like(out)
    del out

    def forward_backward():
        forward().backward(dout)

    forward_backward()
    torch.cuda.synchronize()
    with torch.no_grad():
        fwd_ms = bench(forward)
    fwd_bwd_ms = bench(forward_backward, grad_to_none=[x, *layer.parameters()])
    x.grad = None
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward()
    torch.cuda.synchronize()
    return dict(fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms, peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)


def run_layer(model, kind: str, n: int, p: int, r: int, methods):
    layer = model.decoder.layers[LAYERS[kind]]
    hidden, device = model.config.hidden_size, next(model.parameters()).device
    rows = []
    layout = DualKVLayout((p,), ((r,) * n,)).to(device)
    params = DualKVPackedSeqParams.from_layout(layout)
    rope = model.rotary_pos_emb_at(params, layout.position_ids[None])
    x = torch.randn(layout.total_tokens, 1, hidden, device=device, dtype=torch.bfloat16)
    rows.append(dict(layer=kind, method="dualkv", layout="packed", tokens=layout.total_tokens,
                     **measure(layer, x, rotary_pos_emb=rope, packed_seq_params=params)))
    del x
    dualkv = layer.self_attention.core_attention
    x = torch.randn(p + r, n, hidden, device=device, dtype=torch.bfloat16)
    rope = model.rotary_pos_emb(p + r)
    for method in methods:
        row = dict(layer=kind, method=method, layout="replicated", tokens=n * (p + r))
        try:
            layer.self_attention.core_attention = ReplicatedCoreAttention(
                method, dualkv.dualkv_window, dualkv.dualkv_softmax_scale, p + r, device)
            row.update(measure(layer, x, rotary_pos_emb=rope))
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        finally:
            layer.self_attention.core_attention = dualkv
            layer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbose_flag(parser)
    parser.add_argument("--card", default="gemma4-31b")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--p", type=int, default=8192)
    parser.add_argument("--r", type=int, default=1024)
    parser.add_argument("--layers", default="sliding,global")
    parser.add_argument("--baselines", default="all",
                        help="'all', 'none', or a comma list of the replicated methods to time: "
                        + ", ".join(KNOWN_BASELINES))
    parser.add_argument("--out", default="bench")
    add_layer_spec_flags(parser)
    args = parser.parse_args()
    chosen = {"all": KNOWN_BASELINES, "none": []}.get(args.baselines)
    if chosen is None:
        chosen = comma_names(parser, "--baselines", args.baselines, KNOWN_BASELINES)
    model = two_layer_model(args.card, **spec_kwargs(args))
    rows = []
    for kind in args.layers.split(","):
        rows += run_layer(model, kind, args.n, args.p, args.r, [m for m in BASELINES[kind] if m in chosen])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gemma_layer_{args.n}x{args.p}x{args.r}.csv")
    print(f"\n{torch.cuda.get_device_name()}, {args.card}, N={args.n} P={args.p} R={args.r}; CSV: {path}")
    write_table(rows, path, [
        ("layer", "layer", "8"), ("method", "method", "15"), ("layout", "layout", "11"), ("tokens", "tokens", "7"),
        ("fwd_ms", "fwd ms", "8.2f"), ("fwd_bwd_ms", "fwd+bwd ms", "11.2f"), ("peak_gib", "peak GiB", "9.2f")])
    for kind in args.layers.split(","):
        ours = next(r for r in rows if r["layer"] == kind and r["method"] == "dualkv")
        baselines = [r for r in rows if r["layer"] == kind and r["layout"] == "replicated" and "error" not in r]
        if baselines:
            best = min(baselines, key=lambda r: r["fwd_bwd_ms"])
            print(f"{kind}: DualKV packed is {best['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x faster fwd+bwd than "
                  f"{best['method']} replicated ({best['fwd_ms'] / ours['fwd_ms']:.2f}x forward)")


if __name__ == "__main__":
    main()
