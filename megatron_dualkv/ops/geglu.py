"""GeGLU (tanh-approximated GELU gate times a linear half) with one Triton kernel per direction:
the activation of Gemma's MLP (``GemmaMLP``).

Megatron fuses the gated activation only for erf-GELU and SiLU; with Gemma's tanh GELU its MLP runs
a chunk, a GELU, an add of the (zero) linear offset and a product as PyTorch ops, each a pass over
the (tokens, 2 x ffn) fc1 output, and autograd about twice as many back. Here the forward reads
the gate and linear halves and writes y once; the backward reads them and dy and writes the two
input gradients once.

Math per element, gate a and linear half b (fp32; c = sqrt(2 / pi), k = 0.044715):
    u = c (a + k a^3),  gelu(a) = 0.5 a (1 + tanh(u)) = a s  with  s = sigmoid(2u),
    y = gelu(a) b
    da = dy b gelu'(a),  gelu'(a) = s + a s (1 - s) 2c (1 + 3k a^2),  db = dy gelu(a)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024  # elements of one half per program


@triton.jit
def _gelu_tanh(a):
    """(gelu(a), gelu'(a)) with s = sigmoid(2 c (a + k a^3)): tanh through the sigmoid, portable
    across Triton versions and the interpreter. The forward drops gelu' (dead code to the compiler)."""
    s = tl.sigmoid(2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a))
    return a * s, s + a * s * (1.0 - s) * (2.0 * 0.7978845608028654) * (1.0 + 3.0 * 0.044715 * a * a)


@triton.jit
def _geglu_fwd_kernel(X, Y, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    a = tl.load(X + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = _gelu_tanh(a)
    tl.store(Y + row * N + cols, (gelu * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(X, DY, DX, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    a = tl.load(X + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    gelu, dgelu = _gelu_tanh(a)
    tl.store(DX + row * 2 * N + cols, (dy * b * dgelu).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * 2 * N + N + cols, (dy * gelu).to(DX.dtype.element_ty), mask=mask)


def _grid(n_rows: int, n: int):
    return n_rows, triton.cdiv(n, BLOCK)


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[1] // 2
        y = x2.new_empty(x2.shape[0], n)
        _geglu_fwd_kernel[_grid(x2.shape[0], n)](x2, y, n, BLOCK_N=BLOCK)
        ctx.save_for_backward(x2)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        n = x2.shape[1] // 2
        dx = torch.empty_like(x2)
        _geglu_bwd_kernel[_grid(x2.shape[0], n)](x2, dy.reshape(-1, n).contiguous(), dx, n, BLOCK_N=BLOCK)
        return dx.view(*dy.shape[:-1], 2 * n)


def geglu_reference(x: torch.Tensor) -> torch.Tensor:
    """Megatron's gated MLP activation with Gemma's tanh GELU, as PyTorch ops: the CPU path and the
    tests' oracle."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * linear


def geglu_func(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2N), gate first then linear half -> gelu_tanh(x[..., :N]) * x[..., N:] (..., N),
    computed in float32 and cast back to x's dtype (one rounding, where PyTorch ops round the GELU
    too)."""
    if x.shape[-1] % 2:
        raise ValueError(f"geglu_func: the last dim holds the gate and linear halves, so it must be even, got {x.shape[-1]}")
    if x.numel() == 0:
        return geglu_reference(x)
    return _GeGLU.apply(x.contiguous())
