"""RMSNorm in float32 with one Triton kernel per direction: Gemma's norm (``GemmaRMSNorm``).

Gemma normalises in float32 and casts back (transformers' Gemma3RMSNorm / Gemma4RMSNorm), with
the weight applied as ``1 + w`` (Gemma 3, zero-centred) or ``w`` (Gemma 4), or no weight at all
(Gemma 4's value norm). Written as PyTorch ops that is an upcast, a square, a mean, a product,
another product and a downcast, each a pass over memory, and autograd runs about twice as many
back: a Gemma 4 layer runs seven such norms, over the hidden states and over every query, key and
value head (PERF_NOTES.md, run BA: ~60-70 ms of elementwise work per layer at 16x8192x1024). Here
the forward reads x and writes y once, and the backward reads x and dy and writes dx once.

Math per row x of N elements (fp32; w_eff = 1 + w, w, or 1):
    rstd = 1 / sqrt(mean(x^2) + eps),  x_hat = x * rstd,  y = x_hat * w_eff
    g = dy * w_eff,  dx = rstd * (g - x_hat * mean(g * x_hat)),  dw = sum over rows of dy * x_hat
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

MAX_WIDTH = 65536  # one row per block of registers


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, N, eps, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        y = y * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, RSTD, DX, DW_PARTIAL, n_rows, N, HAS_WEIGHT: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # each program walks row blocks pid, pid + programs, ... and keeps its own dw partial, summed in
    # program order afterwards: no atomics, so dw is reproducible
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    w_eff = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_WEIGHT:
        w_eff = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w_eff = w_eff + 1.0
    dw = tl.zeros([BLOCK_N], tl.float32)
    for start in range(pid * BLOCK_M, n_rows, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w_eff[None, :]
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, 1) / N)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += tl.sum(dy * x_hat, 0)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid * BLOCK_N + cols, dw)


def _blocks(n: int):
    """(rows per program, padded width, warps): about 4K elements per program on narrow rows."""
    block_n = triton.next_power_of_2(n)
    return max(1, min(64, 4096 // block_n)), block_n, 8 if block_n >= 4096 else 4


def _bwd_programs(n_rows: int, block_m: int, device: torch.device) -> int:
    row_blocks = triton.cdiv(n_rows, block_m)
    if device.type != "cuda":
        return min(row_blocks, 4)
    return min(row_blocks, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centered: bool):
        shape, n = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n)
        block_m, block_n, warps = _blocks(n)
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
        _rms_norm_fwd_kernel[(triton.cdiv(x2.shape[0], block_m),)](
            x2, weight if weight is not None else x2, y, rstd, x2.shape[0], n, eps, HAS_WEIGHT=weight is not None,
            ZERO_CENTERED=zero_centered, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centered = zero_centered
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n = x2.shape
        block_m, block_n, warps = _blocks(n)
        dy2 = dy.reshape(n_rows, n).contiguous()
        dx = torch.empty_like(x2)
        programs = _bwd_programs(n_rows, block_m, x2.device)
        dw_partial = torch.empty(programs, block_n, device=x2.device, dtype=torch.float32) if weight is not None else None
        _rms_norm_bwd_kernel[(programs,)](
            x2, weight if weight is not None else x2, dy2, rstd, dx, dw_partial if weight is not None else rstd,
            n_rows, n, HAS_WEIGHT=weight is not None, ZERO_CENTERED=ctx.zero_centered, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps)
        dw = dw_partial.sum(0)[:n].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        return dx.view(dy.shape), dw, None, None


def rms_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                       zero_centered: bool = False) -> torch.Tensor:
    """The same norm as PyTorch ops (transformers' formulation): the CPU path and the tests' oracle."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (1.0 + weight.float() if zero_centered else weight.float())
    return y.type_as(x)


def rms_norm_func(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in float32, cast back to x's dtype.

    x (..., N) -> (..., N); weight (N,) applied as ``1 + weight`` when ``zero_centered``, else as
    ``weight``; None: normalise only. N <= 65536. Bitwise reproducible (no atomics).
    """
    n = x.shape[-1]
    if n > MAX_WIDTH:
        raise ValueError(f"rms_norm_func normalises rows of at most {MAX_WIDTH} elements, got {n}")
    if weight is not None and weight.shape != (n,):
        raise ValueError(f"rms_norm_func: weight of shape {tuple(weight.shape)} for rows of {n} elements")
    if weight is not None and weight.device != x.device:
        raise ValueError(f"rms_norm_func: x on {x.device}, weight on {weight.device}")
    if x.numel() == 0:  # no rows to launch a grid for
        return rms_norm_reference(x, weight, eps, zero_centered)
    return _RMSNorm.apply(x.contiguous(), weight.contiguous() if weight is not None else None, float(eps),
                          bool(zero_centered))
