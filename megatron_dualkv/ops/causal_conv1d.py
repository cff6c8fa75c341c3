"""The short causal convolution of linear-attention layers (Gated DeltaNet's, Mamba's) on the
packed layout: the reference, in any dtype, with each segment's window reaching back into its
parent segments.

Per channel c, with a kernel of width K (Qwen3.5 / Qwen3-Next: 4), for token t of a trajectory:

    y_t[c] = act( bias[c] + sum_{j=0}^{K-1} weight[c, j] * x_{t-K+1+j}[c] )      x_s = 0 before the root

On a packed micro-batch ``[P][R1]..[RN]`` the first K-1 tokens of a response must see the last
tokens of the prompt, not the previous response's tail, nor zeros: a segment's window continues
along its path to the root (its "carried-in" inputs are the last K-1 tokens of its ancestors), so
every trajectory gets what it gets alone. A parent's tail feeds several children, and its
gradient sums over them.

``causal_conv1d_func`` is the fast path. On CUDA it runs Triton kernels on the (T, C) layout: each
token reads its K rows through a table of where its window's rows are packed (``_TapTable``), so the
forward reads x and writes y once. Off CUDA one gather lays every segment out after its carried-in
rows (zeros before a root), one depthwise ``conv1d`` runs over that, and the rows of the segments'
own tokens are kept. Both sum a shared tail's gradient in a fixed order (no atomics), so the
backward is bitwise reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..layout import PackedLayout
from .checks import check_layout, runs_kernels

ACTIVATIONS = {None: lambda x: x, "silu": F.silu}


def causal_conv1d_reference(
    x: Tensor, weight: Tensor, layout: PackedLayout, bias: Optional[Tensor] = None, activation: Optional[str] = None,
) -> Tensor:
    """x: (T, C), weight: (C, K), bias: (C,) or None, activation: None or "silu" -> (T, C): the
    depthwise causal convolution of every segment of ``layout`` over its path from the root."""
    _check_inputs(x, weight, layout, bias, activation)
    width = weight.shape[1]
    outputs = []
    for node in layout.nodes:
        carried = _path_tail(node, width - 1)
        window = torch.cat([x.new_zeros(width - 1 - len(carried), x.shape[1]), x[carried],
                            x[node.start:node.start + node.length]])
        # conv1d is a cross-correlation: output t reads window[t : t + K] against weight[:, 0 : K]
        y = F.conv1d(window.T[None], weight[:, None, :], bias, groups=x.shape[1])[0].T
        outputs.append(ACTIVATIONS[activation](y))
    return torch.cat(outputs)


def causal_conv1d_func(
    x: Tensor, weight: Tensor, layout: PackedLayout, bias: Optional[Tensor] = None, activation: Optional[str] = None,
    use_kernel: Optional[bool] = None,
) -> Tensor:
    """x: (T, C), weight: (C, K), bias: (C,) or None, activation: None or "silu" -> (T, C): what
    ``causal_conv1d_reference`` computes.

    use_kernel: None, the Triton kernels on CUDA and the gather + ``conv1d`` path elsewhere (the
    interpreter would run the models' CPU passes at Python speed); True, the kernels wherever Triton
    runs (on CPU under ``TRITON_INTERPRET=1``: the tests); False, the gather + ``conv1d`` path: every
    segment laid out after its K-1 carried-in rows (the last inputs of its path, zeros before a
    root), so a valid convolution over that extended sequence gives each own token the window it
    has alone, and the rows in front of each segment absorb the windows that would straddle two.
    The kernels accumulate in float32, so float64 takes that path (use_kernel=True refuses it).
    """
    _check_inputs(x, weight, layout, bias, activation)
    width = weight.shape[1]
    if x.dtype == torch.float64 and use_kernel:
        raise ValueError("causal_conv1d_func: the kernels accumulate in float32; float64 runs the gather + conv1d "
                         "path (use_kernel=None or False)")
    if runs_kernels(x, use_kernel):
        if width > MAX_KERNEL_WIDTH:
            raise ValueError(f"causal_conv1d_func: the kernels take widths up to {MAX_KERNEL_WIDTH}, got {width}; "
                             "pass use_kernel=False")
        table = layout.derived(("causal_conv1d_taps", width, x.device),
                               lambda: _TapTable.build(layout, width, x.device))
        return _CausalConv1d.apply(x, weight, bias, table, activation)
    plan = layout.derived(("causal_conv1d", width, x.device), lambda: _ExtendedLayout.build(layout, width, x.device))
    extended = GatherRows.apply(x, plan.gather)  # (T + S (K-1), C)
    y = F.conv1d(extended.T[None], weight[:, None, :], bias, groups=x.shape[1])[0].T
    return ACTIVATIONS[activation](y.index_select(0, plan.outputs))


MAX_KERNEL_WIDTH = 8
# Tokens per program of each kernel (the dpre kernel's per-block dw partials are summed by torch), and
# channels per program. 8 warps is what the GPU tests have run; a sweep on an H200 at 24,576 x 8,192
# ran 4 warps 1.4x faster (PERF_NOTES.md, run FT), the next setting to test there.
FWD_BLOCK_T, DPRE_BLOCK_T, DX_BLOCK_T, BLOCK_C, WARPS = 32, 64, 32, 128, 8


# For token t and tap j < K, taps[t, j] is the packed row of x_{t-K+1+j} along t's path (-1: before
# the root, reads zero); taps[t, K-1] = t. Per channel c (fp32, one rounding to y's dtype):
#     pre[t, c] = bias[c] + sum_j weight[c, j] * x[taps[t, j], c]        y[t, c] = act(pre[t, c])
@triton.jit
def _conv_fwd_kernel(X, W, B, TAPS, Y, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    pre = _pre_activation(X, W, B, TAPS, rows, cols, T, C, K, HAS_BIAS, BT, BC)
    y = pre * tl.sigmoid(pre) if SILU else pre
    inside = (rows < T)[:, None] & (cols < C)[None, :]
    tl.store(Y + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _tap(X, TAPS, rows, cols, in_rows, in_cols, C, j, K: tl.constexpr):
    """x[taps[t, j], c] of the tile's rows t in float32, zero where the tap is before the root."""
    src = tl.load(TAPS + rows.to(tl.int64) * K + j, mask=in_rows, other=-1)
    x = tl.load(X + src.to(tl.int64)[:, None] * C + cols[None, :], mask=(src >= 0)[:, None] & in_cols[None, :],
                other=0.0)
    return x.to(tl.float32)


@triton.jit
def _pre_activation(X, W, B, TAPS, rows, cols, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    in_rows, in_cols = rows < T, cols < C
    acc = tl.zeros([BT, BC], tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):  # unrolled: the K row gathers can be in flight together
        w = tl.load(W + cols * K + j, mask=in_cols, other=0.0).to(tl.float32)
        acc += w[None, :] * _tap(X, TAPS, rows, cols, in_rows, in_cols, C, j, K)
    return acc


# The backward's first half: dpre = dy * act'(pre) (pre recomputed from x, not kept), written in fp32,
# and this block's share of the weight and bias gradients,
#     dw[c, j] = sum_t dpre[t, c] * x[taps[t, j], c]        db[c] = sum_t dpre[t, c],
# as per-block partials that torch sums in block order (a fixed order: no atomics).
@triton.jit
def _conv_bwd_dpre_kernel(X, W, B, TAPS, DY, DPRE, DW_PART, DB_PART, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    block = tl.program_id(0)
    rows = block * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    in_rows, in_cols = rows < T, cols < C
    inside = in_rows[:, None] & in_cols[None, :]
    offsets = rows.to(tl.int64)[:, None] * C + cols[None, :]
    dpre = tl.load(DY + offsets, mask=inside, other=0.0).to(tl.float32)
    if SILU:  # silu'(p) = s (1 + p (1 - s)), s = sigmoid(p)
        pre = _pre_activation(X, W, B, TAPS, rows, cols, T, C, K, HAS_BIAS, BT, BC)
        s = tl.sigmoid(pre)
        dpre = dpre * s * (1 + pre * (1 - s))
    tl.store(DPRE + offsets, dpre, mask=inside)
    part = block.to(tl.int64) * K * C
    for j in tl.static_range(K):  # the taps again: cache hits of the loads above
        tl.store(DW_PART + part + j * C + cols, tl.sum(dpre * _tap(X, TAPS, rows, cols, in_rows, in_cols, C, j, K), 0),
                 mask=in_cols)
    if HAS_BIAS:
        tl.store(DB_PART + block.to(tl.int64) * C + cols, tl.sum(dpre, 0), mask=in_cols)


# The backward's second half: row s of x feeds every (t, j) with taps[t, j] = s, so
#     dx[s, c] = sum over s's readers (t, j) of weight[c, j] * dpre[t, c],
# in fp32, written once: each dx row has one program, nothing races. Almost every reader is packed
# m = K-1-j rows after s (within a segment, or a child right after its parent): those are found by
# checking taps[s + m, K-1-m] == s, with contiguous rows and no list. The others (a prompt's last K-1
# rows read by every further response; a tree segment's children packed later) come from a short
# list per row (``_TapTable.far_readers``), after the near ones, in increasing t K + j: a fixed order.
@triton.jit
def _conv_bwd_dx_kernel(W, DPRE, TAPS, FAR_START, FAR_READERS, BLOCK_FAR, DX, T, C, K: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    in_rows, in_cols = rows < T, cols < C
    acc = tl.zeros([BT, BC], tl.float32)
    for m in tl.static_range(K):
        t = rows + m
        near = tl.load(TAPS + t.to(tl.int64) * K + (K - 1 - m), mask=t < T, other=-1) == rows
        w = tl.load(W + cols * K + (K - 1 - m), mask=in_cols, other=0.0).to(tl.float32)
        dpre = tl.load(DPRE + t.to(tl.int64)[:, None] * C + cols[None, :], mask=near[:, None] & in_cols[None, :],
                       other=0.0)
        acc += w[None, :] * dpre
    start = tl.load(FAR_START + rows, mask=in_rows, other=0)
    count = tl.load(FAR_START + rows + 1, mask=in_rows, other=0) - start
    for e in range(tl.load(BLOCK_FAR + tl.program_id(0))):  # 0 in almost every block
        live = e < count
        reader = tl.load(FAR_READERS + start + e, mask=live, other=0)  # t K + j
        # names of their own: a name the unrolled loop above assigned would be carried through this one
        far_t, far_j = reader // K, reader % K
        far_w = tl.load(W + cols[None, :] * K + far_j[:, None], mask=live[:, None] & in_cols[None, :], other=0.0)
        far_dpre = tl.load(DPRE + far_t.to(tl.int64)[:, None] * C + cols[None, :],
                           mask=live[:, None] & in_cols[None, :], other=0.0)
        acc += far_w.to(tl.float32) * far_dpre
    tl.store(DX + rows.to(tl.int64)[:, None] * C + cols[None, :], acc.to(DX.dtype.element_ty),
             mask=in_rows[:, None] & in_cols[None, :])


@dataclass(frozen=True)
class _TapTable:
    """Where each token's window is packed, and who reads each row far away: the kernels' view of a layout.

    taps: (T, K) int32, the packed row of x_{t-K+1+j} along t's path, -1 before the root;
    far_readers: every (t, j) with s = taps[t, j] >= 0 but t != s + K-1-j, as t K + j, grouped by s
    and in increasing t K + j within a row; far_start: (T + 1,) int32, row s's are
    far_readers[far_start[s]:far_start[s + 1]]; block_far: (blocks of DX_BLOCK_T rows,) int32, the
    longest list in each block."""

    taps: Tensor
    far_readers: Tensor
    far_start: Tensor
    block_far: Tensor

    @classmethod
    def build(cls, layout: PackedLayout, width: int, device) -> "_TapTable":
        tokens = layout.total_tokens
        source, starts = _extended_rows(layout, width - 1)
        taps = source[starts[:, None] + torch.arange(width)]  # (T, K): each token's window
        flat = taps.flatten()
        reader = torch.arange(flat.numel())
        near = flat == reader // width + reader % width - (width - 1)
        far = torch.nonzero((flat >= 0) & ~near).flatten()
        far = far[torch.argsort(flat[far], stable=True)]  # by the row read, then t K + j
        counts = torch.bincount(flat[far], minlength=tokens)
        far_start = torch.zeros(tokens + 1, dtype=torch.int64)
        far_start[1:] = torch.cumsum(counts, 0)
        padded = torch.zeros(triton.cdiv(tokens, DX_BLOCK_T) * DX_BLOCK_T, dtype=torch.int64)
        padded[:tokens] = counts
        block_far = padded.view(-1, DX_BLOCK_T).amax(1)
        return cls(*(t.to(device=device, dtype=torch.int32) for t in (taps, far, far_start, block_far)))


class _CausalConv1d(torch.autograd.Function):
    """The Triton path of ``causal_conv1d_func``: keeps x (and the parameters), recomputes pre in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], table: _TapTable, activation: Optional[str]):
        x, weight = x.contiguous(), weight.contiguous()
        tokens, channels = x.shape
        y = torch.empty_like(x)
        grid = (triton.cdiv(tokens, FWD_BLOCK_T), triton.cdiv(channels, BLOCK_C))
        if tokens and channels:
            _conv_fwd_kernel[grid](x, weight, bias if bias is not None else weight, table.taps, y, tokens, channels,
                                   K=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu",
                                   BT=FWD_BLOCK_T, BC=BLOCK_C, num_warps=WARPS)
        ctx.save_for_backward(x, weight, bias)
        ctx.table, ctx.activation = table, activation
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, bias = ctx.saved_tensors
        table, (tokens, channels), width = ctx.table, x.shape, weight.shape[1]
        dy = dy.contiguous()
        blocks = triton.cdiv(tokens, DPRE_BLOCK_T)
        dpre = torch.empty(tokens, channels, device=x.device, dtype=torch.float32)
        # every block writes its whole (K, C) partial (its rows past T add zeros): nothing to zero
        dw_part = torch.empty(blocks, width, channels, device=x.device, dtype=torch.float32)
        db_part = torch.empty(blocks, channels, device=x.device, dtype=torch.float32) if bias is not None else dw_part
        dx = torch.empty_like(x)
        if tokens and channels:
            _conv_bwd_dpre_kernel[(blocks, triton.cdiv(channels, BLOCK_C))](
                x, weight, bias if bias is not None else weight, table.taps, dy, dpre, dw_part, db_part, tokens,
                channels, K=width, HAS_BIAS=bias is not None, SILU=ctx.activation == "silu", BT=DPRE_BLOCK_T,
                BC=BLOCK_C, num_warps=WARPS)
            _conv_bwd_dx_kernel[(triton.cdiv(tokens, DX_BLOCK_T), triton.cdiv(channels, BLOCK_C))](
                weight, dpre, table.taps, table.far_start, table.far_readers, table.block_far, dx, tokens, channels,
                K=width, BT=DX_BLOCK_T, BC=BLOCK_C, num_warps=WARPS)
        dweight = dw_part.sum(0).T.to(weight.dtype)
        dbias = None if bias is None else db_part.sum(0).to(bias.dtype)
        return dx, dweight, dbias, None, None


@dataclass(frozen=True)
class RowGatherPlan:
    """``x[source]`` with zeros where ``source`` is -1, and its backward as a fixed-order sum.

    A row of x read k times is summed over k occurrence ranks, one ``index_add_`` per rank; within a
    rank every row of x appears at most once, so no two additions race and the order is fixed."""

    source: Tensor  # (L,) int64, -1 already replaced by 0
    zero: Optional[Tensor]  # (L, 1) bool: the rows that read zero, or None
    ranks: Tuple[Tuple[Tensor, Tensor], ...]  # per occurrence rank: (rows of x, positions in the gather)
    rows: int  # rows of x

    @classmethod
    def build(cls, source: Tensor, rows: int) -> "RowGatherPlan":
        positions = torch.nonzero(source >= 0).flatten()
        read = source[positions]
        order = torch.argsort(read, stable=True)
        ordered = read[order]
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        run_starts = torch.nonzero(first).flatten()
        rank = torch.empty_like(read)
        rank[order] = torch.arange(len(read), device=read.device) - run_starts[torch.cumsum(first, 0) - 1]
        ranks = tuple((read[rank == r], positions[rank == r]) for r in range(int(rank.max()) + 1 if len(rank) else 0))
        zero = (source < 0)[:, None]
        return cls(source.clamp(min=0), zero if bool(zero.any()) else None, ranks, rows)


class GatherRows(torch.autograd.Function):
    """x (rows, C) -> x[plan.source] with the plan's zero rows; the backward sums duplicates in order."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: RowGatherPlan) -> Tensor:
        ctx.plan = plan
        out = x.index_select(0, plan.source)
        return out if plan.zero is None else out.masked_fill_(plan.zero, 0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan = ctx.plan
        dx = grad.new_zeros(plan.rows, grad.shape[1])
        for rows, positions in plan.ranks:
            dx.index_add_(0, rows, grad.index_select(0, positions))
        return dx, None


@dataclass(frozen=True)
class _ExtendedLayout:
    """Where ``causal_conv1d_func`` reads: the gather of every segment after its carried-in rows, and
    the rows of the valid convolution's output that are the segments' own tokens."""

    gather: RowGatherPlan
    outputs: Tensor  # (T,) int64

    @classmethod
    def build(cls, layout: PackedLayout, width: int, device) -> "_ExtendedLayout":
        source, outputs = _extended_rows(layout, width - 1)
        return cls(RowGatherPlan.build(source.to(device), layout.total_tokens), outputs.to(device))


def _extended_rows(layout: PackedLayout, carry: int) -> Tuple[Tensor, Tensor]:
    """Every segment laid out after its ``carry`` carried-in rows: (the packed row each extended row
    reads, -1 for a zero before a root; per own token, the extended row its window starts at). A
    valid convolution's row i reads extended rows i .. i + carry, so token i's window starts where
    its output row is."""
    source: List[int] = []
    starts: List[int] = []
    for node in layout.nodes:
        tail = _path_tail(node, carry)
        starts.extend(range(len(source), len(source) + node.length))
        source.extend([-1] * (carry - len(tail)) + tail + list(range(node.start, node.start + node.length)))
    return torch.tensor(source, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)


def _path_tail(node, count: int) -> list:
    """The packed indices of the last ``count`` tokens before ``node`` along its path (fewer near the root)."""
    tail: list = []
    for start, length in reversed(node.ancestors):
        if len(tail) == count:
            break
        take = min(length, count - len(tail))
        tail[:0] = range(start + length - take, start + length)
    return tail


def _check_inputs(x, weight, layout, bias, activation) -> None:
    check_layout(layout)
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != layout.total_tokens:
        raise ValueError(f"x must be (tokens, channels) with the layout's {layout.total_tokens} tokens, "
                         f"got shape {getattr(x, 'shape', None)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
        raise ValueError(f"weight must be (channels, width) = ({x.shape[1]}, K), got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias must be (channels,) = ({x.shape[1]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, got {activation!r}")
    if any(t is not None and t.device != x.device for t in (weight, bias)):
        raise ValueError(f"x is on {x.device}, weight on {weight.device}"
                         + ("" if bias is None else f", bias on {bias.device}") + ": one device")
