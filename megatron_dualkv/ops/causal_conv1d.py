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

``causal_conv1d_func`` is the fast path on any device: one gather lays every segment out after its
carried-in rows (zeros before a root), one depthwise ``conv1d`` runs over that, and the rows of the
segments' own tokens are kept. Its gather sums a shared tail's gradient in a fixed order (no
atomics), so the backward is bitwise reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout import PackedLayout
from .checks import check_layout

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
) -> Tensor:
    """x: (T, C), weight: (C, K), bias: (C,) or None, activation: None or "silu" -> (T, C): what
    ``causal_conv1d_reference`` computes, as one gather and one depthwise convolution.

    Every segment is laid out after its K-1 carried-in rows (the last inputs of its path, zeros
    before a root); a valid convolution over that extended sequence gives each own token the window
    it has alone, and the rows in front of each segment absorb the windows that would straddle two.
    """
    _check_inputs(x, weight, layout, bias, activation)
    width = weight.shape[1]
    plan = layout.derived(("causal_conv1d", width, x.device), lambda: _ExtendedLayout.build(layout, width, x.device))
    extended = GatherRows.apply(x, plan.gather)  # (T + S (K-1), C)
    y = F.conv1d(extended.T[None], weight[:, None, :], bias, groups=x.shape[1])[0].T
    return ACTIVATIONS[activation](y.index_select(0, plan.outputs))


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
        carry = width - 1
        source: List[int] = []
        outputs: List[int] = []
        for node in layout.nodes:
            tail = _path_tail(node, carry)
            # a valid convolution's row i reads extended rows i .. i + K-1: the block's first own token
            # is output at the block's start
            outputs.extend(range(len(source), len(source) + node.length))
            source.extend([-1] * (carry - len(tail)) + tail + list(range(node.start, node.start + node.length)))
        source_rows = torch.tensor(source, dtype=torch.int64, device=device)
        return cls(RowGatherPlan.build(source_rows, layout.total_tokens),
                   torch.tensor(outputs, dtype=torch.int64, device=device))


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
