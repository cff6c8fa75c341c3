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
"""
from __future__ import annotations

from typing import Optional

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


def _path_tail(node, count: int) -> list:
    """The packed indices of the last ``count`` tokens before ``node`` along its path (fewer near the root)."""
    index = [t for start, length in node.ancestors for t in range(start, start + length)]
    return index[max(0, len(index) - count):] if count else []


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
