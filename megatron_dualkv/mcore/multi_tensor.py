"""Megatron's optimizer without Transformer Engine or Apex: its multi-tensor ops as ``torch._foreach`` calls.

Without either package, megatron-core falls back to Python loops over the parameters for the two
multi-tensor ops of its optimizer. Its gradient norm launches one norm per parameter and turns
the list of CUDA scalars into a host tensor, one device synchronisation per parameter. Its
scale (gradient clipping) launches a multiply and a copy per parameter. A Qwen3-30B-A3B layer
holds 263 parameters (each of its 128 experts has two), so the 48-layer model pays ~12,600
synchronisations per optimizer step. The PyTorch optimizers Megatron falls back to are
multi-tensor already.

``use_foreach_multi_tensor_ops()`` replaces exactly those two fallbacks with the versions below
(a few launches per list, no synchronisation). Where Transformer Engine or Apex provides the ops,
Megatron did not pick the fallbacks and nothing changes. ``build_model`` applies it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                    per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``amp_C.multi_tensor_l2norm``: the float32 L2 norm over all tensors of ``tensor_lists[0]``, shape (1,),
    on their device; with ``per_tensor`` also each tensor's norm, shape (len,)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],
                  scale: float) -> None:
    """``amp_C.multi_tensor_scale`` without its overflow check (as Megatron's own fallback):
    dst = src * scale for each pair of ``tensor_lists`` = [srcs, dsts], dtypes converted."""
    srcs, dsts = tensor_lists
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):
        torch._foreach_mul_(dsts, scale)
    else:
        torch._foreach_copy_(dsts, srcs if scale == 1.0 else torch._foreach_mul(srcs, scale))


def use_foreach_multi_tensor_ops() -> bool:
    """Swap Megatron's per-parameter fallbacks for the ``torch._foreach`` versions. Idempotent.

    Returns True when Megatron runs the foreach versions (its fallbacks were in use), False when
    Transformer Engine or Apex supplied the ops (then nothing is changed).
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    swaps = [(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
             (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
             (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale)]
    active = False
    for module, name, fallback, ours in swaps:
        current = getattr(module, name, None)
        if current is fallback:
            setattr(module, name, ours)
        active |= getattr(module, name, None) is ours
    return active
