"""RMSNorm over each head, then rotary embedding (RoPE) over the whole head, in one Triton kernel per
direction: Qwen3's q and k (the norm with a weight, then Megatron's plain rotation).

Written as PyTorch ops, the norm, the cos/sin tables, the halves' swap and the two products each
pass over q's bytes, about eight times each way (PERF_NOTES.md, run DU). Here the forward reads x
and writes the output once, and the backward reads x and the output's gradient and writes dx once.
Triton compiles each kernel once per dtype and a few properties of its integer arguments (a
value of 1, divisibility by 16), not per shape, stride or grad mode as ``torch.compile`` did (which
this replaces; run DV). x may be a strided view: k, a slice of linear_qkv's output, is read in
place.

Math per token t (frequencies f of d elements) and row x of d elements (one head), in float32:
    rstd = 1 / sqrt(mean(x^2) + eps),  x_hat = x * rstd,  y = x_hat * w
    c = cos(f) * mscale,  s = sin(f) * mscale,  over the halves (1, 2) of the head:
    out1 = y1 * c1 - y2 * s1,  out2 = y2 * c2 + y1 * s2        (out = y * c + rotate_half(y) * s)
Backward, from the output's gradient o:
    dy1 = o1 * c1 + o2 * s2,  dy2 = o2 * c2 - o1 * s1          (the rotation's transpose)
    g = dy * w,  dx = rstd * (g - x_hat * mean(g * x_hat)),  dw = sum over rows of dy * x_hat
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import _bwd_programs

MAX_HEAD_DIM = 1024


@triton.jit
def _halves(P, mask, HALF):
    """Both halves of a head in float32; P: the first half's pointers."""
    return tl.load(P, mask=mask, other=0.0).to(tl.float32), tl.load(P + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rotation(FREQS, t, cols, mask, HALF, mscale):
    """(c1, s1, c2, s2) of token t: computed once per token, shared by all of its heads."""
    f1, f2 = _halves(FREQS + t * 2 * HALF + cols, mask, HALF)
    return tl.cos(f1) * mscale, tl.sin(f1) * mscale, tl.cos(f2) * mscale, tl.sin(f2) * mscale


@triton.jit
def _heads(X, t, start, heads, stride_xt, stride_xh, cols, cmask, HALF, BLOCK_R: tl.constexpr):
    """Rows start .. start + BLOCK_R of token t: their indices, mask, offsets in a contiguous
    [tokens, heads, d] tensor, and both halves of x (read through its strides) in float32."""
    rows = start + tl.arange(0, BLOCK_R)
    mask = (rows[:, None] < heads) & cmask[None, :]
    x_offs = t * stride_xt + rows.to(tl.int64)[:, None] * stride_xh + cols[None, :]
    x1, x2 = _halves(X + x_offs, mask, HALF)
    offs = (t * heads + rows.to(tl.int64))[:, None] * (2 * HALF) + cols[None, :]
    return rows, mask, offs, x1, x2


@triton.jit
def _rms_norm_rope_fwd_kernel(X, W, FREQS, Y, RSTD, heads, stride_xt, stride_xh, HALF, eps, mscale,
                              BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: its rotation, then its heads in blocks of BLOCK_R rows; Y is contiguous
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    c1, s1, c2, s2 = _rotation(FREQS, t, cols, cmask, HALF, mscale)
    w1, w2 = _halves(W + cols, cmask, HALF)
    for start in range(0, heads, BLOCK_R):
        rows, mask, y_offs, x1, x2 = _heads(X, t, start, heads, stride_xt, stride_xh, cols, cmask, HALF, BLOCK_R)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        y1 = x1 * rstd[:, None] * w1[None, :]
        y2 = x2 * rstd[:, None] * w2[None, :]
        tl.store(Y + y_offs, (y1 * c1[None, :] - y2 * s1[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + y_offs + HALF, (y2 * c2[None, :] + y1 * s2[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + t * heads + rows, rstd, mask=rows < heads)


@triton.jit
def _rms_norm_rope_bwd_kernel(X, W, FREQS, DY, RSTD, DX, DW_PARTIAL, tokens, heads, stride_xt, stride_xh, HALF,
                              mscale, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # each program walks tokens pid, pid + programs, ... and keeps its own dw partial (both halves),
    # summed in program order afterwards: no atomics, so dw is reproducible. DY and DX are contiguous.
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    w1, w2 = _halves(W + cols, cmask, HALF)
    dw1 = tl.zeros([BLOCK_HALF], tl.float32)
    dw2 = tl.zeros([BLOCK_HALF], tl.float32)
    for t in range(pid.to(tl.int64), tokens, programs):  # int64: t * stride_xt may pass 2**31
        c1, s1, c2, s2 = _rotation(FREQS, t, cols, cmask, HALF, mscale)
        for start in range(0, heads, BLOCK_R):
            rows, mask, offs, x1, x2 = _heads(X, t, start, heads, stride_xt, stride_xh, cols, cmask, HALF, BLOCK_R)
            o1, o2 = _halves(DY + offs, mask, HALF)
            rstd = tl.load(RSTD + t * heads + rows, mask=rows < heads, other=0.0)[:, None]
            dy1 = o1 * c1[None, :] + o2 * s2[None, :]
            dy2 = o2 * c2[None, :] - o1 * s1[None, :]
            x1, x2 = x1 * rstd, x2 * rstd  # x_hat
            g1, g2 = dy1 * w1[None, :], dy2 * w2[None, :]
            mean_gx = ((tl.sum(g1 * x1, 1) + tl.sum(g2 * x2, 1)) / (2 * HALF))[:, None]
            tl.store(DX + offs, (rstd * (g1 - x1 * mean_gx)).to(DX.dtype.element_ty), mask=mask)
            tl.store(DX + offs + HALF, (rstd * (g2 - x2 * mean_gx)).to(DX.dtype.element_ty), mask=mask)
            dw1 += tl.sum(dy1 * x1, 0)
            dw2 += tl.sum(dy2 * x2, 0)
    tl.store(DW_PARTIAL + pid * 2 * BLOCK_HALF + cols, dw1)
    tl.store(DW_PARTIAL + pid * 2 * BLOCK_HALF + BLOCK_HALF + cols, dw2)


def _blocks(heads: int, half: int, elements: int):
    """(rows per block, padded half width): about ``elements`` (both halves) per block. Two warps a
    block: on the H200, 4096-element forward blocks ran 119 us (q of Qwen3-4B, 24,576 tokens) with
    two warps and 404 us with eight; 2048-element backward blocks 545 us with two (run DW)."""
    block_half = triton.next_power_of_2(half)
    return max(1, min(triton.next_power_of_2(heads), elements // (2 * block_half))), block_half


class _RMSNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, freqs, mscale: float):
        tokens, heads, d = x.shape  # x: [tokens, heads, d], its last dim contiguous
        block_r, block_half = _blocks(heads, d // 2, 4096)
        y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        rstd = torch.empty(tokens * heads, device=x.device, dtype=torch.float32)
        _rms_norm_rope_fwd_kernel[(tokens,)](
            x, weight, freqs, y, rstd, heads, x.stride(0), x.stride(1), d // 2, eps, mscale,
            BLOCK_R=block_r, BLOCK_HALF=block_half, num_warps=2)
        ctx.save_for_backward(x, weight, freqs, rstd)
        ctx.mscale = mscale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, freqs, rstd = ctx.saved_tensors
        tokens, heads, d = x.shape
        block_r, block_half = _blocks(heads, d // 2, 2048)
        dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        programs = _bwd_programs(tokens, 1, x.device)
        dw_partial = torch.empty(programs, 2, block_half, device=x.device, dtype=torch.float32)
        _rms_norm_rope_bwd_kernel[(programs,)](
            x, weight, freqs, dy.contiguous(), rstd, dx, dw_partial, tokens, heads, x.stride(0), x.stride(1),
            d // 2, ctx.mscale, BLOCK_R=block_r, BLOCK_HALF=block_half, num_warps=2)
        dw = dw_partial.sum(0)[:, : d // 2].reshape(d).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor,
                            mscale: float = 1.0) -> torch.Tensor:
    """The same as PyTorch ops: torch's ``rms_norm`` then Megatron's unfused ``[s, b, ...]`` rotation
    over the whole head, in its order, ``t * cos + rotate_half(t) * sin`` with
    ``rotate_half([x1, x2]) = [-x2, x1]`` and cos, sin (times mscale) cast to x's dtype. The CPU path
    (the bits of Megatron's own norm and rotation) and the tests' oracle; shapes as
    ``rms_norm_rope_func``."""
    x = torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    freqs = freqs.reshape(x.size(0), *[1] * (x.dim() - 2), x.size(-1))
    cos, sin = ((f(freqs) * mscale).to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = torch.chunk(x, 2, dim=-1)
    # Megatron's closing cat with the (empty) unrotated part: the gradient reaches the norm in the
    # same memory layout, so that the weight's gradient sums in the same order (bitwise eager parity)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, x[..., x.size(-1):]), dim=-1)


def rms_norm_rope_func(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor,
                       mscale: float = 1.0) -> torch.Tensor:
    """RMSNorm over each head (float32 math, weight ``w``), then RoPE over the whole head, rounded
    once to x's dtype.

    x [s, ..., d] (any strides, d even and at most 1024; e.g. [s, b, heads, d]) -> a contiguous
    [s, ..., d]; weight (d,); freqs [s, d] or [s, 1, ..., 1, d] (float, no gradient): token i's
    angles, shared by all of its heads (Megatron's rotary table, one row per position or per packed
    token); mscale scales cos and sin (YaRN). Bitwise reproducible (no atomics).
    """
    if x.dim() < 2 or x.size(-1) % 2 or x.size(-1) > MAX_HEAD_DIM:
        raise ValueError(f"rms_norm_rope_func: x must be [s, ..., d] with an even d <= {MAX_HEAD_DIM}, "
                         f"got shape {tuple(x.shape)}")
    s, d = x.size(0), x.size(-1)
    if weight.shape != (d,):
        raise ValueError(f"rms_norm_rope_func: weight of shape {tuple(weight.shape)} for heads of {d} elements")
    if freqs.dim() < 2 or freqs.size(0) != s or freqs.size(-1) != d or freqs.numel() != s * d:
        raise ValueError(f"rms_norm_rope_func: freqs of shape {tuple(freqs.shape)} for x of shape {tuple(x.shape)}: "
                         f"expected one row of {d} angles per token, [{s}, {d}] or [{s}, 1, ..., 1, {d}]")
    if not freqs.is_floating_point() or (freqs.requires_grad and torch.is_grad_enabled()):
        raise ValueError("rms_norm_rope_func: freqs must be floating point and take no gradient")
    if not (x.device == weight.device == freqs.device):
        raise ValueError(f"rms_norm_rope_func: x on {x.device}, weight on {weight.device}, freqs on {freqs.device}")
    if x.numel() == 0:  # no tokens to launch a grid for
        return rms_norm_rope_reference(x, weight, eps, freqs, mscale)
    rows = x.reshape(s, -1, d)  # a view where x's strides allow it (k inside linear_qkv's output)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = _RMSNormRope.apply(rows, weight.contiguous(), float(eps), freqs.reshape(s, d).contiguous(), float(mscale))
    return y.view(x.shape)
