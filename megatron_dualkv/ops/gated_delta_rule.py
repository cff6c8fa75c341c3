"""The gated delta rule (Gated DeltaNet's linear attention) on the packed layout: the reference
recurrence, in any dtype (float64 for the tests' oracle), with each segment starting from the
final state of its parent segment.

Per head, with a state ``h`` of shape (Dk, Dv), for each token t of a segment (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks", 2024; the delta rule with a scalar decay gate):

    h     <- exp(g_t) * h                              decay, g_t = log alpha_t <= 0
    u_t    = beta_t * (v_t - h^T k_t)                  what h predicts for k_t, corrected by beta_t
    h     <- h + k_t u_t^T                             so h_t = alpha_t (I - beta_t k_t k_t^T) h_{t-1} + beta_t k_t v_t^T
    o_t    = h^T (scale * q_t)                         read out after the update

On a packed micro-batch ``[P][R1]..[RN]`` (or a prefix tree) a recurrent layer must not carry
its state across segment boundaries as one sequence would: each response continues from the
prompt's final state, not from zero and not from the previous response. Here every segment
starts from its parent's final state (a root from ``initial_state``, or zero), which is exactly
each trajectory run alone. A shared state feeds several children, so its gradient is the sum over
them: autograd gets that from the reuse of one tensor.

This is the oracle the chunked kernels and the hybrid models' layers are to be tested against:
O(T Dk Dv) per head, token by token, on any device.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..layout import PackedLayout
from .checks import check_layout


def gated_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    layout: PackedLayout,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The gated delta rule over every segment of ``layout``, each from its parent's final state.

    q, k: (T, H, Dk); v: (T, H, Dv); g (log decay, <= 0 in the models) and beta (in [0, 1]):
    (T, H); scale: multiplies q (default Dk ** -0.5); initial_state: (H, Dk, Dv), the state every
    root segment starts from (default zero). Returns the output (T, H, Dv) and each segment's final
    state (S, H, Dk, Dv), S = ``len(layout.nodes)``. Computes in the inputs' dtype; differentiable.
    """
    scale = _check_inputs(q, k, v, g, beta, layout, scale, initial_state)
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    start_state = initial_state if initial_state is not None else q.new_zeros(heads, dk, dv)
    outputs: List[Tensor] = []
    finals: List[Tensor] = []
    for node in layout.nodes:
        h = start_state if node.parent < 0 else finals[node.parent]
        for t in range(node.start, node.start + node.length):
            h = h * torch.exp(g[t])[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", h, k[t]))
            h = h + k[t][:, :, None] * u[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", h, q[t] * scale))
        finals.append(h)
    # nodes are in packed order, so the outputs are too
    return torch.stack(outputs), torch.stack(finals)


def _check_inputs(q, k, v, g, beta, layout, scale, initial_state) -> float:
    """ValueError naming the input that does not fit; the scale to use."""
    check_layout(layout)
    tokens = layout.total_tokens
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-d (tokens, heads{', dim' if dims == 3 else ''}) tensor, "
                             f"got shape {getattr(t, 'shape', None)}")
        if t.shape[0] != tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, the layout {tokens}")
        if t.shape[1] != q.shape[1]:
            raise ValueError(f"{name} has {t.shape[1]} heads, q {q.shape[1]}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}")
    if k.shape != q.shape:
        raise ValueError(f"k's shape {tuple(k.shape)} differs from q's {tuple(q.shape)}")
    if initial_state is not None and initial_state.shape != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"initial_state must be (heads, Dk, Dv) = {(q.shape[1], q.shape[2], v.shape[2])}, "
                         f"got {tuple(initial_state.shape)}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    return float(scale)
