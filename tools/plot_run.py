"""A PNG of a training run's curves, from the launch script's --log-jsonl file or --tensorboard-dir folder.

    python tools/plot_run.py run.jsonl                     # -> run.png
    python tools/plot_run.py tb/ --out curves.png          # a TensorBoard event folder
    python tools/plot_run.py run.jsonl --metrics loss,reward,kl

One panel per metric, against the step: the per-step records (``kind: step`` lines; the
TensorBoard scalars without the ``update/`` prefix), under the names of
``megatron_dualkv.run_log.METRICS``. A metric the run did not log is left out. Of a JSONL file that
holds several runs (the launch script writes a file anew, but a resumed run appends, and so may an
older version) the last is drawn, with the steps it resumed after, and the tool says so.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from megatron_dualkv.run_log import METRICS, UPDATE_PREFIX  # noqa: E402
from megatron_dualkv.cli import ArgumentParser, exit_with_error  # noqa: E402
from tool_args import comma_names  # noqa: E402

DEFAULT_METRICS = ("loss", "reward", "margin", "clip_fraction", "ratio", "kl", "entropy", "rollout_mismatch", "lr",
                   "tokens_per_s")
Curves = Dict[str, List[Tuple[int, float]]]  # metric -> (step, value), in step order


def read_jsonl(path: Path) -> Curves:
    """The per-step metrics of the last run in a --log-jsonl file: a run that resumed another takes
    that run's steps before its first."""
    runs = jsonl_runs(path)
    by_step: Dict[int, dict] = {}
    for run in runs:  # a later run's steps replace the earlier runs' from its first step on
        by_step = {step: record for step, record in by_step.items() if step < run[0]["step"]}
        by_step.update((record["step"], record) for record in run)
    if len(runs) > 1:
        steps = sorted(by_step)
        print(f"{path} holds {len(runs)} runs: plotting the last, steps {steps[0]}-{steps[-1]}")
    return {name: [(step, by_step[step][name]) for step in sorted(by_step) if name in by_step[step]] for name in METRICS}


def jsonl_runs(path: Path) -> List[List[dict]]:
    """The step records of a --log-jsonl file, run by run: a run starts where the step does not grow
    (a rerun appended to the file, or a run resumed from an earlier step)."""
    runs: List[List[dict]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if record.get("kind") != "step":
            continue
        if not runs or record["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(record)
    return runs


def read_tensorboard(folder: Path) -> Curves:
    """The per-step scalars of a --tensorboard-dir folder (all its event files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = set(events.Tags()["scalars"])
    curves = {}
    for name, tag in METRICS.items():
        if tag in tags and not tag.startswith(UPDATE_PREFIX):
            last = {event.step: event.value for event in events.Scalars(tag)}
            curves[name] = sorted(last.items())
    return curves


def read_run(path: Path) -> Curves:
    """A JSONL log file or a TensorBoard event folder; only the metrics it has."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    curves = read_tensorboard(path) if path.is_dir() else read_jsonl(path)
    curves = {name: points for name, points in curves.items() if points}
    if not curves:
        raise ValueError(f"{path}: no per-step metrics "
                         "(a --log-jsonl file or a --tensorboard-dir folder of the launch script)")
    return curves


def plot(curves: Curves, metrics: Sequence[str], out: Path, title: str) -> List[str]:
    """One panel per metric of ``metrics`` that ``curves`` has; the metrics drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [name for name in metrics if name in curves]
    if not drawn:
        raise ValueError(f"none of {list(metrics)} was logged; the run has {sorted(curves)}")
    columns = min(3, len(drawn))
    rows = math.ceil(len(drawn) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, drawn):
        steps, values = zip(*curves[name])
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name if name == METRICS[name] else f"{name} ({METRICS[name]})", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a --log-jsonl file or a --tensorboard-dir folder")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: next to the run, <name>.png)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help=f"comma-separated, of {', '.join(METRICS)}")
    args = parser.parse_args(argv)
    metrics = comma_names(parser, "--metrics", args.metrics, METRICS)
    out = args.out or args.run.with_name(args.run.stem + ".png")
    try:
        drawn = plot(read_run(args.run), metrics, out, str(args.run))
    except ValueError as err:
        exit_with_error(str(err))
    print(f"wrote {out} ({', '.join(drawn)})")


if __name__ == "__main__":
    main()
