"""Dense-mask DualKV attention: the oracle every kernel is tested against.

O(T^2) memory; differentiable; any device and dtype (it computes in the inputs' dtype, so a
float64 input gives a float64 oracle and a bf16 input gives the same-precision baseline that
low-precision kernels are measured against).
"""
from __future__ import annotations

import torch

from ..layout import PackedLayout, PrefixedLayout
from .checks import check_attention_inputs, check_prefix_attention_inputs


def dualkv_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention under the DualKV rule on a DualKVLayout or TreeLayout (see ``megatron_dualkv.layout``).

    q: (T, Hq, D), k/v: (T, Hkv, D) with Hq a multiple of Hkv (GQA) -> (T, Hq, D).
    ``window_size``: a key at logical position p_k is visible from p_q only if p_q - p_k < window_size.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)``.
    """
    scale = check_attention_inputs(q, k, v, layout, softmax_scale, window_size, softcap)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = layout.to(q.device).dense_mask(window_size)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def dualkv_prefix_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    layout: PrefixedLayout,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """DualKV attention of responses whose prompts' K/V are a separate operand (``PrefixedLayout``).

    q: (T, Hq, D), k/v: (T, Hkv, D), prefix_k/v: (sum(prefix_lens), Hkv, D) -> (T, Hq, D).
    The two key sets, the group's prefix and the causal response itself, are two softmax pieces
    merged by their log-sum-exp, so no (T, prefix + T) key copy is built.
    """
    scale = check_prefix_attention_inputs(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size, softcap)
    groups = q.shape[1] // k.shape[1]
    layout = layout.to(q.device)
    pieces = [(k, v, layout.dense_mask(window_size)), (prefix_k, prefix_v, layout.prefix_mask(window_size))]
    scores = []
    for keys, _, mask in pieces:
        s = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(groups, dim=1)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        scores.append(s.masked_fill(~mask, float("-inf")))
    # every token sees itself, so the merged log-sum-exp is finite
    lse = torch.logaddexp(*(torch.logsumexp(s, dim=-1, keepdim=True) for s in scores))
    return sum(torch.einsum("hqk,khd->qhd", torch.exp(s - lse), values.repeat_interleave(groups, dim=1))
               for s, (_, values, _) in zip(scores, pieces))
