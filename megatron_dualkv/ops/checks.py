"""Input checks shared by every DualKV attention backend, and where the Triton kernels run: bad
input fails here, with a message that names the problem, never deep inside a kernel."""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Optional

import torch

from ..layout import PackedLayout


def triton_available(device: torch.device) -> bool:
    """The Triton kernels run on CUDA devices, and on CPU under ``TRITON_INTERPRET=1``."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(device: torch.device, requested: Optional[bool] = None) -> bool:
    """Whether an op runs its Triton kernels: ``requested`` None, on CUDA only (the interpreter would
    run the models' CPU passes at Python speed); True, wherever Triton runs; False, never."""
    return (device.type == "cuda" if requested is None else bool(requested)) and triton_available(device)


def runs_kernels(x: torch.Tensor, requested: Optional[bool] = None) -> bool:
    """Whether an op runs its Triton kernels on ``x``: ``use_triton`` on its device, and a dtype the
    kernels take. float64 always runs the ops' PyTorch math, on any device: it is the exact oracle
    of the tests, which on a GPU machine run it beside the bf16 model."""
    return use_triton(x.device, requested) and x.dtype != torch.float64


def check_layout(layout) -> None:
    """TypeError unless ``layout`` is a packed layout (what every op on the packed tokens reads)."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a DualKVLayout or a TreeLayout, got {type(layout).__name__}")


def check_attention_inputs(q, k, v, layout, softmax_scale=None, window_size=None, softcap=None) -> float:
    """Validate q (T, Hq, D), k/v (T, Hkv, D) against ``layout``; return the softmax scale to use."""
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a (tokens, heads, head_dim) tensor, got shape {getattr(t, 'shape', None)}")
    if q.shape[0] != layout.total_tokens or k.shape[0] != layout.total_tokens or v.shape[0] != layout.total_tokens:
        raise ValueError(
            f"token counts q={q.shape[0]}, k={k.shape[0]}, v={v.shape[0]} do not match the layout's "
            f"{layout.total_tokens} packed tokens"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) differ")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if window_size is not None and (not isinstance(window_size, int) or window_size < 1):
        raise ValueError(f"window_size must be a positive int or None, got {window_size!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale!r}")
    return float(softmax_scale)


def check_prefix_attention_inputs(q, k, v, prefix_k, prefix_v, layout, softmax_scale=None, window_size=None,
                                  softcap=None) -> float:
    """``check_attention_inputs`` on q/k/v and a ``PrefixedLayout``, and the prefix operand
    prefix_k/v (sum(prefix_lens), Hkv, D) like k/v; return the softmax scale to use."""
    from ..layout import PrefixedLayout

    if not isinstance(layout, PrefixedLayout):
        raise TypeError(f"layout must be a PrefixedLayout (responses with a separate prefix), got {type(layout).__name__}")
    scale = check_attention_inputs(q, k, v, layout, softmax_scale, window_size, softcap)
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (layout.prefix_tokens, *k.shape[1:]):
            raise ValueError(f"{name} must be ({layout.prefix_tokens} prefix tokens, {k.shape[1]} heads, {k.shape[2]}), "
                             f"got shape {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != k.dtype or t.device != k.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, k is {k.dtype} on {k.device}")
    return scale


def tma_aligned(t: torch.Tensor) -> bool:
    """Base and all but the last stride 16-byte aligned: what TMA tensor descriptors require."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
