"""Policy-update benchmark on real-dimension models: DualKV packed vs the same Megatron model on the
replicated layout with PyTorch SDPA (cuDNN backend).

    python tools/bench_policy_update.py --out bench/           # one H200: Qwen3-8B and Qwen3-30B-A3B layer dims
    python tools/bench_policy_update.py --device cpu --tiny    # dry run of the same code: tiny cards, small groups
    python tools/bench_policy_update.py --models moe --update bench/policy_update_h200.csv   # re-measure one model
    python tools/bench_policy_update.py --full-depth --agent --models qwen3-4b --out bench/   # prefix trees (#31)
    python tools/bench_policy_update.py --full-depth --models qwen3-4b-131k --layouts packed,reuse \\
        --transformer-engine off --out bench/                                                  # prefix reuse (#41)
    python tools/bench_policy_update.py --device cpu --tiny --full-depth --models qwen3-tiny --workloads 4x96x24 \\
        --layouts packed,reuse,replicated --budget-gib 0.0033    # dry run: the whole group fits only recomputed

Models: Qwen3-8B layer dimensions with ``--dense-layers`` layers and Qwen3-30B-A3B-dimension MoE
layers (``--moe-layers``), full vocabulary, bf16 parameters with Megatron's fp32 main weights and
Adam. Workloads: one group of N responses of R tokens sharing a P-token prompt per step,
(N, P, R) = (16, 8192, 1024) and (32, 8192, 512).

The step is the launch script's (``examples/grpo_policy_update.py``: one update, whose own forward
gives the behaviour log-probs, so forward/backward with the GRPO loss and Megatron's optimizer step;
until v0.2.0 a forward-only pass computed them first), on the packed layout with DualKV attention,
and on the replicated layout (every response after its own prompt copy) whose core attention is
PyTorch SDPA restricted to the cuDNN backend. For each model, workload and layout: the largest
micro-batch that fits (responses per micro-batch, halving from N until a step runs without running
out of memory), then at that size the median step time over ``--repeats`` steps, rollout tokens per
second, model TFLOP/s (3x the forward FLOPs of the layout run, ``megatron_dualkv.CostModel``), MFU
against the bf16 matmul rate measured at the start of the same run, and peak memory. Prints a table, writes CSV and PNG. Each
model is measured in a process of its own (``measure_alone``).

``--layouts`` (``--full-depth``): ``packed`` and ``replicated`` as above (a group over the
micro-batch runs as sub-groups that each carry the prompt), and ``reuse``: packed with prefix
reuse (issue #41, ``rl.prefix_reuse``): a group over the micro-batch runs the prompt's forward once,
then parts of k responses against its held K/V, then the prompt's backward once. Its settings are
parts of k = N, N/2, ..., 1 responses (k = N: the whole group, as ``packed``), each with the least
recompute under which the held prompt and a part fit, the step's ``max_tokens`` the part's budget
P + k R (the launch script's ``--max-tokens`` with ``--prefix-reuse on``); its useful FLOPs are the
whole group's once. The speedup column: a ``packed`` row's is the replicated row's step time over
its own, a ``reuse`` row's the ``packed`` row's over its own (prefix reuse against the sub-group
split). Prefix reuse runs on the local layer spec: pass ``--transformer-engine off`` with a GPU
that has Transformer Engine. #41's prompts need the ``qwen3-4b-131k`` card (Qwen3-4B with YaRN:
qwen3-4b stops at 40,960 positions; 131,072 + 4,096 passes even YaRN's 131,072). Time and memory
on one H200 (the memory and cost models, 8% margin): at 16 x 65,536 x 2,048 the whole group fits
with selective recompute and 33 layers recomputed whole, prefix reuse ranks parts of 1 response (32
layers) first, 1.3e16 FLOPs a step each (25-30 s measured; the ranking counts FLOPs only, and the
parts ran 0.84x as fast, their attention against the held prompt on the Triton kernels); the
replicated layout 1.1e17 (minutes). At 16 x 131,072 x 4,096 a prefix-reuse part fits only with
the prompt's saved activations on the host (``prefix_reuse_prompt_on_host``: parts of 8 responses,
selective recompute and 33 layers whole, 121 GiB, 62 GiB on the host), and the split takes 1.2e17
FLOPs a step, the replicated layout 4e17: measure those one layout per call, the
replicated one with ``--replicated-sample`` (its step extrapolated from its first one and two
micro-batches, ``extrapolated_steps``; the row says so) where a step outlasts the run's time limit.
A row's recompute says ", prompt on host" where it ran so.

``--update FILE.csv`` replaces the rows of the models measured now in that table (the others keep
theirs, with the matmul rate of their own run) and redraws its PNG.

``--agent``: instead of the groups, issue #31's workload (a), agent episodes as trajectories (a
4096-token prompt, 8 trajectories of 4 turns of 512 trained model tokens then 512 masked tool
tokens, the first turn shared in pairs: 32,768 packed tokens for 65,536), one rollout batch per
step: the packed prefix tree against the replicated trajectories, each at the first setting that
runs of those the memory and cost models rank (micro-batch budgets in packed tokens, halving from the
whole tree, each with the least recompute that fits), as ``--full-depth`` does. Rows:
N trajectories, P the prompt, R the tokens after it.
"""
from __future__ import annotations

import argparse
import csv
import faulthandler
import gc
import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tools")]
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from megatron_dualkv.cli import ArgumentParser, add_layer_spec_flags, layer_spec, memory_margin_problem  # noqa: E402
from tool_args import add_verbose_flag, comma_names  # noqa: E402

WORKLOADS = [(16, 8192, 1024), (32, 8192, 512)]
TINY_WORKLOADS = [(4, 96, 24), (8, 96, 12)]
# --full-depth: whole models, each at its own workloads
FULL_DEPTH = {
    "qwen3-4b": [(16, 8192, 1024), (32, 8192, 512), (8, 32768, 1024)],
    "gemma3-4b": [(16, 8192, 1024), (32, 8192, 512)],
    "qwen3_5-4b": [(16, 8192, 1024)],
    # Qwen3-4B with YaRN to 131,072 positions: #41's long prompts, whose positions pass qwen3-4b's 40,960
    "qwen3-4b-131k": [(16, 65536, 2048)],
}
LAYOUTS = ("packed", "reuse", "replicated")
# The step's forward-pass equivalents: forward and backward of its one update (no behaviour pass).
STEP_PASSES = 3
TINY_FULL_DEPTH = {"qwen3-tiny": [(4, 96, 24)], "gemma3-tiny": [(4, 96, 24)], "qwen3_5-tiny": [(4, 96, 24)]}
# --agent: (prompt, trajectory pairs, turns, model tokens, tool tokens) of issue #31's workload (a)
AGENT = (4096, 4, 4, 512, 512)
TINY_AGENT = (48, 2, 3, 8, 8)
CPU_BUDGET_GIB = 8.0  # the dry run's stand-in for the device's memory


def workload_list(text: str) -> List[Tuple[int, int, int]]:
    """--workloads: "NxPxR,..." as (N, P, R) tuples of positive ints."""
    workloads = []
    for name in text.split(","):
        sizes = name.split("x")
        if len(sizes) != 3 or not all(x.isdigit() and int(x) > 0 for x in sizes):
            raise argparse.ArgumentTypeError(f"{name!r} is not NxPxR (three positive ints, e.g. 16x65536x2048)")
        workloads.append(tuple(map(int, sizes)))
    return workloads


def model_workloads(args):
    """--full-depth: card -> workloads; else name -> (card, layers) of the layer slices."""
    if args.full_depth:
        return TINY_FULL_DEPTH if args.tiny else FULL_DEPTH
    if args.tiny:
        return {"dense": ("qwen3-tiny", 2), "moe": ("qwen3-moe-tiny", 2)}
    return {"dense": ("qwen3-8b", args.dense_layers), "moe": ("qwen3-30b-a3b", args.moe_layers)}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The flags, checked before the imports of Megatron-Core and the launch script (seconds)."""
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny cards and small groups (a dry run of the code paths)")
    parser.add_argument("--full-depth", action="store_true",
                        help="whole models (Qwen3-4B, Gemma-3-4B), each at the setting the tool finds best")
    parser.add_argument("--agent", action="store_true",
                        help="with --full-depth: issue #31's agent episodes, the packed tree against the replicated "
                             "trajectories (module docstring)")
    parser.add_argument("--dense-layers", type=int, default=4, help="Qwen3-8B-dimension layers")
    parser.add_argument("--moe-layers", type=int, default=4, help="Qwen3-30B-A3B-dimension MoE layers")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per measurement (median)")
    parser.add_argument("--replicated-repeats", type=int, default=None,
                        help="timed steps of the replicated layout (default: --repeats; its steps take 5-10x longer)")
    parser.add_argument("--replicated-sample", action="store_true",
                        help="--full-depth: time the replicated layout on its first one and two micro-batches and "
                             "extrapolate its step (``extrapolated_steps``), for a step longer than a run may take")
    parser.add_argument("--models", default=None,
                        help="comma list of dense, moe (layer slices) or of the --full-depth cards (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: profile one step of each model at the first workload, in the first of --layouts "
                             "(packed, reuse or replicated; kernel time table)")
    parser.add_argument("--no-offload", dest="offload", action="store_false",
                        help="--full-depth: leave offloaded layers (recompute offload: saved tensors in pinned host "
                             "memory) out of the settings, which otherwise come before recomputing layers whole")
    parser.add_argument("--memory-margin", type=float, default=None,
                        help="--full-depth: the share of GPU memory the settings leave free (as the launch script's flag)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--update", type=Path, metavar="CSV",
                        help="instead of writing into --out: replace the measured models' rows of this table")
    add_layer_spec_flags(parser)  # the launch script's flags; the table's spec column
    parser.add_argument("--workloads", type=workload_list, default=None,
                        help="comma list of workloads to measure, as NxPxR, e.g. 16x131072x4096 (default: the model's)")
    parser.add_argument("--layouts", default="packed,replicated",
                        help="--full-depth: the layouts to measure, of packed, reuse (packed with prefix reuse) and "
                             "replicated (comma list; a speedup needs its row's reference layout too: module docstring)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="--full-depth: the memory the settings are ranked within, in GiB (default: the device's "
                             f"memory less --memory-margin; the CPU dry run's stand-in: {CPU_BUDGET_GIB:g})")
    parser.add_argument("--stack-dumps", type=float, default=None, metavar="SECONDS",
                        help="print every thread's Python stack every SECONDS (to see where a slow step spends them)")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    args.layouts = comma_names(parser, "--layouts", args.layouts, LAYOUTS)
    workloads = model_workloads(args)
    args.model_names = comma_names(parser, "--models", args.models or ",".join(workloads), workloads)
    if args.update is not None and not args.update.is_file():
        parser.error(f"--update: {args.update} is not a file")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here; use --device cpu --tiny for a dry run")
    if margin_problem := memory_margin_problem(args.memory_margin):
        parser.error(margin_problem)
    if args.agent and (not args.full_depth or args.profile):
        parser.error("--agent runs whole models: pass --full-depth (and no --profile)")
    if "reuse" in args.layouts and (not args.full_depth or args.agent):
        parser.error("--layouts reuse: prefix reuse runs with --full-depth on rollout groups (no --agent)")
    if args.replicated_sample and (not args.full_depth or args.agent or "replicated" not in args.layouts):
        parser.error("--replicated-sample extrapolates the replicated layout's step of a rollout group: pass "
                     "--full-depth and --layouts with replicated (no --agent)")
    if len(args.model_names) == 1 and args.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu on a machine with a GPU: the models would still be built on the GPU")
    return args


if __name__ == "__main__":
    parse_args()  # bad flags are refused before the imports below, which take seconds

import grpo_policy_update as policy_update  # noqa: E402
from megatron_dualkv import (CostModel, DualKVLayout, PackedLayout, PrefixedLayout, RolloutGroup, Trajectory,  # noqa: E402
                             plan_micro_batches)
from megatron_dualkv.memory import (DEFAULT_MARGIN, GIB, MemoryModel, device_budget, setting_label,  # noqa: E402
                                    use_expandable_segments)
from megatron_dualkv.models import load_card  # noqa: E402
from megatron_dualkv.rl import ResponseTokens  # noqa: E402
from megatron_dualkv.rl.host_stash import host_stash  # noqa: E402


@dataclass
class Result:
    model: str
    layers: int
    n: int
    p: int
    r: int
    layout: str
    micro_batch_responses: int = 0
    micro_batch_tokens: int = 0  # of the largest micro-batch in the layout (replicated: every copy; reuse: a part and its held prompt)
    micro_batches: int = 0
    step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    tflops: float = float("nan")
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    speedup: float = float("nan")  # packed: over replicated; reuse: over packed (module docstring)
    matmul_peak_tflops: float = float("nan")  # of the run that measured this row
    recompute: str = "none"
    recompute_layers: int = 0  # fully recomputed layers per stage on top of "selective" (0: none)
    recompute_flops: float = 0.0  # FLOPs recompute adds, over the layout's useful FLOPs
    predicted_gib: float = 0.0  # the memory model's peak for the setting (--full-depth)
    workload: str = "group"  # "group": one prompt and N responses; "agent": --agent's trajectories
    spec: str = "local"  # the layer spec, as the launch script's first line names it
    max_tokens: int = 0  # the step's micro-batch budget in packed tokens: the launch script's --max-tokens for this row
    prompt_on_host: bool = False  # reuse: the held prompt's activations waited on the host
    extrapolated: bool = False  # replicated: the step from its first micro-batches (--replicated-sample)

    @property
    def name(self) -> str:
        """The model, and its layer spec where it is not the local one."""
        return self.model if self.spec == "local" else f"{self.model} ({self.spec})"


def layer_card(card: str, layers: int, directory: Path) -> Path:
    """A card file of ``card`` with ``layers`` layers (the launch script takes card files)."""
    config = dict(load_card(card).config)
    config.update(name=f"{card}-{layers}l", num_hidden_layers=layers, max_window_layers=layers)
    if config.get("mlp_only_layers"):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    path = directory / f"{config['name']}.json"
    path.write_text(json.dumps(config))
    return path


def rollout_group(n: int, p: int, r: int, vocab_size: int, seed: int) -> RolloutGroup:
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(3, vocab_size, (k,), generator=g).tolist()  # noqa: E731
    return RolloutGroup(ids(p), [ids(r) for _ in range(n)], rewards=torch.randint(0, 2, (n,), generator=g).float().tolist())


def agent_episodes(vocab_size: int, seed: int, prompt: int, pairs: int, turns: int, model: int, tool: int
                   ) -> List[Trajectory]:
    """--agent's trajectories: after a shared prompt, ``turns`` turns of ``model`` trained then
    ``tool`` masked tokens, the first turn shared by each pair (random tokens, one group)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(3, vocab_size, (k,), generator=g).tolist()  # noqa: E731
    head, mask = ids(prompt), [0] * prompt + ([1] * model + [0] * tool) * turns
    out = []
    for _ in range(pairs):
        first = ids(model + tool)
        for _ in range(2):
            out.append(Trajectory(head + first + ids((turns - 1) * (model + tool)), mask,
                                  reward=float(torch.randint(0, 2, (), generator=g)), group=0))
    return out


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_steps(policy, group, layout: str, max_tokens: int, repeats: int):
    """A warm-up step (compilation, optimizer state, the fit probe), then ``repeats`` timed ones;
    ``group``: a RolloutGroup, or the step's trajectories; ``layout`` "reuse": packed with prefix reuse."""
    rollouts = [group] if isinstance(group, RolloutGroup) else group
    step = layout_step(policy, layout, max_tokens)
    warm = step(warm_up_group(group, max_tokens, policy) if isinstance(group, RolloutGroup) and layout != "reuse"
                else rollouts)
    # a long step's first figures, for a run cut off or out of memory in the timed ones
    print(f"  warm-up step: {warm.seconds:.4g} s, peak {warm.peak_memory_gib:.1f} GiB", flush=True)
    return [step(rollouts) for _ in range(repeats)]


def layout_step(policy, layout: str, max_tokens: int):
    """A GRPO step of some rollouts on ``layout`` ("reuse": packed with prefix reuse) within
    ``max_tokens`` packed tokens a micro-batch."""
    step_layout, reuse = ("packed", True) if layout == "reuse" else (layout, False)
    return lambda rollouts: policy_update.policy_update_step(policy, rollouts, policy_update.LOSSES["grpo"], max_tokens,
                                                             step_layout, prefix_reuse=reuse)


def warm_up_group(group: RolloutGroup, max_tokens: int, policy) -> List[RolloutGroup]:
    """A group that the planner splits warms up on its first micro-batch's responses alone: the same
    micro-batch shapes, so the same compilation and peak, in a fraction of the step (a split step at
    131K tokens takes minutes). Prefix reuse warms up on the whole group, whose first part alone
    would fit one micro-batch and skip the held prompt's kernels."""
    first = plan_micro_batches([group], max_tokens, attention_weight=policy.cost.attention_weight).ranks[0][0]
    return [group.with_responses(first.source_responses[0])]


def bench_layout(policy, group: RolloutGroup, layout: str, repeats: int, peak_tflops: float, result: Result) -> Result:
    """Largest micro-batch (responses) that fits, then the median step at that size."""
    n, p, r = result.n, result.p, result.r
    k = n
    while k >= 1:
        # the planner cuts the group into sub-groups of k responses
        steps = steps_that_fit(policy, group, layout, p + k * r, repeats,
                               f"{result.model} {layout} N={n}: {k} responses per micro-batch")
        if steps is not None:
            return measured(result, k, steps, peak_tflops)
        k //= 2
    return result


def measured(result: Result, k: int, steps, peak_tflops: float) -> Result:
    """``result`` with the median of ``steps`` at ``k`` responses per micro-batch."""
    p, r = result.p, result.r
    seconds = statistics.median(s.seconds for s in steps)
    result.micro_batch_responses = k
    result.micro_batch_tokens = micro_batch_tokens(p, r, k, result.layout)
    result.max_tokens = p + k * r  # every layout plans by packed tokens
    result.micro_batches = steps[0].micro_batches
    result.step_s = seconds
    result.tokens_per_s = steps[0].rollout_tokens / seconds
    result.tflops = steps[0].flops / seconds / 1e12
    result.mfu = result.tflops / peak_tflops
    result.matmul_peak_tflops = peak_tflops
    result.peak_gib = max(s.peak_memory_gib for s in steps)
    return result


def profile_step(card, workload, args, layout: str, setting: Optional["Setting"] = None) -> None:
    """Kernel-time table of one step in ``layout`` (packed, reuse or replicated; after two warm-up
    steps), printed and written to the out folder; at ``setting`` (the micro-batch, recompute and
    where the held prompt's activations wait), else the whole group in one micro-batch without
    recompute."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    n, p, r = workload
    responses = n if setting is None else setting.responses
    recompute = () if setting is None else (setting.recompute, setting.recompute_layers, setting.prompt_on_host)
    policy = policy_update.build_policy(policy_args(card, args, *recompute))
    group = rollout_group(n, p, r, policy.vocab_size, seed=n)
    step = layout_step(policy, layout, p + responses * r)  # every layout plans by packed tokens (as bench_layout)
    print("warm-up steps: " + ", ".join(f"{step([group]).seconds:.4g} s" for _ in range(2)), flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        seconds = step([group]).seconds
    print(f"profiled step: {seconds:.4g} s", flush=True)
    device = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if device:
        busy = busy_seconds(device)
        print(f"GPU busy (kernels, copies): {busy:.4g} s of the step's {seconds:.4g} s ({100 * busy / seconds:.1f}%)", flush=True)
    sort_by = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    kernels = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
    print(kernels, flush=True)
    # The matmuls by shape say which projection runs below the device's peak.
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort_by, row_limit=60, max_name_column_width=40, max_shapes_column_width=90)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{Path(card).stem}_{layout}.txt").write_text(kernels + "\n" + shapes)


def busy_seconds(spans) -> float:
    """Seconds covered by at least one of the ``(start, end)`` spans (microseconds, as the profiler
    records them): where the device ran something, however many streams."""
    busy, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e6


def policy_args(card: Path, args, recompute: str = "none", recompute_layers: int = 0, prompt_on_host: bool = False):
    layers = ["--recompute-layers", str(recompute_layers)] if recompute_layers else []
    policy = policy_update.parse_args([
        "--model", str(card), "--dtype", args.dtype, "--lr", "1e-6", "--clip-grad", "0" if args.device == "cpu" else "1.0",
        "--recompute", recompute, *layers, "--transformer-engine", args.transformer_engine, "--fp8", args.fp8,
    ])
    policy.prompt_on_host = prompt_on_host  # as the launch script's fit_within sets it
    return policy


def bench_model(card: Path, layers: int, workloads, args, peak_tflops: float) -> List[Result]:
    policy = policy_update.build_policy(policy_args(card, args))
    results = []
    for n, p, r in workloads:
        group = rollout_group(n, p, r, policy.vocab_size, seed=n)
        pair = [bench_layout(policy, group, layout, args.repeats, peak_tflops, Result(card.stem, layers, n, p, r, layout))
                for layout in ("packed", "replicated")]
        pair[0].speedup = pair[1].step_s / pair[0].step_s
        results += pair
        for result in pair:
            print(row(result), flush=True)
    return results


@dataclass(frozen=True)
class Setting:
    """One way to run a workload: ``responses`` per micro-batch, a recompute setting, and what the
    memory and cost models say of it."""

    responses: int
    recompute: str
    recompute_layers: int
    predicted_gib: float
    useful_flops: float  # the step's forward passes (STEP_PASSES) of the layout, without recompute
    recompute_flops: float  # what recompute adds
    prompt_on_host: bool = False  # reuse: the held prompt's activations wait on the host

    @property
    def executed_flops(self) -> float:
        return self.useful_flops + self.recompute_flops


def micro_batch_layouts(n: int, p: int, r: int, k: int, layout: str) -> List[Tuple[PackedLayout, int]]:
    """The forward passes of one group of n responses at k responses per micro-batch, each with its
    rows that predict a trained token: sub-groups that each carry the prompt (packed), k sequences
    [P][R_i] (replicated), or the prompt's own forward then parts of k responses against it (reuse;
    at k = n the whole group, as packed)."""
    sizes = [min(k, n - i) for i in range(0, n, k)]
    if layout == "replicated":
        return [(DualKVLayout((p + r,) * m, ((),) * m), m * r) for m in sizes]
    if layout == "reuse" and k < n:
        return [(DualKVLayout((p,), ((),)), 0)] + [(PrefixedLayout((p,), ((r,) * m,)), m * r) for m in sizes]
    return [(DualKVLayout((p,), ((r,) * m,)), m * r) for m in sizes]


def micro_batch_tokens(p: int, r: int, k: int, layout: str) -> int:
    """Tokens of a micro-batch of k responses: k prompt copies in the replicated layout, one elsewhere."""
    return k * (p + r) if layout == "replicated" else p + k * r


def candidate_settings(memory: MemoryModel, cost: CostModel, budget: float, workload, layout: str) -> List[Setting]:
    """For every micro-batch size (N, N/2, ..., 1 responses) the least recompute that fits ``budget``,
    fewest executed FLOPs first (ties: the larger micro-batch)."""
    n, p, r = workload
    layers = memory.config.num_layers
    settings = []
    k = n
    while k >= 1:
        mbs = micro_batch_layouts(n, p, r, k, layout)
        # reuse: a part's activations with those of its held prompt's forward, which live until its backward
        tokens = micro_batch_tokens(p, r, k, layout)
        shape = dict(num_micro_batches=len(mbs), layout="replicated" if layout == "replicated" else "packed",
                     held_prompt_tokens=p if layout == "reuse" and k < n else 0)
        fit = _fit_or_none(memory, budget, tokens, k * r / tokens, shape)
        if fit is None:
            k //= 2
            continue
        recomputed = fit.layers_recomputed_whole(layers, memory.sizes.pp)
        prediction = memory.peak(tokens, k * r, fit.recompute, fit.recompute_layers, **shape,
                                 prompt_on_host=fit.prompt_on_host)
        settings.append(Setting(
            k, fit.recompute, fit.recompute_layers or 0, prediction.total_gib,
            useful_flops=sum(STEP_PASSES * cost.layout_flops(mb, predicting_rows=rows) for mb, rows in mbs),
            recompute_flops=sum(recomputed * cost.layer_flops(mb, layers) for mb, _ in mbs),
            prompt_on_host=fit.prompt_on_host,
        ))
        k //= 2
    return sorted(settings, key=lambda s: (s.executed_flops, -s.responses))


def _fit_or_none(memory: MemoryModel, budget: float, tokens: int, predicting_fraction: float, shape):
    """``memory.fit_holding_prompt`` (as the launch script's ``fit_within``); None where nothing fits."""
    try:
        return memory.fit_holding_prompt(budget, tokens, predicting_fraction, **shape)
    except ValueError:
        return None


class PolicyCache:
    """The benchmark's model with one recompute setting at a time: rebuilt only when it changes (a dense
    model in Megatron's DDP is freed when dropped)."""

    def __init__(self, card: str, args):
        self.card, self.args, self.key, self.policy = card, args, None, None

    def get(self, recompute: str, recompute_layers: int, prompt_on_host: bool = False):
        if self.key != (recompute, recompute_layers, prompt_on_host):
            self.policy = None
            free_memory()
            self.policy = policy_update.build_policy(policy_args(self.card, self.args, recompute, recompute_layers,
                                                                 prompt_on_host))
            self.key = (recompute, recompute_layers, prompt_on_host)
        return self.policy


def planning_models(card: str, args):
    """(memory model, cost model, memory budget) of a full-depth card on this device."""
    memory = MemoryModel.for_card(card, dtype=policy_update.DTYPES[args.dtype],
                                  transformer_engine=layer_spec(args, card)[0],
                                  fp8=args.fp8 != "off", offload=args.offload)
    if args.budget_gib is not None:
        budget = args.budget_gib * GIB
    else:
        budget = device_budget(margin=args.memory_margin) if args.device == "cuda" else CPU_BUDGET_GIB * GIB
    return memory, CostModel.from_config(memory.config, memory.vocab_size), budget


def bench_full_depth(card: str, workloads, args, peak_tflops: float) -> List[Result]:
    """Every workload on each of ``--layouts``, each at the first setting of ``candidate_settings`` that runs."""
    memory, cost, budget = planning_models(card, args)
    if "reuse" in args.layouts and layer_spec(args, card)[0]:
        raise SystemExit(f"--layouts reuse: prefix reuse runs on the local layer spec only, and {card} would build "
                         "Transformer Engine's here; pass --transformer-engine off (for every layout, to compare them)")
    vocab_size = load_card(card).config["vocab_size"]
    policies = PolicyCache(card, args)
    results = []
    for n, p, r in workloads:
        group = rollout_group(n, p, r, vocab_size, seed=n)
        rows = {layout: run_best_setting(policies, memory, cost, group, Result(card, memory.config.num_layers, n, p, r, layout),
                                         budget, args.replicated_repeats or args.repeats if layout == "replicated"
                                         else args.repeats, peak_tflops,
                                         sample=args.replicated_sample and layout == "replicated")
                for layout in LAYOUTS if layout in args.layouts}
        for layout, reference in (("packed", "replicated"), ("reuse", "packed")):
            if layout in rows and reference in rows:
                rows[layout].speedup = rows[reference].step_s / rows[layout].step_s
        results += rows.values()
        for result in rows.values():
            print(row(result), flush=True)
    return results


def run_best_setting(policies: PolicyCache, memory: MemoryModel, cost: CostModel, group: RolloutGroup, result: Result,
                     budget: float, repeats: int, peak_tflops: float, sample: bool = False) -> Result:
    """``result`` at the first of the layout's ranked settings whose steps fit; ``sample``: the step
    extrapolated from its first micro-batches (``extrapolated_steps``)."""
    workload = (result.n, result.p, result.r)
    for setting in candidate_settings(memory, cost, budget, workload, result.layout):
        # no local name for the policy: the next setting's rebuild frees it
        steps = steps_that_fit(policies.get(setting.recompute, setting.recompute_layers, setting.prompt_on_host), group,
                               result.layout, result.p + setting.responses * result.r, repeats,
                               f"{result.model} {result.layout} {workload}: {setting}",
                               sample_responses=setting.responses if sample else 0)
        if steps is not None:
            result.extrapolated = sample
            return measured_at(result, setting, steps, peak_tflops)
    print(f"  {result.model} {result.layout} {workload}: no setting fits", flush=True)
    return result


def steps_that_fit(policy, rollouts, layout: str, max_tokens: int, repeats: int, label: str, sample_responses: int = 0):
    """``run_steps`` (``extrapolated_steps`` with ``sample_responses`` a micro-batch), or None when
    they run out of memory."""
    # a setting's steps can take minutes at long contexts: say what runs, so a cut-off run still shows it
    print(f"  {label} at {max_tokens} tokens: running", flush=True)
    try:
        if sample_responses:
            return extrapolated_steps(policy, rollouts, max_tokens, repeats, sample_responses)
        return run_steps(policy, rollouts, layout, max_tokens, repeats)
    except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
        # torch's message says what was asked for, and how much is allocated against reserved
        reason = " ".join(str(err).split())[:400]
    # outside the except block: the exception's frames, which hold the activations, are gone
    print(f"  {label} at {max_tokens} tokens runs out of memory: {reason}", flush=True)
    free_memory()
    return None


def extrapolated_steps(policy, group: RolloutGroup, max_tokens: int, repeats: int, responses: int):
    """The replicated step of ``group``, in micro-batches of ``responses`` responses, from timed steps
    on its first one and two micro-batches: they all have one shape, so a step of M takes
    t1 + (M - 1) (t2 - t1), with what a step runs once (the optimizer's step) counted once; its FLOPs
    and rollout tokens are M times one micro-batch's, its peak the larger run's. For a step longer
    than a run may take (16 x 131,072 x 4,096 replicated: 4e17 FLOPs)."""
    n = len(group.responses)
    if n % responses:
        raise SystemExit(f"--replicated-sample needs micro-batches of one shape: {n} responses in parts of {responses}")
    count = n // responses
    sampled = [run_steps(policy, group.with_responses(range(m * responses)), "replicated", max_tokens, repeats)
               for m in ((1, 2) if count > 1 else (1,))]
    times = [statistics.median(s.seconds for s in steps) for steps in sampled]
    one, two = times[0], times[-1]
    first = sampled[0][0]
    print(f"  extrapolated from 1 and 2 of {count} micro-batches: {one:.4g} s and {two:.4g} s", flush=True)
    return [replace(first, seconds=one + (count - 1) * (two - one), flops=first.flops * count,
                    rollout_tokens=first.rollout_tokens * count, micro_batches=count,
                    peak_memory_gib=max(s.peak_memory_gib for steps in sampled for s in steps))]


def measured_at(result: Result, setting: Setting, steps, peak_tflops: float) -> Result:
    """``measured`` with the setting's recompute and the memory model's peak."""
    measured(result, setting.responses, steps, peak_tflops)
    result.recompute, result.recompute_layers = setting.recompute, setting.recompute_layers
    result.prompt_on_host = setting.prompt_on_host
    result.recompute_flops = setting.recompute_flops / setting.useful_flops
    result.predicted_gib = setting.predicted_gib
    # the row prints once every layout has run; say this one's numbers now, for a run cut off later
    stash = host_stash()
    host = (f", {stash.reserved_bytes / GIB:.1f} GiB page-locked on the host for {stash.taken_bytes / GIB:.1f} GiB of "
            "saved tensors" if setting.prompt_on_host else "")
    print(f"  measured: {result.step_s:.4g} s a step, {result.mfu:.1%} MFU, peak {result.peak_gib:.1f} GiB{host}", flush=True)
    return result


def agent_settings(memory: MemoryModel, cost: CostModel, budget: float, trajectories: List[Trajectory], layout: str
                   ) -> List[Tuple[int, int, Setting]]:
    """--agent's ``candidate_settings``: for every micro-batch budget (packed tokens: the whole tree,
    then halving) the least recompute that fits ``budget``, as (budget, tokens of the largest micro-batch
    in the layout, setting), fewest executed FLOPs first (ties: the larger micro-batch)."""
    layers = memory.config.num_layers
    settings = []
    max_tokens = plan_micro_batches(trajectories, 1 << 30).packed_tokens
    while max_tokens >= len(trajectories[0].tokens):
        mbs = [mb for mb in plan_micro_batches(trajectories, max_tokens).ranks[0] if not mb.is_padding]
        # per micro-batch: (layout, rows that predict a trained token: a shared one once when packed)
        parts = []
        for mb in mbs:
            batch = mb.pack()
            trained = ResponseTokens.of(batch)
            parts.append((batch.layout, trained.num_predictions) if layout == "packed" else
                         (batch.replicated().layout, trained.num_tokens))
        tokens, rows = max((part[0].total_tokens, part[1]) for part in parts)
        try:
            fit = memory.fit(budget, tokens, predicting_fraction=rows / tokens, num_micro_batches=len(mbs),
                             layout=layout)
        except ValueError:
            max_tokens //= 2
            continue
        recomputed = fit.layers_recomputed_whole(layers, memory.sizes.pp)
        prediction = memory.peak(tokens, rows, fit.recompute, fit.recompute_layers, len(mbs), layout=layout)
        settings.append((max_tokens, tokens, Setting(
            max(len(mb.trajectories) for mb in mbs), fit.recompute, fit.recompute_layers or 0, prediction.total_gib,
            useful_flops=sum(STEP_PASSES * cost.layout_flops(x, predicting_rows=r) for x, r in parts),
            recompute_flops=sum(recomputed * cost.layer_flops(x, layers) for x, _ in parts),
        )))
        max_tokens //= 2
    return sorted(settings, key=lambda s: (s[2].executed_flops, -s[0]))


def bench_agent(card: str, args, peak_tflops: float) -> List[Result]:
    """--agent: the packed prefix tree and the replicated trajectories, each at the first setting of
    ``agent_settings`` that runs."""
    prompt, pairs, turns, model, tool = TINY_AGENT if args.tiny else AGENT
    memory, cost, budget = planning_models(card, args)
    trajectories = agent_episodes(load_card(card).config["vocab_size"], 0, prompt, pairs, turns, model, tool)
    policies = PolicyCache(card, args)
    results = []
    for layout, repeats in (("packed", args.repeats), ("replicated", args.replicated_repeats or args.repeats)):
        result = Result(card, memory.config.num_layers, 2 * pairs, prompt, turns * (model + tool), layout,
                        workload="agent")
        for max_tokens, micro_batch_tokens, setting in agent_settings(memory, cost, budget, trajectories, layout):
            steps = steps_that_fit(policies.get(setting.recompute, setting.recompute_layers), trajectories, layout,
                                   max_tokens, repeats, f"{card} agent {layout}: {setting}")
            if steps is None:
                continue
            measured_at(result, setting, steps, peak_tflops)
            result.micro_batch_tokens, result.max_tokens = micro_batch_tokens, max_tokens
            break
        results.append(result)
    results[0].speedup = results[1].step_s / results[0].step_s
    for result in results:
        print(row(result), flush=True)
    return results


COLUMNS = ["model", "spec", "N", "P", "R", "layout", "mb resp", "mb tokens", "--max-tokens", "mbs", "recompute", "step s",
           "tok/s", "TFLOP/s", "MFU", "recompute FLOPs", "peak GiB", "predicted GiB", "speedup"]


def row(result: Result) -> str:
    recompute = setting_label(result.recompute, result.recompute_layers, result.prompt_on_host)
    cells = [result.model, result.spec, result.n, result.p, result.r, result.layout, result.micro_batch_responses or "oom",
             result.micro_batch_tokens, result.max_tokens, result.micro_batches, recompute,
             f"{result.step_s:.4g}" + " (extrapolated)" * result.extrapolated,
             f"{result.tokens_per_s:,.0f}", f"{result.tflops:.4g}", f"{100 * result.mfu:.1f}%",
             f"+{100 * result.recompute_flops:.1f}%", f"{result.peak_gib:.1f}", f"{result.predicted_gib:.1f}",
             "" if result.layout == "replicated" or math.isnan(result.speedup) else f"{result.speedup:.2f}x"]
    return " | ".join(str(c) for c in cells)


def read_results(path: Path) -> List[Result]:
    """The rows of a CSV that ``write_csv`` wrote."""
    types = {f.name: f.type for f in fields(Result)}
    cast = {"str": str, "int": int, "float": float, "bool": lambda text: text == "True"}
    with path.open(newline="") as f:
        return [Result(**{k: cast[types[k]](v) for k, v in row.items()}) for row in csv.DictReader(f)]


def updated(old: List[Result], new: List[Result]) -> List[Result]:
    """``old`` with the rows of every model in ``new`` replaced by ``new``'s, in place; models not in
    ``old`` go at the end."""
    remeasured = {(r.model, r.spec) for r in new}
    rows, done = [], set()
    for r in old:
        if (r.model, r.spec) not in remeasured:
            rows.append(r)
        elif (r.model, r.spec) not in done:
            rows += [n for n in new if (n.model, n.spec) == (r.model, r.spec)]
            done.add((r.model, r.spec))
    return rows + [n for n in new if (n.model, n.spec) not in done]


def write_csv(results: List[Result], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        for result in results:
            writer.writerow(asdict(result))


def peak_range(results: List[Result]) -> str:
    """The MFU title's ' (matmul peak A-B TFLOP/s)', over the rows' measured peaks: each run
    measures its own, and a title listing them all overflows."""
    peaks = [r.matmul_peak_tflops for r in results if r.matmul_peak_tflops > 0]
    if not peaks:
        return ""
    low, high = round(min(peaks)), round(max(peaks))
    return f" (matmul peak {low}{'' if low == high else f'-{high}'} TFLOP/s)"


def plot(results: List[Result], path: Path, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r.name, r.n, r.p, r.r) for r in results}, key=str)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    layouts = [layout for layout in LAYOUTS if any(r.layout == layout for r in results)]
    width = 0.8 / len(layouts)
    names = {"packed": "DualKV packed", "reuse": "DualKV packed, prefix reuse", "replicated": f"replicated, {baseline}"}
    for i, layout in enumerate(layouts):
        by_label = {(r.name, r.n, r.p, r.r): r for r in results if r.layout == layout}
        xs = [j + (i - (len(layouts) - 1) / 2) * width for j in range(len(labels))]
        name = names[layout]
        missing = Result("", 0, 0, 0, 0, layout)  # a layout not measured: no bar
        axes[0].bar(xs, [by_label.get(label, missing).tokens_per_s for label in labels], width, label=name)
        axes[1].bar(xs, [100 * by_label.get(label, missing).mfu for label in labels], width, label=name)
    for ax, title in zip(axes, ("rollout tokens / s (policy-update step)", f"MFU %{peak_range(results)}")):
        ax.set_xticks(range(len(labels)), [f"{m}\n{n} x {p} x {r}" for m, n, p, r in labels], fontsize=7, rotation=30,
                      ha="right")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def model_flags(args, name: str, out: Path) -> List[str]:
    """The flags of this run for model ``name`` alone, writing into ``out``."""
    flags = ["--device", args.device, "--dense-layers", str(args.dense_layers), "--moe-layers", str(args.moe_layers),
             "--repeats", str(args.repeats), "--models", name, "--out", str(out),
             "--memory-margin", str(args.memory_margin), "--transformer-engine", args.transformer_engine,
             "--fp8", args.fp8, "--layouts", ",".join(args.layouts)] + (
                 ["--workloads", ",".join("x".join(map(str, w)) for w in args.workloads)] if args.workloads else [])
    flags += ["--budget-gib", str(args.budget_gib)] if args.budget_gib is not None else []
    flags += ["--replicated-repeats", str(args.replicated_repeats)] if args.replicated_repeats else []
    flags += ["--replicated-sample"] * args.replicated_sample
    flags += ["--no-offload"] * (not args.offload)
    flags += ["--stack-dumps", str(args.stack_dumps)] if args.stack_dumps else []
    return flags + ["--tiny"] * args.tiny + ["--profile"] * args.profile + ["--full-depth"] * args.full_depth + [
        "--agent"] * args.agent + ["--verbose"] * args.verbose


def measure_alone(name: str, args) -> List[Result]:
    """Model ``name``'s rows, measured by this script in a process of its own. Measured after the MoE
    model in one process, the dense model found the MoE model's weights and optimizer state (57 GiB)
    still allocated, and its replicated baseline got half the micro-batch (PERF_NOTES.md, run CC):
    a stepped MoE model in Megatron's DDP is never freed (README, Embedding, Notes)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out if args.profile else Path(tmp)
        subprocess.run([sys.executable, __file__, *model_flags(args, name, out)], check=True)
        return [] if args.profile else read_results(out / table_name(args))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    use_expandable_segments()
    if args.stack_dumps:
        faulthandler.dump_traceback_later(args.stack_dumps, repeat=True)
    args.memory_margin = DEFAULT_MARGIN if args.memory_margin is None else args.memory_margin
    models, model_names = model_workloads(args), args.model_names
    if len(model_names) > 1:
        results = [r for name in model_names for r in measure_alone(name, args)]
        if not args.profile:
            write_results(results, args)
        return
    # Megatron's mixed-precision optimizer needs CUDA: the CPU dry run is float32.
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    peak = (policy_update.measure_matmul_tflops() if args.device == "cuda"
            else policy_update.measure_matmul_tflops(size=1024, device="cpu", dtype=torch.float32))
    print(f"measured {args.dtype} matmul peak: {peak:.4g} TFLOP/s", flush=True)
    if not args.profile:
        print(" | ".join(COLUMNS), flush=True)
    name = model_names[0]
    with tempfile.TemporaryDirectory() as tmp:
        card, layers = (name, None) if args.full_depth else models[name]
        if not args.full_depth:
            card = layer_card(card, layers, Path(tmp))
        workloads = args.workloads or (models[name] if args.full_depth else TINY_WORKLOADS if args.tiny else WORKLOADS)
        if args.profile:
            layout = args.layouts[0]
            setting = candidate_settings(*planning_models(card, args), workloads[0], layout) if args.full_depth else None
            profile_step(card, workloads[0], args, layout, setting[0] if setting else None)
            return
        if args.agent:
            results = bench_agent(card, args, peak)
        elif args.full_depth:
            results = bench_full_depth(card, workloads, args, peak)
        else:
            results = bench_model(card, layers, workloads, args, peak)
    for result in results:
        result.spec = policy_update.spec_name(args, card)
    write_results(results, args)


def table_name(args) -> str:
    if args.agent:
        return "policy_update_agent.csv"
    return "policy_update_full_depth.csv" if args.full_depth else "policy_update.csv"


def write_results(results: List[Result], args) -> None:
    """The CSV (``--update``'s table with these rows in, or a new one in ``--out``) and its plot."""
    csv_path = args.update or args.out / table_name(args)
    if args.update is not None:
        results = updated(read_results(args.update), results)
    write_csv(results, csv_path)
    plot(results, csv_path.with_suffix(".png"), "SDPA" if args.device == "cuda" else "Megatron's attention (CPU)")
    print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
