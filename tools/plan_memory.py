"""A planning table from the memory model: per parallel layout, the least recompute under which a
micro-batch holds one whole rollout group, the most packed tokens that setting fits, and the
predicted peak of the fullest GPU (``megatron_dualkv.memory``; no GPU needed).

    python tools/plan_memory.py                                    # Qwen3-30B-A3B and Gemma-4-31B on 8 x H200
    python tools/plan_memory.py --card qwen3-4b --layouts 1x1x1x1 --gpus 1
    python tools/plan_memory.py --out bench/                       # also writes plan_memory.csv

Layouts are tp x pp x ep x cp; the data-parallel size is what is left of --gpus, and every layout
with dp > 1 shards the optimizer state (Megatron's distributed optimizer).
"""
from __future__ import annotations

import argparse
import os
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from tool_args import add_verbose_flag  # noqa: E402
from bench_attention import write_table  # noqa: E402
from megatron_dualkv.mcore import plan_parallel  # noqa: E402
from megatron_dualkv.memory import DEFAULT_MARGIN, GIB, MemoryModel  # noqa: E402

H200_GIB = 143771 / 1024  # what torch reports of an H200's memory
PLANS = {
    "qwen3-30b-a3b": ["1x1x8x1", "2x1x4x1", "1x2x4x1"],
    "gemma4-31b": ["8x1x1x1", "2x4x1x1", "1x8x1x1"],
}


def plan(card: str, layout: str, gpus: int, group, budget: float, micro_batches: int) -> dict:
    tp, pp, ep, cp = (int(x) for x in layout.split("x"))
    parallel = plan_parallel(gpus, tp=tp, pp=pp, ep=ep, cp=cp)
    memory = MemoryModel.for_card(card, parallel.sizes, dp=parallel.dp,
                                  distributed_optimizer=parallel.dp > 1)
    n, p, r = group
    tokens = p + n * r
    fit = memory.fit(budget, tokens, n * r / tokens, num_micro_batches=micro_batches,
                     multiple=parallel.sizes.token_multiple)
    parts = fit.estimate.parts
    return dict(card=card, layout=f"tp{tp} pp{pp} ep{ep} cp{cp} dp{parallel.dp}",
                recompute=fit.recompute + (f"+{fit.recompute_layers}" if fit.recompute_layers else ""),
                tokens=fit.tokens, groups=fit.tokens / tokens, peak=fit.estimate.total_gib,
                state=(parts["weights"] + parts["gradients"] + parts["optimizer"]) / GIB,
                activations=parts["activations"] / GIB)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_verbose_flag(parser)
    parser.add_argument("--card", default=None, help="one card (default: the cards of the table above)")
    parser.add_argument("--layouts", default=None, help="comma list of tp x pp x ep x cp (with --card)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--group", default="16x8192x1024", help="N x P x R of the rollout group a micro-batch must hold")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per step and DP rank (how many a pipeline stage holds at once: 1F1B)")
    parser.add_argument("--gpu-gib", type=float, default=H200_GIB)
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="share of the GPU's memory left free")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if (args.card is None) != (args.layouts is None):
        parser.error("--card and --layouts go together")
    plans = PLANS if args.card is None else {args.card: args.layouts.split(",")}
    group = tuple(int(x) for x in args.group.split("x"))
    budget = args.gpu_gib * GIB * (1 - args.margin)
    rows = [plan(card, layout, args.gpus, group, budget, args.micro_batches)
            for card, layouts in plans.items() for layout in layouts]
    print(f"{args.gpus} GPUs of {args.gpu_gib:.1f} GiB, {100 * args.margin:.0f}% left free; a micro-batch holds one "
          f"{args.group} group at least, {args.micro_batches} micro-batches per step; bf16 weights, fp32 gradients "
          "and Adam")
    write_table(rows, os.path.join(args.out, "plan_memory.csv") if args.out else None, [
        ("card", "model", "14"), ("layout", "layout", "24"), ("recompute", "recompute", "12"),
        ("tokens", "tokens / micro-batch", "20.0f"), ("groups", "groups", "7.2f"), ("peak", "peak GiB", "9.1f"),
        ("state", "of it: weights+grads+Adam", "26.1f"), ("activations", "activations", "12.1f"),
    ])


if __name__ == "__main__":
    main()
