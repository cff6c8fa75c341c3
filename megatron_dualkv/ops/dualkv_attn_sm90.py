"""Native Hopper backward of DualKV attention: ``csrc/dualkv_bwd_sm90.cu``, built on first use.

The Triton kernels (``dualkv_attn.py``) are the portable backend. On an sm_90 GPU the default
backend replaces their backward, for the case where it measured faster, with one native pass:
dK/dV per 128-key tile with dQ accumulated in the same pass (5 matmuls per block pair instead of
the Triton plan's 7), on wgmma instructions fed by TMA, producer and consumer warpgroups. The
pass reads the same work tables (``key_items``, built with ``NATIVE_BLOCK_N`` keys and
``NATIVE_BLOCK_M`` queries) and writes the same fp32 chunk partials, reduced by the Triton
reduction kernel.

Covered: head dim 128, bf16/fp16, no window, no softcap, not ``deterministic`` (dQ is added
with fp32 atomics), 16-byte aligned tensors (TMA). Everything else stays on Triton.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

NATIVE_HEAD_DIM = 128
NATIVE_BLOCK_M = 64  # queries per step
NATIVE_BLOCK_N = 128  # keys per program
CSRC = Path(__file__).resolve().parents[2] / "csrc"


@functools.cache
def _extension():
    """The compiled extension, or None (with one warning) where it cannot be built here."""
    if os.environ.get("DUALKV_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="dualkv_sm90", sources=[str(CSRC / "dualkv_sm90.cpp"), str(CSRC / "dualkv_bwd_sm90.cu")],
                    extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"],
                    extra_cflags=["-O3", "-std=c++17"])
    except Exception as exc:  # no nvcc, no sources in this install, a compiler error
        warnings.warn(f"DualKV: the native sm_90 backward could not be built ({exc}); using the Triton backward",
                      stacklevel=3)
        return None


def _tma_ready(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def native_backward_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: Optional[int],
                              softcap: Optional[float], deterministic: bool) -> bool:
    """Whether the native pass covers this call (then the extension is built or loaded)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.shape[2] != NATIVE_HEAD_DIM or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if window_size is not None or softcap is not None or deterministic:
        return False
    if not all(t.stride(-1) == 1 and _tma_ready(t) for t in (q, k, v)) or not CSRC.is_dir():
        return False
    return _extension() is not None


def dkdv_dq_sm90(q, k, v, do, lse, delta, items, dk, dv, partial_dk, partial_dv, dq_acc, sm_scale: float) -> None:
    """One native dK/dV pass with fused dQ.

    q, do (T, Hq, 128); k, v (T, Hkv, 128); lse, delta (Hq, T) fp32; items (n, 5) int32 from
    ``key_items(layout, NATIVE_BLOCK_N, NATIVE_BLOCK_M, ...)``. Writes dk, dv (T, Hkv, 128) rows of
    unsplit tiles, fp32 partials (slots * 128, Hkv, 128) of split ones, and adds
    sum_j dx_ij k_j (unscaled) to the zeroed fp32 dq_acc (T, Hq, 128).
    """
    _extension().dkdv_dq(q, k, v, do, lse, delta, items, dk, dv, partial_dk, partial_dv, dq_acc, sm_scale)
