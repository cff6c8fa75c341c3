"""A/B of native-kernel sources on the GPU: variants of ``csrc/`` timed against each other.

Each variant is a source folder, e.g. another revision's (``ab/`` is ignored by git)::

    mkdir -p ab/new && git archive wip/branch csrc | tar -x -C ab/new
    python tools/ab_native.py --variants main=csrc,new=ab/new/csrc --workloads d128-16x8192x1024 --rounds 2 --test

and runs with this checkout's Python. A variant that changes the Python side too (the kernels'
arguments, say) is a whole tree instead, run with its own package, benchmark and tests::

    mkdir -p ab/new && git archive wip/branch | tar -x -C ab/new
    python tools/ab_native.py --variants main=.,new=ab/new --workloads d128-16x8192x1024 --rounds 2 --test

Every variant is built first (in parallel, under a name of its own: ``DUALKV_NATIVE_SOURCES``).
Then each round runs ``bench_attention.py --methods dualkv`` once per variant, each in its own
process, variants alternating, so that the card's clock and temperature drift over all of them
alike; differences below the spread of one variant's rounds are noise (PERF_NOTES.md). With
``--sustained S`` the rounds run ``bench_attention.py --sustained S`` instead (time, clock and
joules at the power limit). ``--test`` runs ``tests/test_dualkv_attn_sm90.py`` with each variant
(all at once, after the timing). Prints every round and the median per workload and variant, and
writes ``ab_native.csv`` into ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_dualkv.ops.dualkv_attn_sm90 import native_source_folder  # noqa: E402


@dataclass(frozen=True)
class Variant:
    csrc: Path  # the native sources it builds
    root: Path  # the tree whose package, benchmark and tests run it: this checkout, or its own


def parse_variants(text: str) -> dict:
    """``name=folder,...`` -> {name: Variant}; a folder is a csrc tree, or a whole checkout (a
    ``csrc/`` and a ``megatron_dualkv/`` beside it) that runs with its own Python."""
    variants = {}
    for spec in text.split(","):
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--variants: {spec!r} is not name=folder")
        if name in variants:
            raise ValueError(f"--variants: {name!r} given twice")
        tree = Path(folder).resolve()
        try:
            if (tree / "megatron_dualkv").is_dir():
                variants[name] = Variant(native_source_folder(tree / "csrc", "--variants"), tree)
            else:
                variants[name] = Variant(native_source_folder(folder, "--variants"), ROOT)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    return variants


def variant_env(v: Variant) -> dict:
    path = [str(v.root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "DUALKV_NATIVE_SOURCES": str(v.csrc), "PYTHONPATH": os.pathsep.join(path)}


def build(variants: dict) -> None:
    """Build every variant at once; stop at the first that does not build (a silent fallback to
    the Triton kernels would make the A/B compare the wrong thing)."""
    check = "from megatron_dualkv.ops.dualkv_attn_sm90 import _extension; assert _extension() is not None"
    start = time.time()
    procs = {name: subprocess.Popen([sys.executable, "-c", check], env=variant_env(v), cwd=v.root,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, v in variants.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"variant {name!r} did not build:\n{out[-3000:]}")
    print(f"built {', '.join(variants)} in {time.time() - start:.0f} s", flush=True)


def bench_round(name: str, v: Variant, workloads: str, sustained: float, tmp: Path) -> list:
    out = tmp / name
    cmd = [sys.executable, str(v.root / "tools" / "bench_attention.py"), "--workloads", workloads, "--methods", "dualkv",
           "--out", str(out)]
    if sustained:
        cmd += ["--sustained", str(sustained)]
    subprocess.run(cmd, env=variant_env(v), cwd=v.root, check=True, stdout=subprocess.DEVNULL)
    with open(out / ("attention_sustained.csv" if sustained else "attention.csv")) as f:
        return [row for row in csv.DictReader(f)]


def run_tests(variants: dict) -> None:
    procs = {name: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     str(v.root / "tests" / "test_dualkv_attn_sm90.py")], env=variant_env(v),
                                    cwd=v.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, v in variants.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        print(f"tests with {name}: {out.strip().splitlines()[-1] if out.strip() else proc.returncode}", flush=True)


def report(rows: list, variants: dict, time_key: str, out: str) -> None:
    """The median per workload and variant, printed, and every round as CSV in ``out``."""
    print()
    for workload in dict.fromkeys(row["workload"] for row in rows):
        for name in variants:
            times = [float(row[time_key]) for row in rows if row["workload"] == workload and row["variant"] == name]
            print(f"{workload:22s} {name:20s} median {statistics.median(times):9.3f} ms  rounds "
                  + " ".join(f"{t:.3f}" for t in times))
    os.makedirs(out, exist_ok=True)
    path = Path(out) / "ab_native.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)
    print(f"CSV: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", required=True,
                        help="name=folder,...: csrc folders, or whole checkouts (two or more, or one with --test)")
    parser.add_argument("--workloads", default="d128-16x8192x1024", help="bench_attention.py workload names")
    parser.add_argument("--rounds", type=int, default=2, help="0: build (and --test) only")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="time with bench_attention.py --sustained SECONDS (clock and joules too)")
    parser.add_argument("--test", action="store_true", help="also run tests/test_dualkv_attn_sm90.py with each variant")
    parser.add_argument("--out", default="bench")
    args = parser.parse_args()
    try:
        variants = parse_variants(args.variants)
    except ValueError as e:
        parser.error(str(e))
    build(variants)
    time_key = "ms" if args.sustained else "fwd_bwd_ms"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, v in variants.items():
                for row in bench_round(name, v, args.workloads, args.sustained, Path(tmp) / f"round{r}"):
                    if row.get("error"):
                        raise SystemExit(f"variant {name!r} failed on {row['workload']}: {row['error']}")
                    rows.append({"round": r, "variant": name, **row})
                    extra = f"  {float(row['clock_mhz']):.0f} MHz {float(row['joules']):.2f} J" if args.sustained else \
                        f"  (fwd {float(row['fwd_ms']):.3f})"
                    print(f"round {r} {row['workload']:22s} {name:20s} {float(row[time_key]):9.3f} ms{extra}", flush=True)
    if rows:
        report(rows, variants, time_key, args.out)
    if args.test:
        run_tests(variants)


if __name__ == "__main__":
    main()
