"""Row gather-and-sum in one Triton kernel: the sum of each token's k rows of a top-k MoE layer,
held in expert order.

With top-k routing and no token dropped or padded, the expert outputs of a token are k rows of the
permuted (n k, h) tensor, and its combined output is their sum; so is the gradient of its input
through the permutation. Megatron's all-to-all dispatcher combines with ``scatter_add_`` (atomics;
12.5 ms of the packed Qwen3-30B-A3B-dims step on an H200, PERF_NOTES.md, run DC), and torch's
gather-then-sum writes and reads back an (n, k, h) intermediate. Given the rows ordered by token,
each program here reads its token's k rows once and writes its row of y once: no atomics, and a
fixed summation order (bitwise reproducible).

Math per token t in [0, n) and column c (fp32 accumulation, one rounding to x's dtype):
    y[t, c] = sum_{j < k} x[order[t k + j], c]
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .checks import runs_kernels

BLOCK_H = 1024  # columns per program


@triton.jit
def _row_gather_sum_kernel(X, ORDER, Y, H, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):  # unrolled (k is fixed per model): the k row loads can be in flight together
        row = tl.load(ORDER + t * K + j)
        acc += tl.load(X + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + t * H + cols, acc.to(Y.dtype.element_ty), mask=mask)


def row_gather_sum_reference(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The same sum as PyTorch ops: the CPU path and the tests' oracle."""
    return x.index_select(0, order).view(-1, k, x.shape[1]).float().sum(1).to(x.dtype)


def row_gather_sum(x: torch.Tensor, order: torch.Tensor, k: int, use_kernel: Optional[bool] = None) -> torch.Tensor:
    """x (n k, h), order (n k,) int64, a permutation of x's rows grouped by token -> y (n, h) in x's
    dtype, y[t] = sum_{j < k} x[order[t k + j]] accumulated in float32.

    use_kernel: None, the kernel on CUDA devices and the PyTorch ops elsewhere (the interpreter would
    run every MoE layer on the CPU at Python speed); True, the kernel wherever Triton runs (on CPU
    under ``TRITON_INTERPRET=1``: the tests); False, the PyTorch ops. No autograd: callers wrap it in
    their own ``torch.autograd.Function``.
    """
    if x.dim() != 2:
        raise ValueError(f"row_gather_sum: x must be (rows, hidden), got shape {tuple(x.shape)}")
    if order.dim() != 1 or order.shape[0] != x.shape[0]:
        raise ValueError(f"row_gather_sum: order must be 1-D with one entry per row of x ({x.shape[0]}), "
                         f"got shape {tuple(order.shape)}")
    if order.dtype != torch.int64:
        raise ValueError(f"row_gather_sum: order must be int64, got {order.dtype}")
    if k < 1 or x.shape[0] % k:
        raise ValueError(f"row_gather_sum: k must be >= 1 and divide the {x.shape[0]} rows of x, got k={k}")
    if order.device != x.device:
        raise ValueError(f"row_gather_sum: x on {x.device}, order on {order.device}")
    kernel = runs_kernels(x, use_kernel)
    if x.numel() == 0 or not kernel:  # no grid to launch for no rows or columns
        return row_gather_sum_reference(x, order, k)
    x, order = x.contiguous(), order.contiguous()
    n, h = x.shape[0] // k, x.shape[1]
    y = x.new_empty(n, h)
    _row_gather_sum_kernel[(n, triton.cdiv(h, BLOCK_H))](x, order, y, h, K=k, BLOCK=BLOCK_H)
    return y
