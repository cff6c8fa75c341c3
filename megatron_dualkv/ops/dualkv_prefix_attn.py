"""DualKV attention of response micro-batches against a prompt K/V held outside them (prefix reuse).

When a group is too large for one micro-batch, its prompt runs once and its per-layer K/V are held;
each micro-batch of its responses (``PrefixedLayout``) then attends to two key sets:

    A, the group's prefix: every prompt key (up to the window), from the separate operand prefix_k/v;
    B, the responses themselves: each response causally, from k/v (or, for the rest of a prefix
       tree whose shared path is held, each token its ancestors within the micro-batch and itself).

No concatenation: the two pieces are attention over different tensors, merged by their
log-sum-exp (per query row i, log2 domain as in ``ops.dualkv_attn``):

    lse_i = log2(2^lseA_i + 2^lseB_i),   o_i = 2^(lseA_i - lse_i) oA_i + 2^(lseB_i - lse_i) oB_i

which is exactly the softmax over the union of the keys. The backward needs no gradient of the
pieces' lse: with the merged o and lse, p_ij = 2^(z_ij - lse_i) and delta_i = do_i . o_i are the
union's, so each piece's flash backward, run on the merged (o, lse), gives that piece's exact
share of dq and the exact dk/dv of its keys (dq = dqA + dqB).

Triton backend: piece B is the causal DualKV kernels (``ops.dualkv_attn``) on the responses as
plain sequences, or on the segments' tree (a window sees the same position differences there);
piece A is the kernels below, flash attention of the queries of each group over that group's
prefix rows, in each pass's blocks of the DualKV kernels (``kernel_config``; math as in
``ops.dualkv_attn``, c = softcap, s = softmax scale, key j at logical position j of its prompt):

    forward, per (query tile, query head), tiles inside one group:
        z_ij = s q_i . k_j (or c tanh(s q_i . k_j / c)), visible iff pos_i - j < window;
        online softmax -> oA_i (float32), lseA_i (log2; -inf for padding rows, which see no prefix)
    dQ, per (query tile, query head), on the merged lse_i and delta_i = do_i . o_i:
        p_ij = 2^(z_ij log2 e - lse_i), dx_ij = p_ij (do_i . v_j - delta_i) (1 - tanh^2),
        dqA_i = s sum_j dx_ij k_j
    dK/dV, per (prefix key tile, key/value head), over the group's queries and the query heads of
    the key/value head (GQA reduced in the program): dv_j = sum_i p_ij do_i, dk_j = s sum_i dx_ij q_i.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from ..layout import DualKVLayout, PackedLayout, PrefixedLayout, TreeLayout
from .checks import check_prefix_attention_inputs
from .dualkv_attn import (LOG2E, NO_WINDOW, KernelConfig, _bwd, _dot, _fwd, _program_row, _scores, dkdv_config,
                          kernel_config, kernel_tables)

# ==================================================================================== kernels


@triton.jit
def _rows(base, rows, ok, stride_t, offs_d, d_mask):
    """(len(rows), BLOCK_D) of one head; rows past ``ok`` and columns past HEAD_DIM read 0."""
    return tl.load(base + rows.to(tl.int64)[:, None] * stride_t + offs_d[None, :], mask=ok[:, None] & d_mask[None, :],
                   other=0.0)


@triton.jit
def _visible(pos_q, j, ok_q, ok_k, window, HAS_WINDOW: tl.constexpr):
    """Query row and prefix key valid, and the key (at position j) inside the window; the arguments
    come broadcastable, as queries x keys or keys x queries."""
    mask = ok_q & ok_k
    if HAS_WINDOW:
        mask = mask & (pos_q - j < window)
    return mask


@triton.jit
def _prefix_fwd_kernel(Q, PK, PV, O, LSE, POS, TILES, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ot, stride_oh, T, qk_scale, softcap, window, NUM_HEADS: tl.constexpr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    h, row = _program_row(TILES, NUM_HEADS, 4)
    q_start, q_end, k_start, k_len = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    hk = h // GROUP
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = q_start + offs_m
    ok_q = rows < q_end
    q = _rows(Q + h * stride_qh, rows, ok_q, stride_qt, offs_d, d_mask)
    pos = tl.load(POS + rows, mask=ok_q, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, k_len, BLOCK_N):
        j = start + offs_n
        ok_k = j < k_len
        k = _rows(PK + hk * stride_kh, k_start + j, ok_k, stride_kt, offs_d, d_mask)
        v = _rows(PV + hk * stride_vh, k_start + j, ok_k, stride_vt, offs_d, d_mask)
        z, _ = _scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
        visible = _visible(pos[:, None], j[None, :], ok_q[:, None], ok_k[None, :], window, HAS_WINDOW)
        z = tl.where(visible, z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: p = 0, not NaN
        p = tl.math.exp2(z - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        m_i = m_new
    # a window can hide the whole prefix from a row: its piece is empty, lse -inf
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(LSE + h.to(tl.int64) * T + rows, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=ok_q)
    tl.store(O + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :], acc / l_safe[:, None],
             mask=ok_q[:, None] & d_mask[None, :])


@triton.jit
def _prefix_dq_kernel(Q, PK, PV, DO, DQ, LSE, DELTA, POS, TILES, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                      stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, T, sm_scale, qk_scale, softcap,
                      window, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr):
    h, row = _program_row(TILES, NUM_HEADS, 4)
    q_start, q_end, k_start, k_len = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    hk = h // GROUP
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = q_start + offs_m
    ok_q = rows < q_end
    q = _rows(Q + h * stride_qh, rows, ok_q, stride_qt, offs_d, d_mask)
    do = _rows(DO + h * stride_doh, rows, ok_q, stride_dot, offs_d, d_mask)
    pos = tl.load(POS + rows, mask=ok_q, other=0)
    lse = tl.load(LSE + h.to(tl.int64) * T + rows, mask=ok_q, other=0.0)
    delta = tl.load(DELTA + h.to(tl.int64) * T + rows, mask=ok_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, k_len, BLOCK_N):
        j = start + offs_n
        ok_k = j < k_len
        k = _rows(PK + hk * stride_kh, k_start + j, ok_k, stride_kt, offs_d, d_mask)
        v = _rows(PV + hk * stride_vh, k_start + j, ok_k, stride_vt, offs_d, d_mask)
        z, t = _scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
        visible = _visible(pos[:, None], j[None, :], ok_q[:, None], ok_k[None, :], window, HAS_WINDOW)
        p = tl.where(visible, tl.math.exp2(z - lse[:, None]), 0.0)
        dx = p * (_dot(do, tl.trans(v)) - delta[:, None])
        if HAS_SOFTCAP:
            dx = dx * (1.0 - t * t)
        dq += _dot(dx.to(k.dtype), k)
    tl.store(DQ + rows.to(tl.int64)[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], dq * sm_scale,
             mask=ok_q[:, None] & d_mask[None, :])


@triton.jit
def _prefix_dkdv_kernel(Q, PK, PV, DO, DPK, DPV, LSE, DELTA, POS, TILES, stride_qt, stride_qh, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                        T, sm_scale, qk_scale, softcap, window, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    hk, row = _program_row(TILES, NUM_KV_HEADS, 5)
    k_start, k_end, j0 = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    q_start, q_end = tl.load(row + 3), tl.load(row + 4)
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    ok_k = k_start + offs_n < k_end
    j = j0 + offs_n  # the keys' positions in their prompt
    k = _rows(PK + hk * stride_kh, k_start + offs_n, ok_k, stride_kt, offs_d, d_mask)
    v = _rows(PV + hk * stride_vh, k_start + offs_n, ok_k, stride_vt, offs_d, d_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        for start in range(q_start, q_end, BLOCK_M):
            rows = start + offs_m
            ok_q = rows < q_end
            q = _rows(Q + h * stride_qh, rows, ok_q, stride_qt, offs_d, d_mask)
            do = _rows(DO + h * stride_doh, rows, ok_q, stride_dot, offs_d, d_mask)
            pos = tl.load(POS + rows, mask=ok_q, other=0)
            lse = tl.load(LSE + h.to(tl.int64) * T + rows, mask=ok_q, other=0.0)
            delta = tl.load(DELTA + h.to(tl.int64) * T + rows, mask=ok_q, other=0.0)
            # keys x queries, as the DualKV kernels' dK/dV pass: with queries x keys and a softcap,
            # the D256 blocks (32 x 64, 8 warps) gave a wrong dk on the H200 (PERF_NOTES, session 31)
            z, t = _scores(k, q, qk_scale, softcap, HAS_SOFTCAP)
            p = tl.where(_visible(pos[None, :], j[:, None], ok_q[None, :], ok_k[:, None], window, HAS_WINDOW),
                         tl.math.exp2(z - lse[None, :]), 0.0)
            dv += _dot(p.to(do.dtype), do)
            dx = p * (_dot(v, tl.trans(do)) - delta[None, :])
            if HAS_SOFTCAP:
                dx = dx * (1.0 - t * t)
            dk += _dot(dx.to(q.dtype), q)
    k_rows = (k_start + offs_n).to(tl.int64)
    mask = ok_k[:, None] & d_mask[None, :]
    tl.store(DPK + k_rows[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], (dk * sm_scale).to(DPK.dtype.element_ty),
             mask=mask)
    tl.store(DPV + k_rows[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DPV.dtype.element_ty),
             mask=mask)


# ==================================================================================== host side
def _backward_configs(head_dim: int, device: torch.device, dtype: torch.dtype,
                      windowed: bool) -> Dict[str, KernelConfig]:
    """The backward passes' blocks: the DualKV kernels' for the same pass, whose inner loops these
    share (the forward's likewise, ``kernel_config``), the dK/dV pass's with a window as theirs
    (``dkdv_window``). A prompt held for prefix reuse is long (a 127K-token prompt against 32K
    queries a part), so its tiles need the tensor-core shapes of the main kernels."""
    return {"dq": kernel_config("dq", head_dim, device, dtype), "dkdv": dkdv_config(head_dim, device, dtype, windowed)}


def _query_tiles(layout: PrefixedLayout, block: int) -> torch.Tensor:
    """(q_start, q_end, prefix row, prefix_len) of query tiles of ``block`` rows inside one group."""
    return layout.derived(("prefix_query_tiles", block), lambda: _as_table(
        [(s, min(s + block, end), prefix_start, prefix_len)
         for prefix_start, prefix_len, start, end in _group_rows(layout) for s in range(start, end, block)],
        layout.device))


def _key_tiles(layout: PrefixedLayout, block: int) -> torch.Tensor:
    """(row, row end, position of the first, q_start, q_end) of prefix key tiles of ``block`` rows,
    with their group's queries."""
    return layout.derived(("prefix_key_tiles", block), lambda: _as_table(
        [(prefix_start + j, prefix_start + min(j + block, prefix_len), j, start, end)
         for prefix_start, prefix_len, start, end in _group_rows(layout) for j in range(0, prefix_len, block)],
        layout.device))


def _group_rows(layout: PrefixedLayout):
    """Per group: its prefix's first row and length, and its queries' rows [start, end)."""
    start = 0
    for prefix_start, prefix_len, lens in zip(layout.prefix_starts, layout.prefix_lens, layout.response_lens):
        yield prefix_start, prefix_len, start, start + sum(lens)
        start += sum(lens)


def _as_table(rows, device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _causal_layout(layout: PrefixedLayout) -> PackedLayout:
    """Piece B's layout: the responses as plain causal sequences, or the segments' tree."""

    def build():
        lens = tuple(r for rs in layout.response_lens for r in rs)
        if layout.is_tree:
            # the segments' own tree (positions from 0: piece B's window reads differences only)
            parents = tuple(n.parent for n in layout.nodes[: len(lens)])
            return TreeLayout(lens, parents, layout.pad_len, layout.device)
        return DualKVLayout(lens, ((),) * len(lens), layout.pad_len, layout.device)

    return layout.derived("prefix_attn_causal", build)


def _flags(q, prefix_k, window_size, softcap, cfg: KernelConfig):
    D = q.shape[2]
    return dict(GROUP=q.shape[1] // prefix_k.shape[1], HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=window_size is not None,
                HAS_SOFTCAP=softcap is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _scalars(scale, window_size, softcap):
    return (scale * LOG2E, 0.0 if softcap is None else softcap * LOG2E,
            NO_WINDOW if window_size is None else int(window_size))


class _PrefixAttnTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, layout, scale, window_size, softcap, deterministic):
        T, Hq, D = q.shape
        t = kernel_tables(_causal_layout(layout), D, k.shape[1], deterministic, False, window_size, q.dtype)
        cfg = kernel_config("fwd", D, q.device, q.dtype)
        query_tiles = _query_tiles(layout, cfg.block_m)
        out_b, lse_b = _fwd(q, k, v, t.fwd_tiles, t.pieces, scale, window_size, softcap, False)
        out_a = torch.zeros(T, Hq, D, device=q.device, dtype=torch.float32)
        lse_a = torch.full((Hq, T), float("-inf"), device=q.device, dtype=torch.float32)
        positions = layout.position_ids
        if query_tiles.shape[0]:
            _prefix_fwd_kernel[(query_tiles.shape[0] * Hq,)](
                q, prefix_k, prefix_v, out_a, lse_a, positions, query_tiles, q.stride(0), q.stride(1),
                prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1), out_a.stride(0),
                out_a.stride(1), T, *_scalars(scale, window_size, softcap), NUM_HEADS=Hq,
                **_flags(q, prefix_k, window_size, softcap, cfg))
        # the merge: the softmax over both key sets (module docstring), in float32
        lse = torch.logaddexp2(lse_a, lse_b)
        weight = lambda piece_lse: torch.exp2(piece_lse - lse).t().unsqueeze(-1)  # noqa: E731
        out = (out_a * weight(lse_a) + out_b.float() * weight(lse_b)).to(q.dtype)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse)
        ctx.args = (layout, t, scale, window_size, softcap, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, prefix_k, prefix_v, out, lse = ctx.saved_tensors
        layout, t, scale, window_size, softcap, deterministic = ctx.args
        dout = dout.contiguous()
        T, Hq, D = q.shape
        # piece B on the merged (out, lse): its exact share (module docstring)
        dq_b, dk, dv = _bwd(dout, q, k, v, out, lse, t.dq_tiles, t.pieces, t.kv_items, t.kv_reduce, t.num_slots,
                            t.positions, scale, window_size, softcap, deterministic, False)
        configs = _backward_configs(D, q.device, q.dtype, window_size is not None)
        query_tiles, key_tiles = _query_tiles(layout, configs["dq"].block_m), _key_tiles(layout, configs["dkdv"].block_n)
        delta = (dout.float() * out.float()).sum(-1).t().contiguous()
        dq_a = torch.zeros(T, Hq, D, device=q.device, dtype=torch.float32)
        dpk, dpv = torch.zeros_like(prefix_k), torch.zeros_like(prefix_v)
        positions = layout.position_ids
        scalars = (scale, *_scalars(scale, window_size, softcap))
        if query_tiles.shape[0]:
            _prefix_dq_kernel[(query_tiles.shape[0] * Hq,)](
                q, prefix_k, prefix_v, dout, dq_a, lse, delta, positions, query_tiles, q.stride(0), q.stride(1),
                prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1), dout.stride(0),
                dout.stride(1), dq_a.stride(0), dq_a.stride(1), T, *scalars, NUM_HEADS=Hq,
                **_flags(q, prefix_k, window_size, softcap, configs["dq"]))
            _prefix_dkdv_kernel[(key_tiles.shape[0] * prefix_k.shape[1],)](
                q, prefix_k, prefix_v, dout, dpk, dpv, lse, delta, positions, key_tiles, q.stride(0), q.stride(1),
                prefix_k.stride(0), prefix_k.stride(1), prefix_v.stride(0), prefix_v.stride(1), dout.stride(0),
                dout.stride(1), dpk.stride(0), dpk.stride(1), dpv.stride(0), dpv.stride(1), T, *scalars,
                NUM_KV_HEADS=prefix_k.shape[1], **_flags(q, prefix_k, window_size, softcap, configs["dkdv"]))
        dq = (dq_a + dq_b.float()).to(q.dtype)
        return dq, dk, dv, dpk, dpv, None, None, None, None, None


def dualkv_prefix_attn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
                              prefix_v: torch.Tensor, layout: PrefixedLayout, softmax_scale: Optional[float] = None,
                              window_size: Optional[int] = None, softcap: Optional[float] = None,
                              deterministic: bool = False) -> torch.Tensor:
    """``dualkv_prefix_attn_func`` on the Triton kernels: q (T, Hq, D), k/v (T, Hkv, D), prefix_k/v
    (sum(prefix_lens), Hkv, D), D <= 512 -> (T, Hq, D)."""
    scale = check_prefix_attention_inputs(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size, softcap)
    if q.shape[2] > 512:
        raise ValueError(f"the Triton DualKV kernels support head_dim <= 512, got {q.shape[2]}")
    q, k, v, prefix_k, prefix_v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, prefix_k, prefix_v))
    return _PrefixAttnTriton.apply(q, k, v, prefix_k, prefix_v, layout.to(q.device), scale, window_size,
                                   None if softcap is None else float(softcap), bool(deterministic))
