"""Run megatron-core 0.16.1 on a machine without CUDA: the one place where CUDA-only calls are mapped.

megatron-core assumes a GPU in a handful of places even when every tensor could live on the CPU.
``enable_cpu_compat()`` maps exactly those places, and does nothing when CUDA is available (the
real calls are used there). It is applied explicitly (``build_model`` calls it), never on import.

What is mapped, and why (megatron-core 0.16.1 with a CPU-only torch build):

* ``torch.cuda.current_device`` -> the CPU device: RoPE, the MoE router, buffers and the
  sequence-parallel and all-to-all communication allocate with
  ``device=torch.cuda.current_device()``, also inside autograd backward functions, where the
  device mode below is not active (torch 2.13 dispatches ``torch.autograd.backward`` through
  ``__torch_function__``, and a mode is off while its own handler runs the backward).
* a ``TorchFunctionMode`` sending ``device="cuda"``/``"cuda:N"``/``N``, ``Tensor.to(<cuda>)`` and
  ``Tensor.cuda()`` to the CPU and dropping ``pin_memory``: ``RotaryEmbedding.get_emb`` moves its
  frequencies to the current device, and the schedules (``total_num_tokens``), the optimizer,
  ``get_default_causal_mask`` and the sliding-window mask hard-code ``device="cuda"``.
* the CUDA RNG: ``megatron.core.tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state``
  and ``torch.cuda.get_rng_state/set_rng_state/manual_seed`` act on the CPU generator, the device
  generator of a CPU run. Unmapped, ``get_cuda_rng_tracker().fork()`` and the tracker's ``add``
  fail, and ``torch.cuda.manual_seed`` / the state setter are silently queued for a CUDA
  initialisation that never comes, so ``model_parallel_cuda_manual_seed`` would seed nothing.
* ``torch.cuda.Stream/current_stream``: the MoE alltoall dispatcher moves its split sizes to the
  host on a side stream and records an event; on the CPU work is synchronous, so these are no-ops
  (``torch.cuda.stream(...)`` itself is already a no-op without a CUDA device).
* ``torch.cuda.synchronize``: pipeline p2p and timers synchronise; a no-op on the CPU.
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm``: only defined when Transformer
  Engine imports, yet the router gating reads it unconditionally (NameError) -> ``None``, the
  torch matmul path.
* ``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu``: only converts CUDA
  tensors, so on the CPU the alltoall split sizes stay tensors, which gloo's ``all_to_all_single``
  rejects (expert parallelism) -> the same conversion for CPU tensors.

The device mode lives on the mode stack of the calling thread, like ``torch.set_default_device``.
``disable_cpu_compat()`` undoes everything.
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_patches: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original) of what is applied
_device_mode: "CudaToCpuDeviceMode | None" = None
_MISSING = object()


def cpu_compat_enabled() -> bool:
    return _device_mode is not None


def enable_cpu_compat() -> bool:
    """Map megatron-core's CUDA-only calls to the CPU when CUDA is unavailable.

    Idempotent. Returns True when the mappings are active, False when CUDA is available (then
    nothing is changed).
    """
    global _device_mode
    if torch.cuda.is_available():
        return False
    if _device_mode is not None:
        return True
    for owner, name, replacement in _replacements():
        _patches.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, replacement)
    _device_mode = CudaToCpuDeviceMode()
    _device_mode.__enter__()
    return True


def disable_cpu_compat() -> None:
    """Undo ``enable_cpu_compat`` (restores every replaced attribute and leaves the device mode)."""
    global _device_mode
    if _device_mode is None:
        return
    _device_mode.__exit__(None, None, None)
    _device_mode = None
    while _patches:
        owner, name, original = _patches.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def _replacements() -> List[Tuple[Any, str, Any]]:
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    replacements = [
        (torch.cuda, "current_device", lambda: _CPU),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "Stream", _HostStream),
        (torch.cuda, "current_stream", lambda device=None: _HOST_STREAM),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state)),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (mcore_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
        (mcore_random, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_split_sizes),
    ]
    if not hasattr(moe_utils, "te_general_gemm"):
        replacements.append((moe_utils, "te_general_gemm", None))
    return replacements


class _HostStream:
    """Stand-in for ``torch.cuda.Stream``, as far as the MoE dispatcher uses one: host work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> "_HostEvent":
        return _HostEvent()


class _HostEvent:
    """What ``_HostStream.record_event`` returns: already complete."""

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``maybe_move_tensor_to_cpu`` that also converts CPU tensors (gloo wants host split sizes)."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index means a CUDA device
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuDeviceMode(TorchFunctionMode):
    """Sends tensors that megatron-core creates or moves on "cuda" to the CPU."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)

