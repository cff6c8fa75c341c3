"""DualKV attention of response micro-batches against a prompt K/V held outside them (prefix reuse).

When a group is too large for one micro-batch, its prompt runs once and its per-layer K/V are held;
each micro-batch of its responses (``PrefixedLayout``) then attends to two key sets:

    A, the group's prefix: every prompt key (up to the window), from the separate operand prefix_k/v;
    B, the responses themselves: each response causally, from k/v.

No concatenation: the two pieces are attention over different tensors, merged by their
log-sum-exp (per query row i, log2 domain as in ``ops.dualkv_attn``):

    lse_i = log2(2^lseA_i + 2^lseB_i),   o_i = 2^(lseA_i - lse_i) oA_i + 2^(lseB_i - lse_i) oB_i

which is exactly the softmax over the union of the keys. The backward needs no gradient of the
pieces' lse: with the merged o and lse, p_ij = 2^(z_ij - lse_i) and delta_i = do_i . o_i are the
union's, so each piece's flash backward, run on the merged (o, lse), gives that piece's exact
share of dq and the exact dk/dv of its keys (dq = dqA + dqB).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..layout import PrefixedLayout
from .checks import check_prefix_attention_inputs
from .reference import dualkv_prefix_attention_reference


def dualkv_prefix_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    layout: PrefixedLayout,
    softmax_scale: Optional[float] = None,
    window_size: Optional[int] = None,
    softcap: Optional[float] = None,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """DualKV attention of the responses of ``layout`` against their groups' prompts held apart.

    q: (T, Hq, D), k/v: (T, Hkv, D) the micro-batch's response tokens (``layout`` order);
    prefix_k/v: (sum(layout.prefix_lens), Hkv, D), the groups' prompt K/V one after the other, as
    the prompts' own forward produced them (after norm and RoPE) -> (T, Hq, D). Hq a multiple of
    Hkv. Differentiable in all five tensors: the prefix gradients are what a prompt held for several
    micro-batches accumulates. ``window_size``, ``softcap``, ``deterministic`` and ``backend`` as in
    ``dualkv_attn_func``.
    """
    from ..attention import resolve_backend

    check_prefix_attention_inputs(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size, softcap)
    if resolve_backend(backend, q.device) == "reference":
        return dualkv_prefix_attention_reference(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size,
                                                 softcap)
    raise NotImplementedError("dualkv_prefix_attn_func: the Triton backend is not there yet; use backend='reference'")
