"""One Qwen3.5-4B-dimension Gated DeltaNet layer, forward and forward+backward: the packed layout
with the prompt's state handed to every response, against the replicated layout (each ``[P][R_i]``
its own sequence from zero state). Both run the chunked rule (``ops.gated_delta_rule``) of each of
``--backends`` (fla's Triton kernel, ours with its Triton state scan, the PyTorch one): packed,
once per tree level (the prompt, then the responses from its final state); replicated, once over
the N sequences. The layer is the one ``build_model`` makes (``models/qwen3_5-4b.json`` cut to one
GDN layer, bf16): input norm, in_proj, the short conv, the rule, the gated norm, out_proj, and the
MLP; ``mixer`` rows time the GDN token mixer alone.

    python tools/bench_gdn_layer.py --out bench/              # N x P x R = 16 x 8192 x 1024 and 32 x 8192 x 512
    python tools/bench_gdn_layer.py --backends torch --workloads 16x8192x1024   # without fla
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from bench_attention import write_table  # noqa: E402  (tools/ is on sys.path when run as a script)
from bench_gemma_layer import measure  # noqa: E402
from tool_args import add_verbose_flag  # noqa: E402
from megatron_dualkv import DualKVLayout  # noqa: E402
from megatron_dualkv.mcore import DualKVPackedSeqParams  # noqa: E402
from megatron_dualkv.models import ModelCard, build_model, load_card  # noqa: E402

WORKLOADS = "16x8192x1024,32x8192x512"


def one_gdn_layer(card_name: str):
    """The card's architecture cut to one GDN layer (small vocabulary: embedding and output layer untimed)."""
    card = load_card(card_name)
    config = {**card.config, "num_hidden_layers": 1, "layer_types": ["linear_attention"], "vocab_size": 256}
    return build_model(ModelCard(f"{card.name}-1-gdn-layer", config), dtype=torch.bfloat16).decoder.layers[0]


def run_workload(layer, n: int, p: int, r: int, backend: str):
    os.environ["DUALKV_GDN_BACKEND"] = backend  # what the layer's "auto" runs
    hidden, device = layer.config.hidden_size, next(layer.parameters()).device
    layout = DualKVLayout((p,), ((r,) * n,)).to(device)
    packed = dict(packed_seq_params=DualKVPackedSeqParams.from_layout(layout))
    shapes = {"packed": ((layout.total_tokens, 1, hidden), packed), "replicated": ((p + r, n, hidden), {})}
    rows = []
    for part, module in (("layer", layer), ("mixer", layer.self_attention)):
        for name, (shape, kwargs) in shapes.items():
            x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
            row = dict(workload=f"{n}x{p}x{r}", backend=backend, part=part, layout=name, tokens=shape[0] * shape[1],
                       **measure(module, x, **kwargs))
            rows.append(row)
            print(row, flush=True)
            del x
            layer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbose_flag(parser)
    parser.add_argument("--card", default="qwen3_5-4b")
    parser.add_argument("--workloads", default=WORKLOADS, help="comma list of N x P x R")
    parser.add_argument("--backends", default="fla,triton,torch", help="comma list of gated delta rule backends")
    parser.add_argument("--out", default="bench")
    args = parser.parse_args()
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    layer = one_gdn_layer(args.card)
    backends = args.backends.split(",")
    rows = [row for w in workloads for backend in backends for row in run_workload(layer, *w, backend)]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gdn_layer.csv")
    print(f"\n{torch.cuda.get_device_name()}, {args.card} GDN layer, bf16; CSV: {path}")
    write_table(rows, path, [
        ("workload", "workload", "14"), ("backend", "backend", "7"), ("part", "part", "6"), ("layout", "layout", "11"),
        ("tokens", "tokens", "7"),
        ("fwd_ms", "fwd ms", "8.2f"), ("fwd_bwd_ms", "fwd+bwd ms", "11.2f"), ("peak_gib", "peak GiB", "9.2f")])
    for (n, p, r) in workloads:
        rho = n * (p + r) / (p + n * r)
        for backend in backends:
            for part in ("layer", "mixer"):
                packed, replicated = (next(row for row in rows if row["workload"] == f"{n}x{p}x{r}" and row["part"] == part
                                           and row["backend"] == backend and row["layout"] == name)
                                      for name in ("packed", "replicated"))
                print(f"{n}x{p}x{r} {backend} {part}: packed {replicated['fwd_bwd_ms'] / packed['fwd_bwd_ms']:.2f}x "
                      f"faster fwd+bwd than replicated (rho = {rho:.2f})")


if __name__ == "__main__":
    main()
