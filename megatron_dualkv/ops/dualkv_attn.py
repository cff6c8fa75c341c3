"""Fused DualKV attention: Triton forward and backward over shared prefixes: a prompt and each of
its responses, or prefix trees of trajectories at any depth.

One launch per micro-batch covers every group. Work is described by host-built tables
(``PackedLayout.derived`` caches them per layout), so kernels never search segment boundaries:

* forward / dQ: one program per (query tile, query head). A tile lies inside one segment and
  sees two kinds of key ranges:
      A, its *ancestors*: every key visible up to the window. A response's one ancestor is its
         prompt, inline in the tile's row. In a tree (DFS order) a path from the root is a short
         list of *pieces* (``ancestor_pieces``: ancestors that follow each other in packed order
         merged), read from a side table in multi-range tiles (``MULTI_RANGE``, a constexpr: the
         depth-1 kernels compile as before), window-hidden pieces dropped on the host;
      B, *itself*: its segment from the start up to the tile, causal.
* dK/dV: one program per (key tile, key/value head, query chunk). The queries that see a key tile
  form ONE contiguous range ``[k_start, subtree end)``: the segment's own later queries, then
  every query of its descendants, which follow it in DFS order (a prompt tile: the rest of its
  prompt, then every response of the group; a response tile: the rest of its response). So in
  packed order a query sees a key iff it comes later, and a window cuts the range into runs of
  consecutive positions (each branch restarts its positions at the segment's end). Prompt (root)
  tiles receive work from P + sum(R_i) queries and response tiles from R_i: long ranges are split
  into chunks, each writing an fp32 partial, reduced afterwards in a fixed order, so the grid
  stays full and dK/dV are bitwise reproducible. GQA is reduced inside the program (loop over the
  query heads of the key/value head): no expanded K/V, no expanded dK/dV.
* dQ: its own pass per (query tile, query head), recomputing the scores (7 matmuls per block pair
  in the backward), or, unless ``deterministic`` and where it measured faster (head dim 512 on
  the H200), added by the dK/dV pass to an fp32 buffer (5 matmuls per block pair): one TMA bulk
  reduction per block on Hopper, scalar atomics elsewhere.
* On Hopper the unmasked middle of every key or query range is streamed as TMA boxes (per-pass
  ``KernelConfig.tma``, where it measured faster); masked edges keep pointer loads.

Math (per query row i, key j, log2 domain; c = softcap, s = softmax scale):
    x_ij  = s * q_i . k_j
    z_ij  = c * tanh(x_ij / c)            (z = x without softcap)
    lse_i = log2 sum_j 2^(z_ij log2 e)    stored in log2 units, one per (head, row)
    p_ij  = 2^(z_ij log2 e - lse_i),   o_i = sum_j p_ij v_j
    dv_j  = sum_i p_ij do_i
    dp_ij = do_i . v_j,   delta_i = do_i . o_i
    dz_ij = p_ij (dp_ij - delta_i),    dx_ij = dz_ij (1 - tanh^2(x_ij / c))   (dx = dz without softcap)
    dq_i  = s sum_j dx_ij k_j,   dk_j = s sum_i dx_ij q_i

Masks use logical positions: a key is visible iff pos_k <= pos_q and pos_q - pos_k < window.
Key ranges are cut into a masked lower edge (window), an unmasked middle and a masked upper edge
(causal diagonal, range end), so most blocks run without any mask arithmetic.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..layout import PackedLayout
from .checks import check_attention_inputs, tma_aligned
from .dualkv_attn_sm90 import (NATIVE_BLOCK_M, NATIVE_BLOCK_N, NATIVE_FWD_BLOCK_M, dkdv_dq_sm90, dq_in_head_dim_order,
                               fwd_sm90, native_forward_takes_pieces, native_supported)

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # larger than any position: "window" that never masks
TMA_MAX_BOX = 256  # a TMA box has at most 256 elements per dimension


# ==================================================================================== kernels
@triton.jit
def _tanh(x):
    # tanh through the sigmoid: portable across Triton versions and the interpreter
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_tile(ptrs, row_ok, d_mask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, masking rows only where asked and columns only past HEAD_DIM."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _load_rows(base, stride_t, desc, row0, head, start, offs, hi, offs_d, d_mask, MASKED: tl.constexpr,
               EVEN_D: tl.constexpr, TMA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [start, start + BLOCK) of one head, counted from row0 (``base`` points at row0 of the head).

    With TMA, blocks that need no row mask are one bulk copy of a (BLOCK, 1, BLOCK_D) box of the
    (T, H, D) tensor descriptor: no per-element address registers, and Triton pipelines the copies
    through mbarriers. Masked edge blocks keep pointer loads, so no key or query outside the range
    is ever read into a tile.
    """
    if TMA and not MASKED:
        return desc.load([row0 + start, head, 0]).reshape(BLOCK, BLOCK_D)
    j = start + offs
    return _load_tile(base + j.to(tl.int64)[:, None] * stride_t + offs_d[None, :], j < hi, d_mask, MASKED, EVEN_D)


@triton.jit
def _split_range(lo, hi, vis_lo, vis_hi, BLOCK: tl.constexpr):
    """Cut [lo, hi) into [lo, m1) masked, [m1, m2) unmasked, [m2, hi) masked.

    [vis_lo, vis_hi) are the indices visible from every row of the tile; m1 is the first block
    boundary (counted from lo) at or after vis_lo, m2 the last one at or before vis_hi.
    """
    m1 = lo + tl.cdiv(tl.maximum(vis_lo - lo, 0), BLOCK) * BLOCK
    m1 = tl.minimum(m1, hi)
    m2 = m1 + (tl.maximum(tl.minimum(vis_hi, hi) - m1, 0) // BLOCK) * BLOCK
    return m1, m2


@triton.jit
def _dot(a, b):
    """a @ b accumulated in float32. Float32 operands multiply in full float32: Triton's default for
    them is TF32 (10-bit mantissas, ~1e-3 relative error), which a float32 model does not expect."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _scores(q, k, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Scores in log2 units from q (M, D), k (N, D): (M, N), and tanh(x / c) for the backward."""
    x = _dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        t = _tanh(x * (qk_scale / softcap))  # qk_scale = s * log2 e, softcap pre-scaled by log2 e
        return softcap * t, t
    return x * qk_scale, x


@triton.jit
def _visible(qc, j, hi, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(M, N) mask: key j < hi, causal (j <= qc) where asked, and inside the window (qc - j < window).

    qc is the query's coordinate in the key range's own index space (its logical position for the
    prompt prefix, its index in the segment for the segment itself).
    """
    mask = j[None, :] < hi
    if CAUSAL:
        mask = mask & (j[None, :] <= qc[:, None])
    if HAS_WINDOW:
        mask = mask & (qc[:, None] - j[None, :] < window)
    return mask


@triton.jit
def _fwd_range(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, lo, hi, qc,
               window, qk_scale, softcap, offs_n, offs_d, d_mask, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Online-softmax accumulation over keys [lo, hi) of one key range (flash-attention 2)."""
    for start in range(lo, hi, BLOCK_N):
        k = _load_rows(k_base, stride_kt, k_desc, row0, hk, start, offs_n, hi, offs_d, d_mask, MASKED, EVEN_D,
                       TMA_LOADS, BLOCK_N, BLOCK_D)
        v = _load_rows(v_base, stride_vt, v_desc, row0, hk, start, offs_n, hi, offs_d, d_mask, MASKED, EVEN_D,
                       TMA_LOADS, BLOCK_N, BLOCK_D)
        z, _ = _scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
        if MASKED:
            z = tl.where(_visible(qc, start + offs_n, hi, window, CAUSAL, HAS_WINDOW), z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        # a row that has seen no visible key yet keeps m = -inf: subtract 0 so p = 0, not NaN
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(z - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_keys(acc, l_i, m_i, q, K, V, k_desc, v_desc, row0, hk, stride_kt, stride_kh, stride_vt, stride_vh, lo, hi,
              vis_lo, vis_hi, qc, window, qk_scale, softcap, offs_n, offs_d, d_mask, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Keys [lo, hi) of the range starting at packed row ``row0``: masked edge, unmasked middle, masked edge."""
    m1, m2 = _split_range(lo, hi, vis_lo, vis_hi, BLOCK_N)
    k_base = K + row0.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + row0.to(tl.int64) * stride_vt + hk * stride_vh
    acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, lo,
                               m1, qc, window, qk_scale, softcap, offs_n, offs_d, d_mask, True, CAUSAL, HAS_WINDOW,
                               HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, m1,
                               m2, qc, window, qk_scale, softcap, offs_n, offs_d, d_mask, False, CAUSAL, HAS_WINDOW,
                               HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    acc, l_i, m_i = _fwd_range(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, m2,
                               hi, qc, window, qk_scale, softcap, offs_n, offs_d, d_mask, True, CAUSAL, HAS_WINDOW,
                               HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    return acc, l_i, m_i


@triton.jit
def _fwd_ancestor(acc, l_i, m_i, q, K, V, k_desc, v_desc, start, length, offset, i0, i1, hk, stride_kt, stride_kh,
                  stride_vt, stride_vh, window, qk_scale, softcap, offs_m, offs_n, offs_d, d_mask,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Keys [start, start + length) of an ancestor piece, every one visible up to the window: no
    causal mask. The tile's row i (its index in its segment) sits at ``offset + i`` in the piece's
    index space (its position minus the piece's first)."""
    return _fwd_keys(acc, l_i, m_i, q, K, V, k_desc, v_desc, start, hk, stride_kt, stride_kh, stride_vt, stride_vh,
                     tl.maximum(offset + i0 - window + 1, 0), length, offset + i1 - window + 1, length,
                     offset + i0 + offs_m, window, qk_scale, softcap, offs_n, offs_d, d_mask, False, HAS_WINDOW,
                     HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)


@triton.jit
def _fwd_pieces(acc, l_i, m_i, q, K, V, k_desc, v_desc, PIECES, seg_pos, piece_lo, piece_hi, i0, i1, hk, stride_kt,
                stride_kh, stride_vt, stride_vh, window, qk_scale, softcap, offs_m, offs_n, offs_d, d_mask,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """A multi-range tile's ancestor pieces ``PIECES[piece_lo:piece_hi]`` ``(start, length, position)``,
    root first; its segment starts at position ``seg_pos``."""
    for p in range(piece_lo, piece_hi):
        piece = PIECES + 3 * p
        acc, l_i, m_i = _fwd_ancestor(acc, l_i, m_i, q, K, V, k_desc, v_desc, tl.load(piece), tl.load(piece + 1),
                                      seg_pos - tl.load(piece + 2), i0, i1, hk, stride_kt, stride_kh, stride_vt,
                                      stride_vh, window, qk_scale, softcap, offs_m, offs_n, offs_d, d_mask, HAS_WINDOW,
                                      HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    return acc, l_i, m_i


@triton.jit
def _program_row(TABLE, NUM_HEADS: tl.constexpr, WIDTH: tl.constexpr):
    """(head, pointer to the table row) of this program: one program per (row, head), heads varying
    slowest, so that the programs running at once take one head's rows and share its K/V (forward)
    or its Q, dO and dQ rows (backward) in L2, as in the native kernels (PERF_NOTES.md, runs AK, AS)."""
    pid = tl.program_id(0)
    rows = tl.num_programs(0) // NUM_HEADS
    return pid // rows, TABLE + (pid % rows) * WIDTH


@triton.jit
def _query_tile(TILES, NUM_HEADS: tl.constexpr, MULTI_RANGE: tl.constexpr):
    """This program's query head, its table row and the row's first five fields: ``(q_start, q_end,
    seg_start, prefix_start, prefix_len)`` of a single-range tile; a multi-range tile holds
    ``(seg_pos, piece_lo)`` in place of the prefix, then ``piece_hi`` (``query_tiles``)."""
    h, row = _program_row(TILES, NUM_HEADS, 6 if MULTI_RANGE else 5)
    return h, row, tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _fwd_kernel(Q, K, V, K_DESC, V_DESC, O, LSE, TILES, PIECES, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_ot, stride_oh, T, qk_scale, softcap, window, NUM_HEADS: tl.constexpr,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                TMA_LOADS: tl.constexpr, MULTI_RANGE: tl.constexpr):
    h, row, q_start, q_end, seg_start, prefix_start, prefix_len = _query_tile(TILES, NUM_HEADS, MULTI_RANGE)
    hk = h // GROUP

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    row_mask = q_start + offs_m < q_end
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    i0 = q_start - seg_start  # first row's index inside its segment
    i1 = q_end - 1 - seg_start  # last row's
    if MULTI_RANGE:
        # A: the tile's path from its root, piece by piece (seg_pos and piece_lo where a
        # single-range row holds its prefix, piece_hi after them)
        acc, l_i, m_i = _fwd_pieces(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, PIECES, prefix_start, prefix_len,
                                    tl.load(row + 5), i0, i1, hk, stride_kt, stride_kh, stride_vt, stride_vh, window,
                                    qk_scale, softcap, offs_m, offs_n, offs_d, d_mask, HAS_WINDOW, HAS_SOFTCAP,
                                    BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    elif prefix_len > 0:
        # A: the prefix (a response's prompt), keys at logical positions 0..prefix_len-1
        acc, l_i, m_i = _fwd_ancestor(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, prefix_start, prefix_len, prefix_len,
                                      i0, i1, hk, stride_kt, stride_kh, stride_vt, stride_vh, window, qk_scale,
                                      softcap, offs_m, offs_n, offs_d, d_mask, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N,
                                      BLOCK_D, EVEN_D, TMA_LOADS)
    # B: the tile's own segment, causal
    acc, l_i, m_i = _fwd_keys(acc, l_i, m_i, q, K, V, K_DESC, V_DESC, seg_start, hk, stride_kt, stride_kh, stride_vt,
                              stride_vh, tl.maximum(i0 - window + 1, 0), i1 + 1, i1 - window + 1, i0 + 1,
                              i0 + offs_m, window, qk_scale, softcap, offs_n, offs_d, d_mask, True, HAS_WINDOW,
                              HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)

    # every valid row sees at least its own key, so l_i > 0 there
    l_safe = tl.where(row_mask, l_i, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(LSE + h.to(tl.int64) * T + q_start + offs_m, m_i + tl.math.log2(l_safe), mask=row_mask)
    tl.store(O + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, T, NUM_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[h, t] = do[t, h] . o[t, h], the softmax-gradient row term. Heads vary fastest over the
    programs, so those running at once read whole (rows, Hq, D) stretches of o and do: 12% faster
    than one head's rows at a time in run CV's micro-benchmark (PERF_NOTES.md)."""
    h = tl.program_id(0) % NUM_HEADS
    rows = (tl.program_id(0) // NUM_HEADS) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
    r64 = rows.to(tl.int64)
    o = tl.load(O + r64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + r64[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + h.to(tl.int64) * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T)


@triton.jit
def _dq_range(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, lo, hi, qc,
              window, qk_scale, softcap, offs_n, offs_d, d_mask, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """dq += sum_j dx_ij k_j over keys [lo, hi) of one key range (scale applied by the caller)."""
    for start in range(lo, hi, BLOCK_N):
        k = _load_rows(k_base, stride_kt, k_desc, row0, hk, start, offs_n, hi, offs_d, d_mask, MASKED, EVEN_D,
                       TMA_LOADS, BLOCK_N, BLOCK_D)
        v = _load_rows(v_base, stride_vt, v_desc, row0, hk, start, offs_n, hi, offs_d, d_mask, MASKED, EVEN_D,
                       TMA_LOADS, BLOCK_N, BLOCK_D)
        z, t = _scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
        p = tl.math.exp2(z - lse[:, None])
        if MASKED:
            p = tl.where(_visible(qc, start + offs_n, hi, window, CAUSAL, HAS_WINDOW), p, 0.0)
        dp = _dot(do, tl.trans(v))
        dx = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            dx = dx * (1.0 - t * t)
        dq += _dot(dx.to(k.dtype), k)
    return dq


@triton.jit
def _dq_keys(dq, q, do, lse, delta, K, V, k_desc, v_desc, row0, hk, stride_kt, stride_kh, stride_vt, stride_vh, lo,
             hi, vis_lo, vis_hi, qc, window, qk_scale, softcap, offs_n, offs_d, d_mask, CAUSAL: tl.constexpr,
             HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """Keys [lo, hi) of the range starting at packed row ``row0``: masked edge, unmasked middle, masked edge."""
    m1, m2 = _split_range(lo, hi, vis_lo, vis_hi, BLOCK_N)
    k_base = K + row0.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + row0.to(tl.int64) * stride_vt + hk * stride_vh
    dq = _dq_range(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, lo, m1, qc,
                   window, qk_scale, softcap, offs_n, offs_d, d_mask, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N,
                   BLOCK_D, EVEN_D, TMA_LOADS)
    dq = _dq_range(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, m1, m2, qc,
                   window, qk_scale, softcap, offs_n, offs_d, d_mask, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N,
                   BLOCK_D, EVEN_D, TMA_LOADS)
    dq = _dq_range(dq, q, do, lse, delta, k_base, v_base, k_desc, v_desc, row0, hk, stride_kt, stride_vt, m2, hi, qc,
                   window, qk_scale, softcap, offs_n, offs_d, d_mask, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N,
                   BLOCK_D, EVEN_D, TMA_LOADS)
    return dq


@triton.jit
def _dq_ancestor(dq, q, do, lse, delta, K, V, k_desc, v_desc, start, length, offset, i0, i1, hk, stride_kt, stride_kh,
                 stride_vt, stride_vh, window, qk_scale, softcap, offs_m, offs_n, offs_d, d_mask,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """dQ over the keys of an ancestor piece, as ``_fwd_ancestor``."""
    return _dq_keys(dq, q, do, lse, delta, K, V, k_desc, v_desc, start, hk, stride_kt, stride_kh, stride_vt,
                    stride_vh, tl.maximum(offset + i0 - window + 1, 0), length, offset + i1 - window + 1, length,
                    offset + i0 + offs_m, window, qk_scale, softcap, offs_n, offs_d, d_mask, False, HAS_WINDOW,
                    HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)


@triton.jit
def _dq_pieces(dq, q, do, lse, delta, K, V, k_desc, v_desc, PIECES, seg_pos, piece_lo, piece_hi, i0, i1, hk,
               stride_kt, stride_kh, stride_vt, stride_vh, window, qk_scale, softcap, offs_m, offs_n, offs_d, d_mask,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               EVEN_D: tl.constexpr, TMA_LOADS: tl.constexpr):
    """dQ over a multi-range tile's ancestor pieces, as ``_fwd_pieces``."""
    for p in range(piece_lo, piece_hi):
        piece = PIECES + 3 * p
        dq = _dq_ancestor(dq, q, do, lse, delta, K, V, k_desc, v_desc, tl.load(piece), tl.load(piece + 1),
                          seg_pos - tl.load(piece + 2), i0, i1, hk, stride_kt, stride_kh, stride_vt, stride_vh, window,
                          qk_scale, softcap, offs_m, offs_n, offs_d, d_mask, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_D,
                          EVEN_D, TMA_LOADS)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, K_DESC, V_DESC, DO, DQ, LSE, DELTA, TILES, PIECES, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, sm_scale,
                   qk_scale, softcap, window, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, TMA_LOADS: tl.constexpr, MULTI_RANGE: tl.constexpr):
    h, row, q_start, q_end, seg_start, prefix_start, prefix_len = _query_tile(TILES, NUM_HEADS, MULTI_RANGE)
    hk = h // GROUP

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    row_mask = q_start + offs_m < q_end
    q_rows = (q_start + offs_m).to(tl.int64)
    qd_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + q_rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + h.to(tl.int64) * T + q_start + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + h.to(tl.int64) * T + q_start + offs_m, mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    i0 = q_start - seg_start
    i1 = q_end - 1 - seg_start
    if MULTI_RANGE:  # the pieces, as in the forward
        dq = _dq_pieces(dq, q, do, lse, delta, K, V, K_DESC, V_DESC, PIECES, prefix_start, prefix_len,
                        tl.load(row + 5), i0, i1, hk, stride_kt, stride_kh, stride_vt, stride_vh, window, qk_scale,
                        softcap, offs_m, offs_n, offs_d, d_mask, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                        TMA_LOADS)
    elif prefix_len > 0:
        dq = _dq_ancestor(dq, q, do, lse, delta, K, V, K_DESC, V_DESC, prefix_start, prefix_len, prefix_len, i0, i1,
                          hk, stride_kt, stride_kh, stride_vt, stride_vh, window, qk_scale, softcap, offs_m, offs_n,
                          offs_d, d_mask, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D, TMA_LOADS)
    dq = _dq_keys(dq, q, do, lse, delta, K, V, K_DESC, V_DESC, seg_start, hk, stride_kt, stride_kh, stride_vt,
                  stride_vh, tl.maximum(i0 - window + 1, 0), i1 + 1, i1 - window + 1, i0 + 1, i0 + offs_m, window,
                  qk_scale, softcap, offs_n, offs_d, d_mask, True, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                  TMA_LOADS)
    tl.store(DQ + q_rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=qd_mask)


@triton.jit
def _atomic_add_dq(dq_ptrs, dq, row_ok, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    if MASKED:
        tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & d_mask[None, :], sem="relaxed")
    elif EVEN_D:
        tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    else:
        tl.atomic_add(dq_ptrs, dq, mask=d_mask[None, :], sem="relaxed")


@triton.jit
def _dkdv_range(dk, dv, k, v, offs_n, pos_k, max_pos_k, Q, DO, q_desc, do_desc, LSE, DELTA, DQ_ACC, h, q_head_off,
                do_head_off, lse_head_off, dq_head_off, POS, stride_qt, stride_dot, stride_dqt, lo, hi, k_start, window,
                qk_scale, softcap, offs_m, offs_d, d_mask, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                FUSE_DQ: tl.constexpr, TMA_DQ: tl.constexpr, TMA_LOADS: tl.constexpr):
    """dk, dv (N, D) += contributions of queries [lo, hi) of one query head.

    Queries of the range belong to the key tile's subtree; without a window a query sees a key iff
    it comes later in the packed order (descendants follow their ancestors), so only the diagonal and
    the range end need masks. With a window, positions decide in the masked parts, and invisible
    blocks are skipped.
    With FUSE_DQ, the block's dq = dx^T k is added to an fp32 accumulator with atomics (5 matmuls
    per block pair instead of 4 here plus 3 in a separate dQ pass; not bitwise reproducible). With
    TMA_DQ, DQ_ACC is a (T, Hq, D) tensor descriptor and each block is one bulk reduction
    (cp.reduce.async.bulk) rather than BLOCK_M * D scalar atomics: the atomics' L2 traffic is what
    made the pointer version slower than the separate pass at D=128 (PERF_NOTES.md, runs 6-7).
    """
    for start in range(lo, hi, BLOCK_M):
        i = start + offs_m
        rows = i.to(tl.int64)
        run = True
        if HAS_WINDOW and MASKED:
            pos_q = tl.load(POS + rows, mask=i < hi, other=2**30).to(tl.int32)
            run = tl.min(pos_q, 0) - max_pos_k < window
        if run:
            q = _load_rows(Q + q_head_off, stride_qt, q_desc, 0, h, start, offs_m, hi, offs_d, d_mask, MASKED, EVEN_D,
                           TMA_LOADS, BLOCK_M, BLOCK_D)
            do = _load_rows(DO + do_head_off, stride_dot, do_desc, 0, h, start, offs_m, hi, offs_d, d_mask, MASKED,
                            EVEN_D, TMA_LOADS, BLOCK_M, BLOCK_D)
            lse = tl.load(LSE + lse_head_off + rows, mask=i < hi, other=0.0)
            delta = tl.load(DELTA + lse_head_off + rows, mask=i < hi, other=0.0)
            z, t = _scores(k, q, qk_scale, softcap, HAS_SOFTCAP)  # (N, M): keys x queries
            p = tl.math.exp2(z - lse[None, :])
            if MASKED:
                vis = (i[None, :] < hi) & (i[None, :] >= k_start + offs_n[:, None])
                if HAS_WINDOW:
                    vis = vis & (pos_q[None, :] - pos_k[:, None] < window)
                p = tl.where(vis, p, 0.0)
            dv += _dot(p.to(do.dtype), do)
            dp = _dot(v, tl.trans(do))
            dx = p * (dp - delta[None, :])
            if HAS_SOFTCAP:
                dx = dx * (1.0 - t * t)
            dk += _dot(dx.to(q.dtype), q)
            if FUSE_DQ:
                dq = _dot(tl.trans(dx.to(k.dtype)), k)
                if TMA_DQ:
                    # rows past `hi` add zeros (p = 0 there); rows past T and columns past D are clipped
                    DQ_ACC.atomic_add([start, h, 0], tl.reshape(dq, [BLOCK_M, 1, BLOCK_D]))
                else:
                    _atomic_add_dq(DQ_ACC + dq_head_off + rows[:, None] * stride_dqt + offs_d[None, :], dq, i < hi,
                                   d_mask, MASKED, EVEN_D)
    return dk, dv


@triton.jit
def _partial_offsets(slot, hk, offs_n, offs_d, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Offsets of one key tile's rows [slot * BLOCK_N, +BLOCK_N) in a (slots * BLOCK_N, Hkv, BLOCK_D) fp32 partial buffer."""
    rows = (slot * BLOCK_N + offs_n).to(tl.int64)
    return (rows[:, None] * NUM_KV_HEADS + hk) * BLOCK_D + offs_d[None, :]


@triton.jit
def _store_dkdv(DK, DV, dk, dv, k_rows, hk, stride_dkt, stride_dkh, stride_dvt, stride_dvh, offs_d, mask):
    tl.store(DK + k_rows[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + k_rows[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, Q_DESC, DO_DESC, DK, DV, DQ_ACC, LSE, DELTA, POS, ITEMS, PARTIAL_DK, PARTIAL_DV,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, sm_scale, qk_scale, softcap, window,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, FUSE_DQ: tl.constexpr, TMA_DQ: tl.constexpr,
                     TMA_LOADS: tl.constexpr):
    hk, row = _program_row(ITEMS, NUM_KV_HEADS, 5)
    k_start, k_end, q_lo, q_hi, slot = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    key_ok = k_start + offs_n < k_end
    k_rows = (k_start + offs_n).to(tl.int64)
    kd_mask = key_ok[:, None] & d_mask[None, :]
    k = tl.load(K + k_rows[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kd_mask, other=0.0)
    v = tl.load(V + k_rows[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kd_mask, other=0.0)
    pos_k = tl.load(POS + k_rows, mask=key_ok, other=0).to(tl.int32)
    max_pos_k = tl.max(pos_k, 0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # every query at or after the tile's last key sees the whole tile, up to where the window
    # loses its first key: an item's positions are consecutive under a window (key_items), so that
    # is the query whose position is the first key's + window
    sees_all_hi = q_hi
    if HAS_WINDOW:
        # (positions are int64; a branch must give the same type as q_hi)
        sees_all_hi = q_lo + (tl.load(POS + k_start) - tl.load(POS + q_lo)).to(tl.int32) + window
    m1, m2 = _split_range(q_lo, q_hi, k_end - 1, sees_all_hi, BLOCK_M)
    stride_dqt = NUM_KV_HEADS * GROUP * HEAD_DIM  # DQ_ACC is a contiguous (T, Hq, HEAD_DIM) fp32 buffer
    for g in range(GROUP):
        h = hk * GROUP + g
        q_off, do_off, lse_off, dq_off = h * stride_qh, h * stride_doh, h.to(tl.int64) * T, h * HEAD_DIM
        dk, dv = _dkdv_range(dk, dv, k, v, offs_n, pos_k, max_pos_k, Q, DO, Q_DESC, DO_DESC, LSE, DELTA, DQ_ACC, h,
                             q_off, do_off, lse_off, dq_off, POS, stride_qt, stride_dot, stride_dqt, q_lo, m1, k_start,
                             window, qk_scale, softcap, offs_m, offs_d, d_mask, True, HAS_WINDOW, HAS_SOFTCAP, BLOCK_M,
                             BLOCK_D, EVEN_D, FUSE_DQ, TMA_DQ, TMA_LOADS)
        dk, dv = _dkdv_range(dk, dv, k, v, offs_n, pos_k, max_pos_k, Q, DO, Q_DESC, DO_DESC, LSE, DELTA, DQ_ACC, h,
                             q_off, do_off, lse_off, dq_off, POS, stride_qt, stride_dot, stride_dqt, m1, m2, k_start,
                             window, qk_scale, softcap, offs_m, offs_d, d_mask, False, HAS_WINDOW, HAS_SOFTCAP, BLOCK_M,
                             BLOCK_D, EVEN_D, FUSE_DQ, TMA_DQ, TMA_LOADS)
        dk, dv = _dkdv_range(dk, dv, k, v, offs_n, pos_k, max_pos_k, Q, DO, Q_DESC, DO_DESC, LSE, DELTA, DQ_ACC, h,
                             q_off, do_off, lse_off, dq_off, POS, stride_qt, stride_dot, stride_dqt, m2, q_hi, k_start,
                             window, qk_scale, softcap, offs_m, offs_d, d_mask, True, HAS_WINDOW, HAS_SOFTCAP, BLOCK_M,
                             BLOCK_D, EVEN_D, FUSE_DQ, TMA_DQ, TMA_LOADS)
    dk = dk * sm_scale
    if slot < 0:
        _store_dkdv(DK, DV, dk, dv, k_rows, hk, stride_dkt, stride_dkh, stride_dvt, stride_dvh, offs_d, kd_mask)
    else:
        # the partial of one query chunk, summed later in chunk order
        p_off = _partial_offsets(slot, hk, offs_n, offs_d, NUM_KV_HEADS, BLOCK_N, BLOCK_D)
        tl.store(PARTIAL_DK + p_off, dk)
        tl.store(PARTIAL_DV + p_off, dv)


@triton.jit
def _bwd_reduce_kernel(PARTIAL_DK, PARTIAL_DV, DK, DV, REDUCE, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                       NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """Sum a key tile's chunk partials in chunk order (fixed order: bitwise reproducible), ROWS of
    its rows per program (grid axis 1), so that a few dozen split tiles still fill the GPU."""
    hk, row = _program_row(REDUCE, NUM_KV_HEADS, 4)
    k_start, k_end, slot0, n_slots = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    offs_n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    dk = tl.zeros([ROWS, BLOCK_D], tl.float32)
    dv = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for s in range(slot0, slot0 + n_slots):
        p_off = _partial_offsets(s, hk, offs_n, offs_d, NUM_KV_HEADS, BLOCK_N, BLOCK_D)
        dk += tl.load(PARTIAL_DK + p_off)
        dv += tl.load(PARTIAL_DV + p_off)
    mask = (k_start + offs_n < k_end)[:, None] & (offs_d < HEAD_DIM)[None, :]
    _store_dkdv(DK, DV, dk, dv, (k_start + offs_n).to(tl.int64), hk, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                offs_d, mask)


# ==================================================================================== configs
@dataclass(frozen=True)
class KernelConfig:
    """Block shapes and launch settings of one pass. Block shapes shape the host tables, so they
    are picked per head dim from measurements (tools/bench_attention.py --tune, PERF_NOTES.md)
    rather than autotuned at run time."""

    block_m: int  # query rows per block
    block_n: int  # key rows per block
    num_warps: int
    num_stages: int
    tma: bool = False  # stream tiles through TMA boxes where the device and head dim allow


# pass -> ((max head dim, config), ...): the first entry whose head dim fits. The dK/dV pass keeps a
# key tile resident and streams small query blocks; the forward and dQ passes the reverse.
# "dkdv_dq" is the dK/dV pass that also accumulates dQ in fp32 (TMA bulk reductions on Hopper up to
# head dim 256, scalar atomics beyond), used unless ``deterministic``; None where the separate dQ
# pass measured faster on the H200 (all head dims up to 256 once the passes stream TMA boxes:
# 20.2 vs 21.3 ms backward at D=128, PERF_NOTES.md session 3).
GPU_CONFIGS = {
    "fwd": ((64, KernelConfig(128, 64, 4, 3, tma=True)), (128, KernelConfig(128, 128, 8, 3, tma=True)),
            (256, KernelConfig(128, 64, 8, 2, tma=True)), (512, KernelConfig(64, 64, 8, 1))),
    "dq": ((64, KernelConfig(64, 64, 4, 2, tma=True)), (128, KernelConfig(128, 64, 8, 3, tma=True)),
           (256, KernelConfig(64, 64, 4, 2, tma=True)), (512, KernelConfig(64, 32, 4, 1))),
    "dkdv": ((64, KernelConfig(64, 64, 4, 2, tma=True)), (128, KernelConfig(64, 64, 4, 2, tma=True)),
             (256, KernelConfig(32, 64, 8, 3)), (512, KernelConfig(32, 32, 8, 2))),
    "dkdv_dq": ((256, None), (512, KernelConfig(32, 32, 8, 2))),
    # the dK/dV pass with a sliding window, where None means as "dkdv": its key tiles see short query
    # ranges (each response's first queries). At the Gemma 4 sliding shape, 32 x 32 blocks take the
    # D=256 backward to 15.2 ms against 16.5 with the "dkdv" blocks (PERF_NOTES.md, run BK).
    "dkdv_window": ((128, None), (256, KernelConfig(32, 32, 4, 2, tma=True)), (512, None)),
}
# the interpreter runs blocks as numpy arrays: small blocks keep CPU tests fast and multi-block;
# dQ fused there unless deterministic, so that tests cover both backward plans. Float32 on a GPU
# takes them too: its dots multiply in full float32 (see _dot), without tensor cores, and at the
# 2-byte types' blocks would neither fit shared memory nor compile in reasonable time.
SMALL_BLOCKS = KernelConfig(16, 16, 1, 1)


def kernel_config(pass_name: str, head_dim: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> Optional[KernelConfig]:
    if device.type != "cuda" or dtype == torch.float32:
        return SMALL_BLOCKS
    return next(cfg for max_d, cfg in GPU_CONFIGS[pass_name] if head_dim <= max_d)


# ``native``: the call may run the native sm_90 kernels (dualkv_attn_sm90.native_supported); each
# pass does where it has one at this head dim, and then the native kernel's blocks shape its table
def _native_forward(head_dim: int, native: bool, multi_range_tiles: bool = False) -> bool:
    """The native forward reads single-range tiles, and multi-range tiles with their piece table
    where the build has that kernel (``native_forward_takes_pieces``; an older revision's sources,
    in an A/B, may not: then trees whose tiles see several ancestor pieces run the Triton forward)."""
    return native and head_dim in NATIVE_FWD_BLOCK_M and (not multi_range_tiles or native_forward_takes_pieces())


def _native_backward(head_dim: int, native: bool) -> bool:
    """The native backward reads ``key_items``, whose tree items have the depth-1 items' form (one
    packed query range after the key tile, visible iff query >= key, one run of positions under a
    window), so it runs trees as they are."""
    return native and head_dim in NATIVE_BLOCK_N


def backward_plan(head_dim: int, device: torch.device, deterministic: bool, native: bool = False,
                  dtype: torch.dtype = torch.bfloat16, windowed: bool = False):
    """(config of the separate dQ pass, or None when the dK/dV pass accumulates dQ; dK/dV config)."""
    if _native_backward(head_dim, native):
        return None, KernelConfig(NATIVE_BLOCK_M, NATIVE_BLOCK_N[head_dim], num_warps=12, num_stages=2)
    fused = None if deterministic else kernel_config("dkdv_dq", head_dim, device, dtype)
    if fused is not None:
        return None, fused
    return kernel_config("dq", head_dim, device, dtype), dkdv_config(head_dim, device, dtype, windowed)


def dkdv_config(head_dim: int, device: torch.device, dtype: torch.dtype, windowed: bool) -> KernelConfig:
    """The separate dK/dV pass's blocks: "dkdv_window" with a window where it has an entry, else "dkdv"."""
    window = kernel_config("dkdv_window", head_dim, device, dtype) if windowed else None
    return window or kernel_config("dkdv", head_dim, device, dtype)


def _has_tma(device: torch.device) -> bool:
    """Bulk tensor copies and reductions (TMA): Hopper and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _tma_loads(cfg: KernelConfig, head_dim: int, *tensors: torch.Tensor) -> bool:
    """Streamed tiles as TMA boxes: where the config asks, on Hopper or the interpreter (which
    emulates TMA loads, so CPU tests cover the path), for power-of-two head dims within one box, on
    tensors whose base and strides are 16-byte aligned (a TMA requirement)."""
    device = tensors[0].device
    if not cfg.tma or head_dim != triton.next_power_of_2(head_dim) or head_dim > TMA_MAX_BOX:
        return False
    if device.type == "cuda" and not _has_tma(device):
        return False
    return all(tma_aligned(t) for t in tensors)


def _streamed(cfg: KernelConfig, rows: int, a: torch.Tensor, b: torch.Tensor):
    """(TMA loads on, what the kernel streams a and b from): descriptors of (rows, 1, D) boxes of the
    (T, H, D) tensors where ``_tma_loads`` allows, else the tensors themselves (then unused)."""
    if not _tma_loads(cfg, a.shape[2], a, b):
        return False, a, b
    box = [rows, 1, a.shape[2]]
    return True, TensorDescriptor.from_tensor(a, box), TensorDescriptor.from_tensor(b, box)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# ==================================================================================== tables
def _int32(rows: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32)).to(device)


def ancestor_pieces(layout: PackedLayout) -> Tuple[Tuple[Tuple[int, int, int], ...], ...]:
    """Per segment its ancestors' keys as *pieces* ``(start, length, position)``, root first: runs
    of ancestors that follow each other in packed order too (a first child follows its parent), so
    that a piece's keys sit at consecutive packed indices and positions. A response's one piece is
    its prompt; a tree segment's path is a short list of pieces, one per branch taken after a first
    child's."""

    def build():
        out = []
        for node in layout.nodes:
            pieces, position = [], 0
            for start, length in node.ancestors:
                if pieces and pieces[-1][0] + pieces[-1][1] == start:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + length, pieces[-1][2])
                else:
                    pieces.append((start, length, position))
                position += length
            out.append(tuple(pieces))
        return tuple(out)

    return layout.derived("ancestor_pieces", build)


def multi_range(layout: PackedLayout) -> bool:
    """Whether some segment sees its ancestors as more than one piece: then the forward and dQ
    passes read multi-range tiles (``query_tiles``) and a piece table (``piece_table``)."""
    return layout.derived("multi_range", lambda: max(map(len, ancestor_pieces(layout)), default=0) > 1)


def piece_table(layout: PackedLayout) -> Optional[torch.Tensor]:
    """(m, 3) int32 ``(start, length, position)``: every segment's ``ancestor_pieces`` in segment
    order, which multi-range tiles index; None for single-range layouts (depth 1), whose tiles hold
    their one piece."""
    if not multi_range(layout):
        return None

    def build():
        rows = [piece for pieces in ancestor_pieces(layout) for piece in pieces]
        return _int32(np.asarray(rows, dtype=np.int64).reshape(-1, 3), layout.device)

    return layout.derived("piece_table", build)


def query_tiles(layout: PackedLayout, block_m: int, window: Optional[int] = None) -> torch.Tensor:
    """Query tiles of ``block_m`` rows inside one segment, heaviest first (keys seen by the last row).

    Single-range layouts (``multi_range`` False: depth 1, and trees whose ancestors are each one
    packed range): (n, 5) int32 ``(q_start, q_end, seg_start, prefix_start, prefix_len)``, the one
    piece inline (positions 0..prefix_len-1, so the segment starts at position prefix_len); the
    window is the kernels' to apply. Multi-range layouts: (n, 6) int32
    ``(q_start, q_end, seg_start, seg_pos, piece_lo, piece_hi)``, the pieces
    ``piece_table[piece_lo:piece_hi]``, without those that a window hides from every row.
    """
    if multi_range(layout):
        return layout.derived(("query_tiles", block_m, window), lambda: _multi_range_tiles(layout, block_m, window))

    def build():
        rows = []
        for node, pieces in zip(layout.nodes, ancestor_pieces(layout)):
            start, length = node.start, node.length
            prefix_start, prefix_len = pieces[0][:2] if pieces else (start, 0)
            t0 = np.arange(start, start + length, block_m)
            t1 = np.minimum(t0 + block_m, start + length)
            rows.append(np.stack([t0, t1, np.full_like(t0, start), np.full_like(t0, prefix_start),
                                  np.full_like(t0, prefix_len)], 1))
        tiles = np.concatenate(rows)
        work = tiles[:, 4] + tiles[:, 1] - tiles[:, 2]  # keys seen by the tile's last row
        return _int32(tiles[np.argsort(-work, kind="stable")], layout.device)

    return layout.derived(("query_tiles", block_m), build)


def _multi_range_tiles(layout: PackedLayout, block_m: int, window: Optional[int]) -> torch.Tensor:
    rows, first = [], 0  # first: the segment's first row in piece_table
    for node, pieces in zip(layout.nodes, ancestor_pieces(layout)):
        for q0 in range(node.start, node.start + node.length, block_m):
            # pieces wholly below the tile's first row's position - window + 1 are invisible to every row
            lowest = node.position + q0 - node.start - _window(window) + 1
            hidden = sum(1 for _, length, position in pieces if position + length <= lowest)
            rows.append((q0, min(q0 + block_m, node.start + node.length), node.start, node.position,
                         first + hidden, first + len(pieces)))
        first += len(pieces)
    tiles = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    work = np.minimum(tiles[:, 3] + tiles[:, 1] - tiles[:, 2], _window(window))  # keys seen by the last row
    return _int32(tiles[np.argsort(-work, kind="stable")], layout.device)


def _visible_query_ranges(layout: PackedLayout, block_n: int, window: Optional[int]):
    """Per key tile ``(k_start, k_end, ranges, root_start)``: the packed query ranges that see some
    key of the tile, in packed order, and the start of the tile's tree.

    A key of segment X is seen by the rest of X and by every query of X's descendants, which
    follow X in DFS order: one range ``[k_start, subtree_end(X))`` (a prompt tile: the rest of the
    prompt, then every response of its group). A window cuts each segment of it at the position
    ``window`` past the tile's last key: X's queries up to it, and each descendant's first queries
    while their positions stay below it (whole subtrees past it are skipped). Adjacent ranges are
    merged where positions run on (from a segment into its first child): with a window each range
    is one run of consecutive positions, which the dK/dV kernels rely on.
    """
    nodes = layout.nodes
    starts = [node.start for node in nodes]
    after_subtree = [bisect.bisect_left(starts, node.subtree_end) for node in nodes]  # first segment past it
    tiles = []
    for s, node in enumerate(nodes):
        for k0 in range(node.start, node.start + node.length, block_n):
            k1 = min(k0 + block_n, node.start + node.length)
            if window is None:
                tiles.append((k0, k1, [(k0, node.subtree_end)], node.root_start))
                continue
            reach = node.position + (k1 - 1 - node.start) + window  # positions below it see the last key
            hi = node.start + min(node.length, reach - node.position)
            ranges = [(k0, hi, node.position + hi - 1 - node.start)]  # + the position of the range's last query
            d = s + 1
            while d < after_subtree[s]:
                if nodes[d].position >= reach:  # nor do its descendants see the tile
                    d = after_subtree[d]
                    continue
                lo, n = nodes[d].start, min(nodes[d].length, reach - nodes[d].position)
                if ranges[-1][1] == lo and ranges[-1][2] + 1 == nodes[d].position:
                    ranges[-1] = (ranges[-1][0], lo + n, nodes[d].position + n - 1)
                else:
                    ranges.append((lo, lo + n, nodes[d].position + n - 1))
                d += 1
            tiles.append((k0, k1, [(lo, hi) for lo, hi, _ in ranges], node.root_start))
    return tiles


def key_items(layout: PackedLayout, block_n: int, block_m: int, num_kv_heads: int, sm_count: int,
              window: Optional[int] = None):
    """Work of the dK/dV pass.

    items:  (n, 5) int32 ``(k_start, k_end, q_lo, q_hi, slot)``: one key tile and one chunk of the
            queries that see it (a window leaves a prompt tile several query ranges, one per
            response; a tree segment's tile one per descendant branch); ``slot`` -1 writes dK/dV
            directly, else a partial-buffer slot. Listed chunk by chunk (chunks aligned to the
            tile's tree: its group), heaviest first inside one.
    reduce: (m, 4) int32 ``(k_start, k_end, first_slot, n_slots)`` for tiles split into several items.
    """

    def build():
        tiles = _visible_query_ranges(layout, block_n, window)
        # chunk length: enough items for a few waves of the GPU, never below one query block
        total_queries = sum(hi - lo for _, _, ranges, _ in tiles for lo, hi in ranges)
        target_items = max(len(tiles), 4 * sm_count // max(num_kv_heads, 1))
        chunk = max(block_m, -(-total_queries // target_items))
        chunk = -(-chunk // block_m) * block_m
        # Chunks are aligned to the tree and the table lists them chunk by chunk (heaviest first
        # inside one): the CTAs running at once then read the same Q and dO blocks and add into the
        # same dQ rows, so these stay in L2 instead of being read from HBM once per key tile.
        items, reduce, slots = [], [], 0
        for k0, k1, ranges, root_start in tiles:
            pieces = []  # (q_lo, q_hi, start of the chunk)
            for lo, hi in ranges:
                first = root_start + (lo - root_start) // chunk * chunk
                bounds = [lo] + list(range(first + chunk, hi, chunk)) + [hi]
                pieces += [(a, b, first + c * chunk) for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
            if len(pieces) == 1:
                items.append((k0, k1, pieces[0][0], pieces[0][1], -1, pieces[0][2]))
                continue
            reduce.append((k0, k1, slots, len(pieces)))
            items += [(k0, k1, a, b, slots + c, chunk_start) for c, (a, b, chunk_start) in enumerate(pieces)]
            slots += len(pieces)
        items = np.asarray(items, dtype=np.int64).reshape(-1, 6)  # + the start of the item's chunk
        items = items[np.lexsort((items[:, 2] - items[:, 3], items[:, 5]))][:, :5]
        return _int32(items, layout.device), _int32(np.asarray(reduce).reshape(-1, 4), layout.device), slots

    return layout.derived(("key_items", block_n, block_m, num_kv_heads, sm_count, window), build)


# ==================================================================================== launchers
@dataclass(frozen=True)
class KernelTables:
    """Everything the kernels read from a layout, for one head dim on one device."""

    fwd_tiles: torch.Tensor  # query tiles of the forward
    dq_tiles: torch.Tensor  # query tiles of the dQ pass (unused when the dK/dV pass accumulates dQ)
    pieces: Optional[torch.Tensor]  # the ancestor pieces multi-range tiles index, None for single-range ones
    kv_items: torch.Tensor  # (key tile, query chunk) work of the dK/dV pass
    kv_reduce: torch.Tensor  # split key tiles to reduce
    num_slots: int  # partial-buffer slots used by kv_items
    positions: torch.Tensor  # (T,) logical positions


@torch.compiler.disable
def kernel_tables(layout: PackedLayout, head_dim: int, num_kv_heads: int, deterministic: bool = False,
                  native: bool = False, window_size: Optional[int] = None,
                  dtype: torch.dtype = torch.bfloat16) -> KernelTables:
    """Host-built, cached per layout: never traced by torch.compile, never a device sync. The window
    trims the dK/dV work to the queries that see each key tile."""
    pieces = piece_table(layout)
    fwd_rows = (NATIVE_FWD_BLOCK_M[head_dim] if _native_forward(head_dim, native, pieces is not None)
                else kernel_config("fwd", head_dim, layout.device, dtype).block_m)
    dq, dkdv = backward_plan(head_dim, layout.device, deterministic, native, dtype, window_size is not None)
    items, reduce, slots = key_items(layout, dkdv.block_n, dkdv.block_m, num_kv_heads, _sm_count(layout.device),
                                     window_size)
    fwd_tiles = query_tiles(layout, fwd_rows, window_size)
    dq_tiles = query_tiles(layout, dq.block_m, window_size) if dq else fwd_tiles  # no dQ pass: a placeholder, not read
    return KernelTables(fwd_tiles, dq_tiles, pieces, items, reduce, slots, layout.position_ids)


def _window(window_size: Optional[int]) -> int:
    return NO_WINDOW if window_size is None else int(window_size)


def _softcap_log2(softcap: Optional[float]) -> float:
    return 0.0 if softcap is None else float(softcap) * LOG2E


def _fwd(q, k, v, tiles, pieces, sm_scale: float, window_size: Optional[int], softcap: Optional[float], native: bool):
    T, Hq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
    if _native_forward(D, native, pieces is not None):
        fwd_sm90(q, k, v, tiles, out, lse, sm_scale, window_size, pieces)
        return out, lse
    cfg = kernel_config("fwd", D, q.device, q.dtype)
    tma, k_boxes, v_boxes = _streamed(cfg, cfg.block_n, k, v)
    _fwd_kernel[(tiles.shape[0] * Hq,)](
        q, k, v, k_boxes, v_boxes, out, lse, tiles, pieces, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), T, sm_scale * LOG2E, _softcap_log2(softcap),
        _window(window_size), NUM_HEADS=Hq, GROUP=Hq // k.shape[1], HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=window_size is not None, HAS_SOFTCAP=softcap is not None,
        TMA_LOADS=tma, MULTI_RANGE=pieces is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def _bwd(do, q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, num_slots: int, positions, sm_scale: float,
         window_size: Optional[int], softcap: Optional[float], deterministic: bool, native: bool):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    BLOCK_D = triton.next_power_of_2(D)
    native = _native_backward(D, native)
    dq_cfg, kv_cfg = backward_plan(D, q.device, deterministic, native, q.dtype, window_size is not None)
    common = dict(HAS_WINDOW=window_size is not None, HAS_SOFTCAP=softcap is not None, HEAD_DIM=D, BLOCK_D=BLOCK_D)
    scalars = (sm_scale, sm_scale * LOG2E, _softcap_log2(softcap), _window(window_size))

    delta = torch.empty(Hq, T, device=q.device, dtype=torch.float32)
    _bwd_delta_kernel[(triton.cdiv(T, 64) * Hq,)](out, do, delta, out.stride(0), out.stride(1), do.stride(0),
                                                   do.stride(1), T, NUM_HEADS=Hq, HEAD_DIM=D, BLOCK_D=BLOCK_D,
                                                   BLOCK_M=64)
    atomic_dq = dq_cfg is None
    if not atomic_dq:
        dq = torch.empty_like(q)
        dq_acc = dq  # unused by the dK/dV pass
        tma, k_boxes, v_boxes = _streamed(dq_cfg, dq_cfg.block_n, k, v)
        _bwd_dq_kernel[(dq_tiles.shape[0] * Hq,)](
            q, k, v, k_boxes, v_boxes, do, dq, lse, delta, dq_tiles, pieces, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), T, *scalars,
            NUM_HEADS=Hq, GROUP=Hq // Hkv, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, TMA_LOADS=tma,
            MULTI_RANGE=pieces is not None, num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages, **common,
        )
    else:
        dq_acc = torch.zeros(T, Hq, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    partial_dk = torch.empty(max(num_slots, 1) * kv_cfg.block_n, Hkv, BLOCK_D, device=q.device, dtype=torch.float32)
    partial_dv = torch.empty_like(partial_dk)
    if native:
        dkdv_dq_sm90(q, k, v, do, lse, delta, kv_items, dk, dv, partial_dk, partial_dv, dq_acc, sm_scale,
                     window_size, positions)
    else:
        tma_dq = atomic_dq and _has_tma(q.device) and BLOCK_D <= TMA_MAX_BOX
        dq_target = TensorDescriptor.from_tensor(dq_acc, [kv_cfg.block_m, 1, BLOCK_D]) if tma_dq else dq_acc
        tma, q_boxes, do_boxes = _streamed(kv_cfg, kv_cfg.block_m, q, do)
        _bwd_dkdv_kernel[(kv_items.shape[0] * Hkv,)](
            q, k, v, do, q_boxes, do_boxes, dk, dv, dq_target, lse, delta, positions, kv_items, partial_dk, partial_dv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), T, *scalars, NUM_KV_HEADS=Hkv, GROUP=Hq // Hkv,
            BLOCK_M=kv_cfg.block_m, BLOCK_N=kv_cfg.block_n, FUSE_DQ=atomic_dq, TMA_DQ=tma_dq, TMA_LOADS=tma,
            num_warps=kv_cfg.num_warps, num_stages=kv_cfg.num_stages, **common,
        )
    if kv_reduce.shape[0]:
        # 16 x 128 fp32 dK and dV per program at D = 128; powers of two, so the slices tile block_n
        rows = min(kv_cfg.block_n, max(4, 2048 // BLOCK_D))
        _bwd_reduce_kernel[(kv_reduce.shape[0] * Hkv, kv_cfg.block_n // rows)](
            partial_dk, partial_dv, dk, dv, kv_reduce, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            NUM_KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_N=kv_cfg.block_n, ROWS=rows,
        )
    if native:  # the native pass scales dS, so dq_acc holds dQ
        dq = dq_in_head_dim_order(dq_acc, q.dtype)
    elif atomic_dq:
        dq = (dq_acc * sm_scale).to(q.dtype)
    return dq, dk, dv


# ==================================================================================== torch ops
# Custom ops make the kernels opaque nodes for torch.compile; the tables travel as tensor inputs.
@torch.library.custom_op("megatron_dualkv::dualkv_attn_fwd", mutates_args=())
def dualkv_attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd_tiles: torch.Tensor,
                       dq_tiles: torch.Tensor, pieces: Optional[torch.Tensor], kv_items: torch.Tensor,
                       kv_reduce: torch.Tensor, num_slots: int, positions: torch.Tensor, sm_scale: float,
                       window_size: Optional[int], softcap: Optional[float], deterministic: bool,
                       native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (T, Hq, D), lse (Hq, T) float32 in log2 units. The backward's tables and plan ride along
    for autograd (``pieces``: multi-range tiles' ancestor pieces, None for single-range tiles).
    ``native``: the sm_90 kernels (dualkv_attn_sm90.py) for the passes that have one at this head
    dim and table."""
    return _fwd(q, k, v, fwd_tiles, pieces, sm_scale, window_size, softcap, native)


@dualkv_attn_fwd_op.register_fake
def _(q, k, v, fwd_tiles, dq_tiles, pieces, kv_items, kv_reduce, num_slots, positions, sm_scale, window_size, softcap,
      deterministic, native):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("megatron_dualkv::dualkv_attn_bwd", mutates_args=())
def dualkv_attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dq_tiles: torch.Tensor, pieces: Optional[torch.Tensor],
                       kv_items: torch.Tensor, kv_reduce: torch.Tensor, num_slots: int, positions: torch.Tensor,
                       sm_scale: float, window_size: Optional[int], softcap: Optional[float], deterministic: bool,
                       native: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv. dK/dV chunk partials are always reduced in a fixed order; dQ comes from its own
    pass, or, where ``GPU_CONFIGS["dkdv_dq"]`` has a config and not ``deterministic``, from fp32
    atomics in the dK/dV pass; ``native``: the sm_90 dK/dV pass with fused dQ (dualkv_attn_sm90.py)."""
    return _bwd(do, q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, num_slots, positions, sm_scale,
                window_size, softcap, deterministic, native)


@dualkv_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, num_slots, positions, sm_scale, window_size,
      softcap, deterministic, native):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, _, dq_tiles, pieces, kv_items, kv_reduce, num_slots, positions, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, positions)
    ctx.num_slots = num_slots
    ctx.args = args  # sm_scale, window_size, softcap, deterministic, native


def _backward(ctx, dout, dlse, bwd=dualkv_attn_bwd_op):
    q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, positions = ctx.saved_tensors
    dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, dq_tiles, pieces, kv_items, kv_reduce, ctx.num_slots,
                     positions, *ctx.args)
    return (dq, dk, dv) + (None,) * 12


dualkv_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _DualKVAttnEager(torch.autograd.Function):
    """``dualkv_attn_fwd_op`` and its backward without the custom-op dispatcher, for eager calls. The
    dispatcher's argument handling took ~90 of ~150 us of host time per forward call on the 2-core
    CI machine (~200 of ~490 per forward + backward), time that the forward kernel's launch waits
    for (PERF_NOTES.md, session 8). Under torch.compile the custom op stays."""

    @staticmethod
    def forward(ctx, *inputs):  # dualkv_attn_fwd_op's
        q, k, v, fwd_tiles, _, pieces, *_, sm_scale, window_size, softcap, _deterministic, native = inputs
        out, lse = _fwd(q, k, v, fwd_tiles, pieces, sm_scale, window_size, softcap, native)
        _setup_context(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, bwd=_bwd)


def dualkv_attn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                       softmax_scale: Optional[float] = None, window_size: Optional[int] = None,
                       softcap: Optional[float] = None, deterministic: bool = False,
                       native: bool = False) -> torch.Tensor:
    """Fused DualKV attention. q (T, Hq, D), k/v (T, Hkv, D), D <= 512 -> (T, Hq, D).

    ``deterministic=True`` makes gradients bitwise reproducible: dQ always in its own pass, never
    with fp32 atomics (which the default uses where they measured faster: ``GPU_CONFIGS["dkdv_dq"]``).
    ``native``: run the native sm_90 kernels instead where they cover the call
    (``dualkv_attn_sm90.native_supported``).
    """
    sm_scale = check_attention_inputs(q, k, v, layout, softmax_scale, window_size, softcap)
    if q.shape[2] > 512:
        raise ValueError(f"the Triton DualKV kernels support head_dim <= 512, got {q.shape[2]}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    layout = layout.to(q.device)
    native = native and native_supported(q, k, v, window_size, softcap, deterministic)
    t = kernel_tables(layout, q.shape[2], k.shape[1], bool(deterministic), native, window_size, q.dtype)
    op = dualkv_attn_fwd_op if torch.compiler.is_compiling() else _DualKVAttnEager.apply
    out, _ = op(q, k, v, t.fwd_tiles, t.dq_tiles, t.pieces, t.kv_items, t.kv_reduce, t.num_slots, t.positions,
                sm_scale, window_size, None if softcap is None else float(softcap), bool(deterministic), native)
    return out
