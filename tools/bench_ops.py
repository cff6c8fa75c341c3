"""Gemma's elementwise ops alone, at Gemma-4-31B shapes: our Triton kernels against the PyTorch ops
they replace (eager, and ``torch.compile``'d), forward and forward+backward.

For each op: median time and the bandwidth it reaches over the least traffic the op needs (its
inputs read and its outputs written once per direction, in bf16), so a kernel far below the card's
~4.8 TB/s shows at once. Prints a table and writes CSV:

    python tools/bench_ops.py --out bench/                 # N=16, P=8192, R=1024: 24,576 tokens
    python tools/bench_ops.py --ops geglu --tokens 8192
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Tuple

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]  # the other tools, the package; also when imported by path
from bench_attention import bench, write_table  # noqa: E402
from tool_args import comma_names  # noqa: E402
from megatron_dualkv.ops.geglu import geglu_func, geglu_reference  # noqa: E402
from megatron_dualkv.ops.rms_norm import rms_norm_func, rms_norm_reference  # noqa: E402

HIDDEN, FFN, HEADS, HEAD_DIM = 5376, 21504, 32, 256  # Gemma 4 31B (sliding layers' head dim)


@dataclass
class Op:
    """``make(tokens, device)`` -> the inputs, all taking gradients; ``ours`` and ``pytorch`` map them
    to the output; ``fwd_elements`` / ``bwd_elements``: the least traffic of each direction."""
    make: Callable[[int, torch.device], Tuple[torch.Tensor, ...]]
    ours: Callable
    pytorch: Callable
    fwd_elements: Callable[[Tuple[torch.Tensor, ...]], int]
    bwd_elements: Callable[[Tuple[torch.Tensor, ...]], int]


def _randn(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def _rms_norm(*row_shape: int) -> Op:
    """RMSNorm with a weight over the last dim of (tokens, *row_shape): x in, y out; x and dy in, dx out."""
    return Op(
        lambda t, d: (_randn(t, *row_shape, device=d), _randn(row_shape[-1], device=d)),
        lambda x, w: rms_norm_func(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6),
        lambda xs: 2 * xs[0].numel(), lambda xs: 3 * xs[0].numel(),
    )


OPS = {
    "rms_norm": _rms_norm(HIDDEN),  # the layer's input / post-attention / post-MLP norms
    "rms_norm_heads": _rms_norm(HEADS, HEAD_DIM),  # the query/key norms, one row per token and head
    # fc1's output (gate and linear halves) -> the MLP's activation; backward: dy in, both halves' grads out
    "geglu": Op(
        lambda t, d: (_randn(t, 2 * FFN, device=d),),
        geglu_func, geglu_reference,
        lambda xs: 3 * xs[0].numel() // 2, lambda xs: 5 * xs[0].numel() // 2,
    ),
}
METHODS = ("ours", "torch", "torch_compile")


def implementation(op: Op, method: str) -> Callable:
    if method == "ours":
        return op.ours
    return torch.compile(op.pytorch) if method == "torch_compile" else op.pytorch


def measure(name: str, method: str, tokens: int, device: torch.device) -> dict:
    op = OPS[name]
    inputs = [x.requires_grad_() for x in op.make(tokens, device)]
    fn = implementation(op, method)
    dy = torch.randn_like(fn(*inputs))

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), inputs, dy)

    with torch.no_grad():
        fwd_ms = bench(lambda: fn(*inputs))
    fwd_bwd_ms = bench(fwd_bwd)
    fwd_bytes, bwd_bytes = (2 * count(inputs) for count in (op.fwd_elements, op.bwd_elements))  # bf16
    return dict(op=name, shape="x".join(map(str, inputs[0].shape)), method=method, fwd_ms=fwd_ms,
                fwd_bwd_ms=fwd_bwd_ms, fwd_gbps=fwd_bytes / fwd_ms / 1e6,
                fwd_bwd_gbps=(fwd_bytes + bwd_bytes) / fwd_bwd_ms / 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--tokens", type=int, default=16 * 1024 + 8192, help="rows: P + N*R of one packed group")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    ops, methods = comma_names(parser, "--ops", args.ops, OPS), comma_names(parser, "--methods", args.methods, METHODS)
    if not torch.cuda.is_available():
        parser.error("bench_ops times GPU kernels: no CUDA device here")
    rows = []
    for name in ops:
        for method in methods:
            try:
                rows.append(measure(name, method, args.tokens, torch.device("cuda")))
            except Exception as e:  # noqa: BLE001 - report the row and go on
                rows.append(dict(op=name, shape="", method=method, error=f"{type(e).__name__}: {str(e)[:200]}"))
            torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, {args.tokens} tokens, bf16")
    os.makedirs(args.out, exist_ok=True)
    write_table(rows, os.path.join(args.out, "ops.csv"), [
        ("op", "op", "15"), ("shape", "shape", "16"), ("method", "method", "14"), ("fwd_ms", "fwd ms", "8.3f"),
        ("fwd_bwd_ms", "fwd+bwd ms", "10.3f"), ("fwd_gbps", "fwd GB/s", "9.0f"), ("fwd_bwd_gbps", "f+b GB/s", "9.0f"),
    ])


if __name__ == "__main__":
    main()
