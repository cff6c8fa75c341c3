"""The inter-chunk state scan of the chunked gated delta rule (``gated_delta_rule._chunk_recurrence``)
as one Triton kernel per direction.

Everything within a chunk is computed for all chunks at once (the WY matrices); only the state has
to pass from chunk to chunk. As a Python loop over the chunks that is a handful of tiny kernels per
chunk, and autograd's backward of the loop launches more: on an H200 it made the GDN mixer 6x
slower than fla's kernel (259 ms against 42 ms, fwd+bwd at 24,576 tokens, 32 value heads,
Dk = Dv = 128, chunks of 64). Here one program carries a (Dk x BV) column block of the state
through all chunks in registers, so each direction is one launch.

Per batch index b (all leading dims flattened) and chunk c = 0..C-1, with the state S (Dk x Dv,
float32) before chunk c:

    u_c  = U0_c - W_c S            U0_c (L, Dv), W_c (L, Dk)
    O_c  = R_c S + A_c u_c         R_c (L, Dk) "read_state", A_c (L, L) "attention"
    S   <- d_c S + E_c^T u_c       E_c (L, Dk) "to_end", d_c a scalar "chunk_decay"

Every column of S (and of U0, u, O) evolves on its own, so the scan splits over blocks of Dv.

Backward, with dS the gradient with respect to the state after chunk c (dS_final to start):

    du_c    = A_c^T dO_c + E_c dS
    dS     <- d_c dS + R_c^T dO_c - W_c^T du_c        (the gradient before chunk c)

and then, for all chunks at once, with S_c the state before chunk c (kept by the forward),
u_c = U0_c - W_c S_c recomputed, and dS_c the gradient after chunk c (kept by the backward scan):

    dU0_c = du_c    dW_c = -du_c S_c^T    dR_c = dO_c S_c^T    dA_c = dO_c u_c^T
    dE_c = u_c dS_c^T    dd_c = sum(S_c * dS_c)    dS_0 = the scan's last dS

Status: exact on the CPU interpreter; its first GPU launch was refused for shared memory (now one
pipeline stage, ``NUM_STAGES``), so it has not yet run on a GPU. ``gated_delta_rule``'s "auto"
backend does not take it until a GPU test has run it (its "triton" backend does).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import triton_available

BACKENDS = ("auto", "triton", "torch")
CHUNK_SIZES = (16, 32, 64)  # L: tl.dot takes blocks of 16 and more; the rule uses 64
# Columns of the state per program, whose (Dk x BV) block stays in registers, and warps: float32
# dots without tensor cores hold their operands in registers, and compiled for sm_90 at Dk = 128,
# L = 64 (Triton 3.6) BV = 64 with 4 warps spills 24 KB of stack per thread, BV = 16 with 8 warps
# under 1 KB.
BLOCK_V = 16
NUM_WARPS = 8
# No software pipelining of the chunk loop: Triton's default (3 stages) buffers two chunks' W, R, A
# and E tiles ahead, 245,760 B of shared memory at Dk = 128, L = 64, over sm_90's 232,448, and the
# launch is refused. One stage takes 53 KB (forward) and 70 KB (backward), so several programs share
# an SM and hide each other's loads.
NUM_STAGES = 1
# float32 products as float32 (tf32 would keep 10 bits of mantissa): the rule computes in float32,
# and its tests hold it to the float32 loop's error. "tf32x3" (tensor cores, near float32) spills
# about as little at BV = 64 with 4 warps: the candidate for the first GPU run to time.
DOT_PRECISION = "ieee"


@triton.jit
def _block_offsets(DV, L: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr):
    """This program's batch index, which of its BV columns of Dv exist, and the offsets of its
    (DK x BV) state block, an (L x BV) value tile, an (L x DK) key tile and an (L x L) tile."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, L)
    keys = tl.arange(0, DK)
    return (b, cols < DV, keys[:, None] * DV + cols[None, :], rows[:, None] * DV + cols[None, :],
            rows[:, None] * DK + keys[None, :], rows[:, None] * L + rows[None, :])


@triton.jit
def _scan_fwd_kernel(U0, W, R, A, E, D, S0, O, S_FINAL, S_ALL, C, DV, L: tl.constexpr, DK: tl.constexpr,
                     BV: tl.constexpr, KEEP_STATES: tl.constexpr, PRECISION: tl.constexpr):
    # per chunk c, S the state before it:  u = U0 - W S;  O = R S + A u;  S <- d S + E^T u
    b, in_v, state_at, value_at, key_at, square_at = _block_offsets(DV, L, DK, BV)
    state = tl.load(S0 + b * DK * DV + state_at, mask=in_v[None, :], other=0.0)
    for c in range(C):
        chunk = b * C + c
        if KEEP_STATES:  # the backward's S_c
            tl.store(S_ALL + chunk * DK * DV + state_at, state, mask=in_v[None, :])
        w = tl.load(W + chunk * L * DK + key_at)
        u = tl.load(U0 + chunk * L * DV + value_at, mask=in_v[None, :], other=0.0)
        u -= tl.dot(w, state, input_precision=PRECISION)
        read = tl.load(R + chunk * L * DK + key_at)
        attention = tl.load(A + chunk * L * L + square_at)
        out = tl.dot(read, state, input_precision=PRECISION) + tl.dot(attention, u, input_precision=PRECISION)
        tl.store(O + chunk * L * DV + value_at, out, mask=in_v[None, :])
        to_end = tl.load(E + chunk * L * DK + key_at)
        state = tl.load(D + chunk) * state + tl.dot(tl.trans(to_end), u, input_precision=PRECISION)
    tl.store(S_FINAL + b * DK * DV + state_at, state, mask=in_v[None, :])


@triton.jit
def _scan_bwd_kernel(DO, W, R, A, E, D, DS_FINAL, DU, DS_AFTER, DS0, C, DV,
                     L: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    # chunks in reverse, dS the gradient after chunk c:  du = A^T dO + E dS;  dS <- d dS + R^T dO - W^T du
    b, in_v, state_at, value_at, key_at, square_at = _block_offsets(DV, L, DK, BV)
    d_state = tl.load(DS_FINAL + b * DK * DV + state_at, mask=in_v[None, :], other=0.0)
    for i in range(C):
        chunk = b * C + (C - 1 - i)
        tl.store(DS_AFTER + chunk * DK * DV + state_at, d_state, mask=in_v[None, :])
        d_out = tl.load(DO + chunk * L * DV + value_at, mask=in_v[None, :], other=0.0)
        attention = tl.load(A + chunk * L * L + square_at)
        to_end = tl.load(E + chunk * L * DK + key_at)
        d_u = tl.dot(tl.trans(attention), d_out, input_precision=PRECISION)
        d_u += tl.dot(to_end, d_state, input_precision=PRECISION)
        tl.store(DU + chunk * L * DV + value_at, d_u, mask=in_v[None, :])
        read = tl.load(R + chunk * L * DK + key_at)
        w = tl.load(W + chunk * L * DK + key_at)
        d_state = (tl.load(D + chunk) * d_state + tl.dot(tl.trans(read), d_out, input_precision=PRECISION)
                   - tl.dot(tl.trans(w), d_u, input_precision=PRECISION))
    tl.store(DS0 + b * DK * DV + state_at, d_state, mask=in_v[None, :])


def _scan_forward(u0, w, read_state, attention, to_end, chunk_decay, state, keep_states: bool):
    """The forward kernel on contiguous (B, C, ...) float32 tensors: O (B, C, L, Dv), the final
    state (B, Dk, Dv), and the state before every chunk (B, C, Dk, Dv) if ``keep_states``."""
    batch, chunks, size, dv = u0.shape
    dk = w.shape[-1]
    out = torch.empty_like(u0)
    final = torch.empty_like(state)
    states = u0.new_empty(batch, chunks, dk, dv) if keep_states else final  # final: an unused pointer
    _scan_fwd_kernel[(batch, triton.cdiv(dv, BLOCK_V))](
        u0, w, read_state, attention, to_end, chunk_decay, state, out, final, states, chunks, dv,
        L=size, DK=dk, BV=BLOCK_V, KEEP_STATES=keep_states, PRECISION=DOT_PRECISION, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out, final, (states if keep_states else None)


def _scan_backward(d_out, d_final, w, read_state, attention, to_end, chunk_decay):
    """The backward kernel: du (B, C, L, Dv), the gradient after every chunk (B, C, Dk, Dv) and the
    gradient of the initial state (B, Dk, Dv)."""
    batch, chunks, size, dv = d_out.shape
    dk = w.shape[-1]
    d_u = torch.empty_like(d_out)
    d_after = d_out.new_empty(batch, chunks, dk, dv)
    d_state = torch.empty_like(d_final)
    _scan_bwd_kernel[(batch, triton.cdiv(dv, BLOCK_V))](
        d_out, w, read_state, attention, to_end, chunk_decay, d_final, d_u, d_after, d_state, chunks, dv,
        L=size, DK=dk, BV=BLOCK_V, PRECISION=DOT_PRECISION, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return d_u, d_after, d_state


class ChunkStateScan(torch.autograd.Function):
    """The scan's kernels on contiguous float32 (B, C, ...) tensors, with their gradients."""

    @staticmethod
    def forward(ctx, u0, w, read_state, attention, to_end, chunk_decay, state):
        out, final, states = _scan_forward(u0, w, read_state, attention, to_end, chunk_decay, state,
                                           keep_states=any(ctx.needs_input_grad))
        ctx.save_for_backward(u0, w, read_state, attention, to_end, chunk_decay, states)
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        u0, w, read_state, attention, to_end, chunk_decay, states = ctx.saved_tensors
        d_u, d_after, d_state = _scan_backward(d_out.contiguous(), d_final.contiguous(), w, read_state, attention,
                                               to_end, chunk_decay)
        # the rest has no dependence from chunk to chunk: batched matmuls over all of them
        states_t = states.transpose(-1, -2)
        u = u0 - w @ states
        return (d_u, -(d_u @ states_t), d_out @ states_t, d_out @ u.transpose(-1, -2),
                u @ d_after.transpose(-1, -2), (states * d_after).sum((-2, -1)), d_state)


def chunk_state_scan_reference(u0, w, read_state, attention, to_end, chunk_decay, state) -> Tuple[Tensor, Tensor]:
    """The scan as a loop over the chunks in PyTorch ops: any dtype and device, autograd's backward;
    the op's fallback and the tests' oracle. Shapes as ``chunk_state_scan_func``'s."""
    outputs = []
    for c in range(u0.shape[-3]):
        u = u0[..., c, :, :] - w[..., c, :, :] @ state
        outputs.append(read_state[..., c, :, :] @ state + attention[..., c, :, :] @ u)
        state = chunk_decay[..., c, None, None] * state + to_end[..., c, :, :].transpose(-1, -2) @ u
    return torch.stack(outputs, dim=-3), state


def triton_refusal(dk: int, dv: int, chunk_size: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the kernels cannot take this shape, dtype or device; None where they can."""
    if not triton_available(device):
        return f"the Triton scan runs on CUDA, or on the CPU under TRITON_INTERPRET=1, not on {device}"
    if dtype != torch.float32:
        return f"the Triton scan takes float32, got {dtype}"
    if dk < 16 or dk & (dk - 1):
        return f"the Triton scan takes Dk a power of two >= 16 (one block of keys), got Dk={dk}"
    if dv < 16:
        return f"the Triton scan takes Dv >= 16 (tl.dot's smallest block), got Dv={dv}"
    if chunk_size not in CHUNK_SIZES:
        return f"the Triton scan takes chunks of {', '.join(map(str, CHUNK_SIZES))}, got {chunk_size}"
    return None


def chunk_state_scan_func(u0: Tensor, w: Tensor, read_state: Tensor, attention: Tensor, to_end: Tensor,
                          chunk_decay: Tensor, state: Tensor, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The state recurrence across chunks (the module docstring's equations), differentiable in
    every input.

    u0: (..., C, L, Dv); w, read_state, to_end: (..., C, L, Dk); attention: (..., C, L, L);
    chunk_decay: (..., C); state: (..., Dk, Dv), the state before the first chunk. All of one dtype
    and device. Returns the outputs (..., C, L, Dv) and the state after the last chunk (..., Dk, Dv).

    backend: "triton" (the kernels; ``triton_refusal`` names what they cannot take, a ValueError),
    "torch" (``chunk_state_scan_reference``), or "auto": the kernels on CUDA where they take the
    shape, else torch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"chunk_state_scan: backend must be one of {BACKENDS}, got {backend!r}")
    lead, chunks, size, dk, dv = _check_shapes(u0, w, read_state, attention, to_end, chunk_decay, state)
    refusal = triton_refusal(dk, dv, size, u0.dtype, u0.device)
    if backend == "triton" and refusal:
        raise ValueError(f"chunk_state_scan: {refusal}")
    kernels = backend == "triton" or (backend == "auto" and u0.is_cuda and refusal is None)
    if not kernels or chunks == 0 or state.numel() == 0:  # no grid to launch for nothing to scan
        return chunk_state_scan_reference(u0, w, read_state, attention, to_end, chunk_decay, state)
    batch = state.numel() // (dk * dv)
    flat = [x.reshape(batch, *x.shape[len(lead):]).contiguous()
            for x in (u0, w, read_state, attention, to_end, chunk_decay, state)]
    out, final = ChunkStateScan.apply(*flat)
    return out.view(*lead, chunks, size, dv), final.view(*lead, dk, dv)


def _check_shapes(u0, w, read_state, attention, to_end, chunk_decay, state) -> Tuple[tuple, int, int, int, int]:
    """ValueError naming the input whose shape, dtype or device does not fit; the leading dims, C, L,
    Dk and Dv."""
    if u0.dim() < 3:
        raise ValueError(f"chunk_state_scan: u0 must be (..., chunks, L, Dv), got shape {tuple(u0.shape)}")
    *lead, chunks, size, dv = u0.shape
    lead = tuple(lead)
    dk = state.shape[-2] if state.dim() >= 2 else 0
    want = {"w": (*lead, chunks, size, dk), "read_state": (*lead, chunks, size, dk),
            "attention": (*lead, chunks, size, size), "to_end": (*lead, chunks, size, dk),
            "chunk_decay": (*lead, chunks), "state": (*lead, dk, dv)}
    given = {"w": w, "read_state": read_state, "attention": attention, "to_end": to_end, "chunk_decay": chunk_decay,
             "state": state}
    for name, x in given.items():
        if tuple(x.shape) != want[name]:
            raise ValueError(f"chunk_state_scan: {name} must be {want[name]} (u0 is {tuple(u0.shape)}, Dk={dk} "
                             f"from state), got {tuple(x.shape)}")
        if x.dtype != u0.dtype or x.device != u0.device:
            raise ValueError(f"chunk_state_scan: {name} is {x.dtype} on {x.device}, u0 {u0.dtype} on {u0.device}")
    return lead, chunks, size, dk, dv
