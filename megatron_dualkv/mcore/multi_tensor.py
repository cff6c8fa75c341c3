"""Megatron's optimizer without Transformer Engine or Apex: its multi-tensor ops as ``torch._foreach`` calls.

Without either package, megatron-core falls back to Python loops over the parameters for the two
multi-tensor ops of its optimizer. Its gradient norm launches one norm per parameter and turns
the list of CUDA scalars into a host tensor, one device synchronisation per parameter. Its
scale (gradient clipping) launches a multiply and a copy per parameter. A Qwen3-30B-A3B layer
holds 263 parameters (each of its 128 experts has two), so the 48-layer model pays ~12,600
synchronisations per optimizer step. The PyTorch optimizers Megatron falls back to are
multi-tensor already. With bf16 parameters, Megatron's copy of the fp32 main weights into the
model's weights after each step loops over the parameters even with Apex (whose op has no bf16):
one launch, and on the host ~75 us, per parameter.

``use_foreach_multi_tensor_ops()`` replaces the two fallbacks with the versions below (a few
launches per list, no synchronisation), and the copy loop with one ``torch._foreach_copy_``.
Where Transformer Engine or Apex provides the norm and scale, Megatron did not pick the fallbacks
and they stay. ``build_model`` applies it.

Megatron's Adam without either package is ``torch.optim.Adam``/``AdamW`` in its default
multi-tensor form: several passes over the fp32 weights, gradients and moments per step (62 ms of
a 0.52 s packed step at Qwen3-30B-A3B dimensions, PERF_NOTES.md, run BQ). ``use_fused_adam(optimizer)``
switches it to torch's fused kernel, the same update in one pass. It acts on an optimizer, so it
runs after ``get_megatron_optimizer``.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

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


def foreach_copy(this: Sequence[torch.Tensor], that: Sequence[torch.Tensor],
                 overflow_buf: Optional[torch.Tensor] = None) -> None:
    """``megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that``: that[i] = this[i], dtypes
    converted (round to nearest even, as ``copy_``), in one ``_foreach_copy_``. ``overflow_buf`` is
    Megatron's dummy flag of the Apex path; nothing reads it."""
    if this:
        torch._foreach_copy_(list(that), list(this))


def use_foreach_multi_tensor_ops() -> bool:
    """Swap Megatron's per-parameter fallbacks for the ``torch._foreach`` versions. Idempotent.

    Returns True when Megatron runs the foreach norm and scale (its fallbacks were in use), False
    when Transformer Engine or Apex supplied them (then they stay). The main-to-model weight copy
    becomes ``foreach_copy`` either way.
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
    copy = getattr(optimizer, "_multi_tensor_copy_this_to_that", None)
    if getattr(copy, "__module__", None) == optimizer.__name__:  # Megatron's own, not already swapped
        optimizer._multi_tensor_copy_this_to_that = foreach_copy
    return active


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained or not), or ``optimizer`` itself."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", chained)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def use_fused_adam(optimizer) -> int:
    """Run the torch ``Adam``/``AdamW`` inside ``optimizer`` (Megatron's, or a torch one) as torch's
    fused kernel where torch has one for its parameters (CUDA, CPU; floating point), instead of the
    multi-tensor default; the update is the same. Idempotent. Returns how many parameter groups now
    run fused (Transformer Engine's or Apex's fused Adam are left as they are: 0).
    """
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    fused = 0
    for opt in _torch_optimizers(optimizer):
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            params = group["params"]
            if group.get("differentiable") or not all(
                    p.device.type in devices and torch.is_floating_point(p) for p in params):
                continue
            group["fused"], group["foreach"] = True, False
            for p in params:  # a step count from before: fused kernels read it on the device, in fp32
                state = opt.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device, torch.float32)
            fused += 1
    return fused
