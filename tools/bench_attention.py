"""DualKV attention benchmark: our kernels (default backend, the Triton kernels alone, and prefix
reuse's op with the prompt's K/V held apart) vs FlexAttention (same mask, packed layout; its Triton
kernel, and FlashAttention-4 as its FLASH backend) vs PyTorch SDPA (cuDNN / flash /
memory-efficient) and FlashAttention-4's own causal and varlen kernels on the replicated layout. FA4
(``flash-attn-4``) is optional: without it its rows say so.

Workloads: one prompt and N responses (depth 1), and prefix trees of trajectories (issue #31):
agent episodes, a tree search, and depth 1 given as trajectories (``-tree-`` names), packed by
``pack_trajectories``; FlexAttention runs their ancestor mask on the same packed layout, SDPA every
trajectory as one causal sequence.

For each workload: median forward and forward+backward time, useful TFLOP/s (only the (query,
key) pairs the mask allows: 4*D*Hq FLOPs per pair forward, 2.5x that backward) and peak memory
above the inputs. Prints a table, writes CSV and a PNG plot.

    python tools/bench_attention.py --out bench/            # all workloads, all methods
    python tools/bench_attention.py --tune fwd,dq,dkdv --workloads d128-16x8192x1024   # sweep block configs
    python tools/bench_attention.py --sustained 6 --methods dualkv,flex --workloads d128-16x8192x1024
    python tools/bench_attention.py --profile --methods dualkv --workloads d128-16x8192x1024

``--sustained S`` runs each method's forward+backward back to back for S seconds instead, with
``nvidia-smi`` sampling the SM clock and board power: under these kernels an H200 sits at its
power limit and lowers its clock, so the time ratio of two methods is their energy ratio, not their
cycle ratio (PERF_NOTES.md, run AY). The table gives ms per iteration over the last two thirds of
the loop, the median clock and power there, and from them cycles and joules per iteration.

``--profile`` instead times ten forward+backward calls the way the table does (L2 flushed before
each) under ``torch.profiler`` and prints each kernel's time per call, and the time per call that
the GPU spends idle between the first kernel and the last (host time the kernels wait for).

``--ncu-range`` runs one forward+backward call of each method, after two warm-up calls (compilation,
autotuning), inside a CUDA profiler range, for Nsight Compute to read only those kernels:

    ncu --profile-from-start off --clock-control none --set full -o ours python tools/bench_attention.py \\
        --ncu-range --methods dualkv --workloads d128-16x8192x1024
"""
from __future__ import annotations

import argparse
import csv
import functools
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime

import torch
import torch.nn.functional as F

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]  # the other tools, the package; also when imported by path
from megatron_dualkv import (DualKVLayout, PackedLayout, PrefixedLayout, Trajectory, dualkv_attn_func,  # noqa: E402
                             dualkv_prefix_attn_func, pack_trajectories)
from megatron_dualkv.ops import dualkv_attn as kernels  # noqa: E402
from megatron_dualkv.cli import ArgumentParser, exit_with_error  # noqa: E402
from tool_args import comma_names  # noqa: E402  (tools/ is on sys.path when run as a script)


@dataclass(frozen=True)
class Workload:
    name: str
    n: int
    p: int
    r: int
    hq: int
    hkv: int
    d: int
    window: int | None = None

    def layout(self, device="cuda") -> DualKVLayout:
        return DualKVLayout((self.p,), ((self.r,) * self.n,)).to(device)

    def prefixed_layout(self, device="cuda") -> PrefixedLayout:
        """The N responses against their prompt's K/V held apart (prefix reuse's layout, one part)."""
        return PrefixedLayout((self.p,), ((self.r,) * self.n,)).to(device)

    def replicated_index(self, device="cuda") -> torch.Tensor:
        """(N, P + R) packed index of each replicated sequence ``[P][R_i]``."""
        return torch.stack([torch.cat([torch.arange(self.p), self.p + i * self.r + torch.arange(self.r)])
                            for i in range(self.n)]).to(device)


@dataclass(frozen=True)
class TreeWorkload:
    """A prefix tree of trajectories: a prompt, then per level ``(branching, segment length)``,
    every leaf's path one trajectory (random tokens; siblings start with distinct ones)."""

    name: str
    prompt: int
    levels: tuple
    hq: int
    hkv: int
    d: int
    window: int | None = None

    def trajectories(self):
        g = torch.Generator().manual_seed(0)
        paths = [torch.randint(0, 30000, (self.prompt,), generator=g)]
        for branching, length in self.levels:
            paths = [torch.cat([path, torch.tensor([30000 + i]), torch.randint(0, 30000, (length - 1,), generator=g)])
                     for path in paths for i in range(branching)]
        return [Trajectory(path) for path in paths]

    def layout(self, device="cuda") -> PackedLayout:
        return _packed(self).layout.to(device)

    def replicated_index(self, device="cuda") -> torch.Tensor:
        """(N, L) packed index of each trajectory (all of one length here)."""
        return torch.stack(_packed(self).trajectory_index).to(device)


@functools.cache
def _packed(w: TreeWorkload):
    return pack_trajectories(w.trajectories())


WORKLOADS = [
    Workload("d128-16x8192x1024", 16, 8192, 1024, 32, 8, 128),
    Workload("d128-32x8192x512", 32, 8192, 512, 32, 8, 128),
    Workload("d128-8x4096x4096", 8, 4096, 4096, 32, 8, 128),
    # N = 1 is one plain causal sequence of 16,384, the same mask for every method: SDPA's rate there
    # is the vendor kernels' rate on the simplest mask, a reference for ours
    Workload("d128-1x8192x8192", 1, 8192, 8192, 32, 8, 128),
    Workload("d256-16x8192x1024", 16, 8192, 1024, 16, 8, 256),
    Workload("d512-16x8192x1024", 16, 8192, 1024, 32, 16, 512),
    # a Gemma 4 sliding layer's attention: the window cuts the prompt keys the responses see
    Workload("d256w1024-16x8192x1024", 16, 8192, 1024, 32, 16, 256, window=1024),
    # (a) agent episodes: a 4096-token prompt, 8 trajectories of 4 turns (512 model tokens, then 512
    # tool tokens), sharing their first turn in pairs: 32,768 packed tokens for 65,536
    TreeWorkload("d128-tree-agent", 4096, ((4, 1024), (2, 3072)), 32, 8, 128),
    # (b) tree search: a 2048-token prompt, branching 4 for 3 levels of 512-token segments (84)
    TreeWorkload("d128-tree-search", 2048, ((4, 512), (4, 512), (4, 512)), 32, 8, 128),
    # (c) depth 1 given as trajectories: the tables, and so the time, of d128-16x8192x1024
    TreeWorkload("d128-tree-16x8192x1024", 8192, ((16, 1024),), 32, 8, 128),
]
# smaller shapes with the same per-block behaviour, so a config sweep fits a lease
TUNING_WORKLOADS = [
    Workload("tune-d64-16x8192x1024", 16, 8192, 1024, 32, 8, 64),
    Workload("tune-d256-4x8192x1024", 4, 8192, 1024, 16, 8, 256),
    Workload("tune-d512-4x4096x1024", 4, 4096, 1024, 32, 16, 512),
]
# "dualkv": the default backend (native sm_90 kernels where they apply, else Triton); "dualkv_triton": Triton only;
# "dualkv_prefix": prefix reuse's op (depth 1), the responses against the prompt's K/V held apart, its useful
# pairs the responses' alone (the prompt's own forward is not in it)
# "fa4_flex": FlexAttention's FLASH backend (FA4 with the block mask); "fa4_causal" / "fa4_varlen": FA4's
# own kernels on the replicated layout, as a batch of equal-length sequences / concatenated with cu_seqlens
METHODS = ["dualkv", "dualkv_triton", "dualkv_prefix", "flex", "fa4_flex", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient",
           "fa4_causal", "fa4_varlen"]
TUNED_PASSES = ["fwd", "dq", "dkdv", "dkdv_window", "fused"]


def bench(fn, grad_to_none=None) -> float:
    import triton.testing

    # warmup and rep are milliseconds: enough for ~25 timed runs of a 20 ms fwd+bwd, after the
    # GPU has left its idle clocks (PERF_NOTES.md, session 5, run Z)
    return triton.testing.do_bench(fn, warmup=300, rep=500, grad_to_none=grad_to_none, return_mode="median")


def sbhd_attention(query, key, value, attend, repeat_kv: bool = True):
    """A Megatron core attention's ``[s, b, heads, d]`` q/k/v -> ``attend(q, k, v)`` on
    ``[b, heads, s, d]`` (K/V heads repeated for GQA unless ``repeat_kv`` is off) -> ``[s, b, heads * d]``:
    the baselines of the model-level benchmarks run through this."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    if repeat_kv:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    out = attend(q, k, v)
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def describe(w) -> dict:
    """A workload's layout on the CPU: packed and replicated tokens, attention pairs, segments, the
    most ancestor pieces a query tile reads (more than one: the forward's multi-range tiles)."""
    layout = w.layout("cpu")
    replicated = w.replicated_index("cpu").numel()
    return dict(workload=w.name, tokens=layout.total_tokens, replicated_tokens=replicated,
                rho=round(replicated / layout.total_tokens, 3), pairs=layout.attention_pairs(w.window),
                segments=len(layout.nodes), max_pieces=max(map(len, kernels.ancestor_pieces(layout))))


def inputs(w, dtype=torch.bfloat16):
    T = w.layout().total_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, h, w.d, device="cuda", dtype=dtype, generator=g) for h in (w.hq, w.hkv, w.hkv))
    return q, k, v


def flex_mask_mod(layout: PackedLayout, window: int | None):
    """FlexAttention's ``mask_mod`` of the layout's rule, on the layout's device. A DualKV layout:
    same group, a prompt key or the query's own segment, causal positions. A tree: the TRL-style
    ancestor interval test, the key's segment's subtree range holding the query, causal positions."""
    device = layout.device
    lens = torch.tensor([n.length for n in layout.nodes], device=device)
    seg = torch.repeat_interleave(torch.arange(len(layout.nodes), device=device), lens)
    pos, window = layout.position_ids, window or 2**30
    if isinstance(layout, DualKVLayout):
        group, prompt = layout.segment_group[seg], layout.segment_is_prompt[seg]

        def mask_mod(b, h, qi, ki):
            return ((group[qi] == group[ki]) & (prompt[ki] | (seg[qi] == seg[ki])) & (pos[ki] <= pos[qi])
                    & (pos[qi] - pos[ki] < window))

        return mask_mod
    first = torch.tensor([n.start for n in layout.nodes], device=device)[seg]
    end = torch.tensor([n.subtree_end for n in layout.nodes], device=device)[seg]

    def mask_mod(b, h, qi, ki):
        return (first[ki] <= qi) & (qi < end[ki]) & (pos[ki] <= pos[qi]) & (pos[qi] - pos[ki] < window)

    return mask_mod


def method_fn(method: str, w, layout: PackedLayout, q, k, v):
    """(callable that returns the output, leaf tensors to differentiate). Setup is not timed."""
    if method in ("dualkv", "dualkv_triton"):
        backend = "auto" if method == "dualkv" else "triton"
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        return (lambda: dualkv_attn_func(*x, layout, window_size=w.window, backend=backend)), x
    if method == "dualkv_prefix":
        if not isinstance(w, Workload):
            raise ValueError("dualkv_prefix runs the depth-1 workloads (one prompt held apart)")
        x = [t[w.p:].clone().requires_grad_() for t in (q, k, v)] + [t[:w.p].clone().requires_grad_() for t in (k, v)]
        held = w.prefixed_layout(layout.device)
        return (lambda: dualkv_prefix_attn_func(*x, held, window_size=w.window)), x
    if method in ("flex", "fa4_flex"):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        T = layout.total_tokens
        block_mask = create_block_mask(flex_mask_mod(layout, w.window), None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        options = {"BACKEND": "FLASH" if method == "fa4_flex" else "TRITON"}
        x = [t.transpose(0, 1).unsqueeze(0).clone().requires_grad_() for t in (q, k, v)]
        return (lambda: flex(*x, block_mask=block_mask, enable_gqa=True, kernel_options=options)), x
    index = w.replicated_index()
    if method in ("fa4_causal", "fa4_varlen"):
        return fa4_replicated(method, w, index, q, k, v)
    # SDPA on the replicated layout: N sequences [P][R_i] (or N trajectories), kv heads expanded
    # (SDPA backends need it)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[method]
    rep = w.hq // w.hkv
    x = [t[index.flatten()].view(*index.shape, t.shape[1], w.d).repeat_interleave(rep if t is not q else 1, 2)
         .transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*x, is_causal=True)

    return run, x


def cumulative_lengths(index: torch.Tensor) -> torch.Tensor:
    """(N + 1,) int32 starts of the N replicated sequences of ``index`` (N, L), concatenated."""
    n, length = index.shape
    return torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=index.device)


def fa4_window(window: int | None) -> tuple:
    """FA4's (left, right) window of ours: a key at most ``window - 1`` positions back."""
    return (None if window is None else window - 1, 0)


def fa4_replicated(method: str, w, index: torch.Tensor, q, k, v):
    """FA4's causal kernel on the replicated layout's (N, L) batch, or its varlen kernel on the N
    sequences concatenated; K/V heads as they are (FA4 takes GQA)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError as err:
        raise RuntimeError("FlashAttention-4 is not installed (pip install flash-attn-4)") from err
    x = [t[index.flatten()].contiguous().requires_grad_() for t in (q, k, v)]
    window = fa4_window(w.window)
    if method == "fa4_causal":
        return (lambda: flash_attn_func(*(t.view(*index.shape, *t.shape[1:]) for t in x), causal=True,
                                        window_size=window)[0]), x
    starts, length = cumulative_lengths(index), index.shape[1]
    return (lambda: flash_attn_varlen_func(*x, cu_seqlens_q=starts, cu_seqlens_k=starts, max_seqlen_q=length,
                                           max_seqlen_k=length, causal=True, window_size=window)[0]), x


def prepared(method: str, w: Workload):
    """(layout, the call returning the output, its leaf tensors, an output gradient) of one method
    on one workload's random inputs."""
    layout = w.layout()
    q, k, v = inputs(w)
    fn, leaves = method_fn(method, w, layout, q, k, v)
    return layout, fn, leaves, torch.randn_like(fn())


def measure(method: str, w: Workload):
    layout, fn, leaves, dout = prepared(method, w)

    def fwd_bwd():
        fn().backward(dout)

    fwd_bwd()
    torch.cuda.synchronize()
    fwd_ms = bench(fn)
    fwd_bwd_ms = bench(fwd_bwd, grad_to_none=leaves)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    useful = w.prefixed_layout("cpu") if method == "dualkv_prefix" else layout
    flops = 4 * w.d * w.hq * useful.attention_pairs(w.window)
    return dict(workload=w.name, method=method, fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms,
                fwd_tflops=flops / fwd_ms / 1e9, fwd_bwd_tflops=3.5 * flops / fwd_bwd_ms / 1e9, peak_gib=peak_gib)


def candidates(pass_name: str, d: int):
    """Block configs worth trying for one pass: large query blocks for fwd/dQ, large key tiles for dK/dV.
    "fused": configs of the dK/dV pass that also accumulates dQ ("dkdv_dq"), fewer of them (each
    compiles the largest kernel)."""
    if pass_name == "fused":
        blocks = ((64, 64), (64, 128), (32, 128)) if d <= 128 else ((32, 64), (64, 64), (32, 32))
        return [kernels.KernelConfig(bm, bn, warps, 2) for (bm, bn), warps in itertools.product(blocks, (4, 8))]
    big, small = ((128, 64), (32, 64)) if d <= 128 else ((64,), (16, 32))
    if pass_name in ("dkdv", "dkdv_window"):
        blocks = itertools.product(small, (64, 128) if d <= 128 else (32, 64))
    else:
        blocks = itertools.product(big, (32, 64, 128) if d <= 128 else (32, 64))
    return [kernels.KernelConfig(bm, bn, warps, stages)
            for (bm, bn), warps, stages in itertools.product(blocks, (4, 8), (2, 3) if d <= 256 else (1, 2))]


def parse_config(text: str):
    """'64,128,8,3' or '64,128,8,3,1' (TMA loads on) -> KernelConfig."""
    fields = [int(x) for x in text.split(",")]
    return kernels.KernelConfig(*fields[:4], *(bool(x) for x in fields[4:5]))


def tune(w: Workload, passes, configs=None):
    """Time each candidate config of each pass on one workload (the other passes at their defaults),
    and check that its output and gradients agree with the default configs' (a block-shape bug would
    otherwise look like a speedup)."""
    layout = w.layout()
    q, k, v = inputs(w)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def forward():
        return dualkv_attn_func(*x, layout, window_size=w.window, backend="triton")

    def results():
        o = forward()
        return o, (o, *torch.autograd.grad(o, x, dout, retain_graph=True))

    expected = results()[1]
    defaults = dict(kernels.GPU_CONFIGS)
    for pass_name in passes:
        timings = []
        for cfg in configs or candidates(pass_name, w.d):
            # "fused" times the dK/dV pass that accumulates dQ, the others the separate passes
            kernels.GPU_CONFIGS["dkdv_dq"] = ((1 << 20, cfg if pass_name == "fused" else None),)
            if pass_name != "fused":
                kernels.GPU_CONFIGS[pass_name] = ((1 << 20, cfg),)
            try:
                o, got = results()
                if pass_name == "fwd":
                    ms = bench(forward)
                else:
                    ms = bench(lambda: torch.autograd.grad(o, x, dout, retain_graph=True))
            except Exception as e:  # noqa: BLE001 - out of shared memory and the like: skip the config
                print(f"{w.name} {pass_name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                kernels.GPU_CONFIGS.update(defaults)
            diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected))
            agrees = diff < 2e-2
            if agrees:
                timings.append((ms, cfg))
            print(f"{w.name} {pass_name} {cfg}: {ms:.2f} ms, max relative difference to the defaults {diff:.1e}"
                  f"{'' if agrees else ' DIFFERS: not a candidate'}", flush=True)
        if timings:
            ms, cfg = min(timings, key=lambda t: t[0])
            print(f"BEST {w.name} {pass_name}: {cfg} {ms:.2f} ms ({'fwd' if pass_name == 'fwd' else 'bwd'} time)")


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [next((r["fwd_bwd_tflops"] for r in rows if r["workload"] == wl and r["method"] == m), 0)
                for wl in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads, rotation=15)
    ax.set_ylabel("useful TFLOP/s (fwd+bwd)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the axes: never over a bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class GpuSampler:
    """``nvidia-smi`` sampling (time, SM clock MHz, board power W) every 100 ms in the background.
    Its timestamps are the machine's local time, as ``datetime.now()``."""

    def __init__(self):
        if shutil.which("nvidia-smi") is None:
            exit_with_error("--sustained reads the clock and power with nvidia-smi, which is not on PATH")
        # the UUID names this process's GPU whatever CUDA_VISIBLE_DEVICES renumbered
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        gpu = f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100",
             f"--id={gpu}"], stdout=subprocess.PIPE, text=True)

    def stop(self):
        self.proc.terminate()
        samples = []
        for line in self.proc.stdout.read().splitlines():
            stamp, clock, power = (field.strip() for field in line.split(","))
            try:
                samples.append((datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f"), float(clock), float(power)))
            except ValueError:  # "[N/A]" while the driver has no reading
                continue
        return samples


def fresh_fwd_bwd(method: str, w: Workload):
    """One method's forward+backward on one workload's inputs, as a call that drops the last call's
    gradients first (so that none accumulate)."""
    _, fn, leaves, dout = prepared(method, w)

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        fn().backward(dout)

    return fwd_bwd


def profile_calls(method: str, w: Workload, calls: int = 10) -> None:
    """Kernel time per forward+backward call, and the GPU's idle time per call between kernels."""
    from torch.profiler import ProfilerActivity, profile

    fwd_bwd = fresh_fwd_bwd(method, w)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # as triton.testing.do_bench

    def call():
        flush.zero_()
        fwd_bwd()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    span_us = kernels[-1].time_range.end - kernels[0].time_range.start
    print(f"{w.name} {method}: per call {span_us / calls / 1e3:.3f} ms from the first kernel to the last, "
          f"of which kernels {busy_us / calls / 1e3:.3f} ms, idle {(span_us - busy_us) / calls / 1e3:.3f} ms "
          "(the L2 flush included)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=120), flush=True)


def profiled_call(method: str, w: Workload) -> None:
    """One forward+backward call inside a CUDA profiler range (``ncu --profile-from-start off``)."""
    fwd_bwd = fresh_fwd_bwd(method, w)
    for _ in range(2):
        fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def sustained(method: str, w: Workload, seconds: float):
    """Forward+backward back to back for ``seconds``; the last two thirds are timed, so that the
    clock has settled. Returns the row and that window (start, end) as ``datetime``s."""
    fwd_bwd = fresh_fwd_bwd(method, w)

    def loop_until(deadline):
        # the host stays at most two iterations ahead: the GPU never idles, and the host's clock
        # (the window) is the GPU's to within two iterations
        iterations, queued = 0, []
        while time.monotonic() < deadline:
            fwd_bwd()
            iterations += 1
            queued.append(torch.cuda.Event())
            queued[-1].record()
            if len(queued) > 2:
                queued.pop(0).synchronize()
        torch.cuda.synchronize()
        return iterations

    fwd_bwd()
    torch.cuda.synchronize()
    end = time.monotonic() + seconds
    loop_until(end - 2 * seconds / 3)
    start_time = datetime.now()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    iterations = loop_until(end)
    last.record()
    torch.cuda.synchronize()
    return dict(workload=w.name, method=method, ms=first.elapsed_time(last) / iterations), (start_time, datetime.now())


def run_sustained(workloads, methods, seconds: float, out: str):
    sampler = GpuSampler()
    rows, windows = [], []
    for w in workloads:
        for method in methods:
            try:
                row, window = sustained(method, w, seconds)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run a shape is a result too
                row, window = dict(workload=w.name, method=method, error=f"{type(e).__name__}: {str(e)[:80]}"), None
            rows.append(row)
            windows.append(window)
            torch.cuda.empty_cache()
            time.sleep(1.0)  # let the clock recover a little between methods, as between benchmark runs
    samples = sampler.stop()
    for row, window in zip(rows, windows):
        if "error" in row:
            continue
        inside = [(clock, power) for t, clock, power in samples if window[0] <= t <= window[1]]
        if not inside:
            row["error"] = "no nvidia-smi samples in the timed window"
            continue
        row["clock_mhz"] = statistics.median(clock for clock, _ in inside)
        row["power_w"] = statistics.median(power for _, power in inside)
        row["mcycles"] = row["ms"] * row["clock_mhz"] / 1e3
        row["joules"] = row["ms"] * row["power_w"] / 1e3
    os.makedirs(out, exist_ok=True)
    write_table(rows, os.path.join(out, "attention_sustained.csv"), [
        ("workload", "workload", "22"), ("method", "method", "15"), ("ms", "ms / iter", "10.2f"),
        ("clock_mhz", "SM MHz", "7.0f"), ("power_w", "power W", "8.0f"), ("mcycles", "Mcycles", "8.1f"),
        ("joules", "joules", "7.2f")])


def write_table(rows, path, columns):
    """``rows`` as CSV at ``path`` (None: no CSV) and as a printed table. ``columns``: (key, title,
    format spec) in order, then an "error" column; a spec with a precision ("8.2f") marks a measured
    value, and a failed row prints its other columns and the error instead."""
    if path is not None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, [key for key, _, _ in columns] + ["error"])
            writer.writeheader()
            writer.writerows(rows)
    labels = [(key, spec) for key, _, spec in columns if "." not in spec]

    def aligned(key, title, spec):  # titles align like their values: text left, numbers right
        text = not rows or isinstance(rows[0].get(key), str)
        return f"{title:{'<' if text and '.' not in spec else '>'}{spec.split('.')[0]}}"

    print(" ".join(aligned(*column) for column in columns))
    for r in rows:
        label = " ".join(format(r[key], spec) for key, spec in labels)
        if "error" in r:
            print(f"{label} failed: {r['error']}")
        else:
            print(" ".join(format(r[key], spec) for key, _, spec in columns))


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="bench")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="instead of the table: each method's fwd+bwd back to back for SECONDS, with clock and power")
    parser.add_argument("--tune", default="", help="comma list of passes whose configs to sweep instead: "
                        + ",".join(TUNED_PASSES) + " (dkdv_window: the dK/dV pass of workloads with a window)")
    parser.add_argument("--configs", default="", help="with --tune: these configs instead of the built-in candidates, "
                        "'block_m,block_n,warps,stages[,tma]' separated by ';'")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: kernel times and idle GPU time per fwd+bwd call (torch.profiler)")
    parser.add_argument("--ncu-range", action="store_true",
                        help="instead of the table: one fwd+bwd call of each method in a CUDA profiler range, for ncu")
    parser.add_argument("--dry-run", action="store_true",
                        help="instead of the table: each workload's layout (tokens, pairs, pieces), built on the CPU")
    args = parser.parse_args()
    known = {w.name: w for w in WORKLOADS + TUNING_WORKLOADS}
    workloads = [known[name] for name in comma_names(parser, "--workloads", args.workloads, known)]
    methods = comma_names(parser, "--methods", args.methods, METHODS)
    if args.dry_run:
        for w in workloads:
            print(describe(w), flush=True)
        return
    if args.profile or args.ncu_range:
        for w, method in itertools.product(workloads, methods):
            (profile_calls if args.profile else profiled_call)(method, w)
        return
    if args.sustained:
        run_sustained(workloads, methods, args.sustained, args.out)
        return
    if args.tune:
        passes = comma_names(parser, "--tune", args.tune, TUNED_PASSES)
        configs = [parse_config(c) for c in args.configs.split(";") if c]
        for w in workloads:
            tune(w, passes, configs)
        return
    rows = []
    for w in workloads:
        for method in methods:
            try:
                row = measure(method, w)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run a shape is a result too
                row = dict(workload=w.name, method=method, error=f"{type(e).__name__}: {str(e)[:80]}")
            rows.append(row)
            torch.cuda.empty_cache()
            print(row, flush=True)
    os.makedirs(args.out, exist_ok=True)
    plot([r for r in rows if "error" not in r], os.path.join(args.out, "attention.png"),
         f"DualKV attention, {torch.cuda.get_device_name()}")
    print()
    write_table(rows, os.path.join(args.out, "attention.csv"), [
        ("workload", "workload", "22"), ("method", "method", "15"), ("fwd_ms", "fwd ms", "8.2f"),
        ("fwd_bwd_ms", "fwd+bwd ms", "11.2f"), ("fwd_tflops", "TFLOP/s f", "10.0f"),
        ("fwd_bwd_tflops", "TFLOP/s f+b", "12.0f"), ("peak_gib", "peak GiB", "9.2f")])


if __name__ == "__main__":
    main()
