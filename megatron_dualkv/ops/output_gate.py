"""The attention output gate of Qwen3.5 and Qwen3-Next, x * sigmoid(gate), with one Triton kernel
per direction, keeping exactly x and the gate for the backward on every path.

Megatron's ``Attention._apply_output_gate`` is a ``torch.compile``'d function. Compiled, it keeps x
and the gate (bf16); run eagerly it keeps x and the float32 sigmoid instead (+8 KiB a token of a
Qwen3.5-4B attention layer). It runs eagerly whenever Dynamo gives up on it: after its recompile
limit (8 graphs: dtypes, grad modes, the gate's strides and shapes each add one, so a process that
runs log-probs, float64 oracles or several models reaches it), the memory the model counts, and
the plan built on that count, then no longer hold. Here the saved tensors are the same whatever
torch.compile does, and the CUDA path is one pass each way like the compiled one.

Math per element, in float32 (float64 for float64 inputs), s = sigmoid(g):
    y = x s                                    (rounded once to x's dtype)
    dx = dy s,  dg = dy x s (1 - s)            (s recomputed from the saved gate)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import runs_kernels

BLOCK = 2048  # elements per program


@triton.jit
def _output_gate_fwd_kernel(X, G, Y, N, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * tl.sigmoid(g)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _output_gate_bwd_kernel(X, G, DY, DX, DG, N, BLOCK_N: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DX + offs, (dy * s).to(DX.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * x * s * (1.0 - s)).to(DG.dtype.element_ty), mask=mask)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _torch_forward(x: Tensor, gate: Tensor) -> Tensor:
    dtype = _compute_dtype(x)
    return (x.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)


def _torch_backward(x: Tensor, gate: Tensor, dy: Tensor):
    dtype = _compute_dtype(x)
    s = torch.sigmoid(gate.to(dtype))
    dy = dy.to(dtype)
    return (dy * s).to(x.dtype), (dy * x.to(dtype) * s * (1 - s)).to(gate.dtype)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


class _OutputGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, kernels: bool) -> Tensor:
        ctx.save_for_backward(x, gate)
        ctx.kernels = kernels
        if not kernels:
            return _torch_forward(x, gate)
        y = torch.empty_like(x)
        _output_gate_fwd_kernel[_grid(x.numel())](x, gate, y, x.numel(), BLOCK_N=BLOCK)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, gate = ctx.saved_tensors
        if not ctx.kernels:
            return (*_torch_backward(x, gate, dy), None)
        dx, dgate = torch.empty_like(x), torch.empty_like(gate)
        _output_gate_bwd_kernel[_grid(x.numel())](x, gate, dy.contiguous(), dx, dgate, x.numel(), BLOCK_N=BLOCK)
        return dx, dgate, None


def output_gate_reference(x: Tensor, gate: Tensor) -> Tensor:
    """x * sigmoid(gate) as PyTorch ops, autograd through them: the tests' oracle."""
    return _torch_forward(x, gate.reshape(x.shape))


def output_gate_func(x: Tensor, gate: Tensor, use_triton: bool | None = None) -> Tensor:
    """x (..., H) and gate with x's number of elements (Megatron's [sq, b, np, hn] gate heads for
    x [sq, b, np * hn]) -> x * sigmoid(gate) (..., H) in x's dtype, computed in float32 (float64
    for float64) and rounded once, as Megatron's gate does.

    Keeps x and the gate (a contiguous copy when ``gate`` is not contiguous, as Megatron's) for the
    backward, nothing else. ``use_triton``: None runs the kernels on CUDA, PyTorch ops elsewhere
    (``ops.checks.runs_kernels``)."""
    if gate.numel() != x.numel():
        raise ValueError(f"output_gate_func: the gate has {gate.numel()} elements, x {x.numel()} "
                         f"(shapes {tuple(gate.shape)} and {tuple(x.shape)})")
    if gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"output_gate_func: the gate is {gate.dtype} on {gate.device}, x {x.dtype} on {x.device}")
    x, gate = x.contiguous(), gate.contiguous().view(x.shape)
    return _OutputGate.apply(x, gate, runs_kernels(x, use_triton) and x.numel() > 0)
