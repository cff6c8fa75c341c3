"""A planning table from the memory model: per parallel layout, the least recompute under which a
micro-batch holds one whole rollout group, the most packed tokens that setting fits, and the
predicted peak of the fullest GPU (``megatron_dualkv.memory``; no GPU needed).

    python tools/plan_memory.py                                    # Qwen3-30B-A3B and Gemma-4-31B on 8 x H200
    python tools/plan_memory.py --card qwen3-4b --layouts 1x1x1x1 --gpus 1
    python tools/plan_memory.py --out bench/                       # also writes plan_memory.csv
    python tools/plan_memory.py --prefix-reuse --card gemma4-31b --layouts 8x1x1x1,4x1x1x2,2x1x1x4,2x4x1x1 \\
        --group 16x65536x4096                                      # a group over one micro-batch, three ways

Layouts are tp x pp x ep x cp; the data-parallel size is what is left of --gpus, and every layout
with dp x cp > 1 shards the optimizer state (Megatron's distributed optimizer).

``--prefix-reuse``: per layout, three ways to run a group: in one micro-batch (the least recompute
that fits it), split into sub-groups that each carry the prompt, and split into prefix-reuse parts
against the prompt held once (issue #41, ``rl.prefix_reuse``); for each split the least recompute
under which a part of k responses fits (k = N/2, ..., 1; ties: the largest k) and its peak.
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
from megatron_dualkv.memory import DEFAULT_MARGIN, GIB, MemoryModel, setting_label  # noqa: E402

H200_GIB = 143771 / 1024  # what torch reports of an H200's memory
HOST_GIB = 64  # host memory per GPU for pinned activations (offloaded layers', a held prompt's): half of 128 GiB per GPU
PLANS = {
    "qwen3-30b-a3b": ["1x1x8x1", "2x1x4x1", "1x2x4x1"],
    "gemma4-31b": ["8x1x1x1", "2x4x1x1", "1x8x1x1"],
}


def layout_memory(card: str, layout: str, gpus: int):
    """(the parallel plan, the memory model) of ``card`` on ``layout`` (tp x pp x ep x cp) over ``gpus``."""
    tp, pp, ep, cp = (int(x) for x in layout.split("x"))
    parallel = plan_parallel(gpus, tp=tp, pp=pp, ep=ep, cp=cp)
    # Megatron's distributed optimizer shards over the data- and context-parallel ranks together
    shards = parallel.dp * parallel.sizes.cp
    return parallel, MemoryModel.for_card(card, parallel.sizes, dp=parallel.dp, distributed_optimizer=shards > 1)


def layout_name(parallel) -> str:
    sizes = parallel.sizes
    return f"tp{sizes.tp} pp{sizes.pp} ep{sizes.ep} cp{sizes.cp} dp{parallel.dp}"


def recompute_name(fit) -> str:
    return setting_label(fit.recompute, fit.recompute_layers, fit.prompt_on_host)


def plan(card: str, layout: str, gpus: int, group, budget: float, micro_batches: int, host_budget: float) -> dict:
    parallel, memory = layout_memory(card, layout, gpus)
    n, p, r = group
    tokens = p + n * r
    fit = memory.fit(budget, tokens, n * r / tokens, num_micro_batches=micro_batches,
                     multiple=parallel.sizes.token_multiple, host_budget_bytes=host_budget)
    parts = fit.estimate.parts
    return dict(card=card, layout=layout_name(parallel), recompute=recompute_name(fit),
                tokens=fit.tokens, groups=fit.tokens / tokens, peak=fit.estimate.total_gib,
                state=(parts["weights"] + parts["gradients"] + parts["optimizer"]) / GIB,
                activations=parts["activations"] / GIB)


def least_recompute(memory: MemoryModel, budget: float, group, k: int, micro_batches: int, held_prompt: bool,
                    host_budget: float):
    """(the least recompute under which a micro-batch of the prompt and k responses fits, its peak in
    GiB), with the prompt held beside it (prefix reuse) or not; None when none fits. Offloaded layers'
    or a held prompt's activations may wait in ``host_budget`` bytes of host memory."""
    n, p, r = group
    tokens = p + k * r
    held = p if held_prompt else 0
    try:
        fit = memory.fit_holding_prompt(budget, tokens, k * r / tokens, num_micro_batches=micro_batches,
                                        held_prompt_tokens=held, host_budget_bytes=host_budget)
    except ValueError:
        return None
    peak = memory.peak(tokens, k * r, fit.recompute, fit.recompute_layers, micro_batches, held_prompt_tokens=held,
                       prompt_on_host=fit.prompt_on_host)
    return fit, peak.total_gib


def best_split(memory: MemoryModel, budget: float, group, micro_batches: int, held_prompt: bool,
               host_budget: float) -> str:
    """The part size (k = N/2, N/4, ..., 1 responses) with the least recompute that fits (ties: the
    largest k), as "recompute, k resp, peak"; "does not fit" when no part does."""
    ladder = memory.recompute_ladder()
    fits = []
    k = group[0] // 2
    while k >= 1:
        found = least_recompute(memory, budget, group, k, micro_batches, held_prompt, host_budget)
        if found is not None:
            fits.append((ladder.index((found[0].recompute, found[0].recompute_layers)), -k, found))
        k //= 2
    if not fits:
        return "does not fit"
    _, k, (fit, peak) = min(fits, key=lambda f: f[:2])
    return f"{recompute_name(fit)}, {-k} resp, {peak:.1f} GiB"


def plan_prefix_reuse(card: str, layout: str, gpus: int, group, budget: float, micro_batches: int,
                      host_budget: float) -> dict:
    """``--prefix-reuse``'s row: the group in one micro-batch, in sub-groups, in prefix-reuse parts."""
    parallel, memory = layout_memory(card, layout, gpus)
    whole = least_recompute(memory, budget, group, group[0], micro_batches, held_prompt=False, host_budget=host_budget)
    return dict(card=card, layout=layout_name(parallel),
                whole="does not fit" if whole is None else f"{recompute_name(whole[0])}, {whole[1]:.1f} GiB",
                sub_groups=best_split(memory, budget, group, micro_batches, held_prompt=False, host_budget=host_budget),
                reuse=best_split(memory, budget, group, micro_batches, held_prompt=True, host_budget=host_budget))


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
    parser.add_argument("--host-gib", type=float, default=HOST_GIB,
                        help="pinned host memory per GPU for activations (offloaded layers', a held prompt's)")
    parser.add_argument("--prefix-reuse", action="store_true",
                        help="instead: the group in one micro-batch, in sub-groups and in prefix-reuse parts (docstring)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if (args.card is None) != (args.layouts is None):
        parser.error("--card and --layouts go together")
    plans = PLANS if args.card is None else {args.card: args.layouts.split(",")}
    group = tuple(int(x) for x in args.group.split("x"))
    budget = args.gpu_gib * GIB * (1 - args.margin)
    csv_path = os.path.join(args.out, "plan_memory.csv") if args.out else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.prefix_reuse:
        rows = [plan_prefix_reuse(card, layout, args.gpus, group, budget, args.micro_batches, args.host_gib * GIB)
                for card, layouts in plans.items() for layout in layouts]
        print(f"{args.gpus} GPUs of {args.gpu_gib:.1f} GiB, {100 * args.margin:.0f}% left free; one {args.group} group, "
              f"{args.micro_batches} micro-batches per step; least recompute, responses per part, peak")
        write_table(rows, csv_path, [
            ("card", "model", "12"), ("layout", "layout", "22"), ("whole", "one micro-batch", "24"),
            ("sub_groups", "sub-groups (prompt each)", "32"), ("reuse", "prefix reuse (prompt held)", "48"),
        ])
        return
    rows = [plan(card, layout, args.gpus, group, budget, args.micro_batches, args.host_gib * GIB)
            for card, layouts in plans.items() for layout in layouts]
    print(f"{args.gpus} GPUs of {args.gpu_gib:.1f} GiB, {100 * args.margin:.0f}% left free; a micro-batch holds one "
          f"{args.group} group at least, {args.micro_batches} micro-batches per step; bf16 weights, fp32 gradients "
          "and Adam")
    write_table(rows, csv_path, [
        ("card", "model", "14"), ("layout", "layout", "24"), ("recompute", "recompute", "12"),
        ("tokens", "tokens / micro-batch", "20.0f"), ("groups", "groups", "7.2f"), ("peak", "peak GiB", "9.1f"),
        ("state", "of it: weights+grads+Adam", "26.1f"), ("activations", "activations", "12.1f"),
    ])


if __name__ == "__main__":
    main()
