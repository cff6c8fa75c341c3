"""Native Hopper kernels of DualKV attention: ``csrc/dualkv_*_sm90.cu``, built on first use.

The Triton kernels (``dualkv_attn.py``) are the portable backend. On an sm_90 GPU the default
backend runs, where they apply, native kernels on wgmma instructions fed by TMA (a producer
warpgroup and two consumer warpgroups):

* the forward (head dims 128, 256, 512), one program per (query tile, query head), reading the
  Triton forward's tables (``query_tiles`` with ``NATIVE_FWD_BLOCK_M[head_dim]`` rows): a
  prompt per tile (single-range tables), or a prefix tree's ancestor pieces (multi-range tables
  and their ``piece_table``, a separate instantiation of the kernel);
* the backward (head dims 128, 256, 512; at 512 a cluster of two CTAs per key tile, each owning
  256 head-dim columns) as ONE pass: dK/dV per key tile with dQ accumulated in the same pass
  (5 matmuls per block pair instead of the Triton plan's 7) through TMA bulk reductions, reading
  the dK/dV tables (``key_items`` with ``NATIVE_BLOCK_N[head_dim]`` keys and
  ``NATIVE_BLOCK_M`` queries) and writing the same fp32 chunk partials, reduced by the Triton
  reduction kernel.

Covered: those head dims, bf16/fp16, a left window at head dims 128 and 256 (Gemma's sliding
layers; the forward skips the key blocks before it, the backward reads the windowed tables),
no softcap, not ``deterministic`` (dQ is added with fp32 reductions in whatever order they land),
16-byte aligned tensors (TMA). Everything else stays on Triton. Prefix trees: the forward runs
every tree, multi-range tables where the build has ``fwd_pieces`` (``native_forward_takes_pieces``:
sources of another revision, ``DUALKV_NATIVE_SOURCES``, may not have it; those trees then run the
Triton forward). The backward's tree items have the depth-1 form (one packed query range after
the key tile, visible iff query >= key, runs of consecutive positions under a window), so it runs
every tree.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._resources import resource_dir
from .checks import tma_aligned

# per head dim (the keys are the head dims covered)
NATIVE_FWD_BLOCK_M = {128: 128, 256: 128, 512: 64}  # forward: query rows per program
NATIVE_BLOCK_N = {128: 128, 256: 64, 512: 64}  # backward: keys per program (per CTA pair at 512)
NATIVE_BLOCK_M = 64  # backward: queries per step
NATIVE_WINDOW_HEAD_DIMS = (128, 256)
CSRC = resource_dir("megatron_dualkv.csrc", "csrc")


def native_source_folder(path, what: str) -> Path:
    """``path`` resolved, checked to hold the native kernels' sources (a ``csrc/`` folder); ``what``
    names where the path came from in the error."""
    folder = Path(path).resolve()
    if not (folder / "dualkv_sm90.cpp").is_file():
        raise FileNotFoundError(f"{what}: {str(path)!r} holds no dualkv_sm90.cpp (expected a csrc/ folder)")
    return folder


def _sources() -> Tuple[str, Path]:
    """(extension name, source folder): the package's ``csrc/``, or the folder that
    ``DUALKV_NATIVE_SOURCES`` names (another revision's ``csrc/``, for an A/B:
    ``tools/ab_native.py``), built under a name of its own so that the two builds never mix."""
    custom = os.environ.get("DUALKV_NATIVE_SOURCES")
    if not custom:
        return "dualkv_sm90", CSRC
    folder = native_source_folder(custom, "DUALKV_NATIVE_SOURCES")
    return f"dualkv_sm90_{hashlib.sha1(str(folder).encode()).hexdigest()[:10]}", folder


@functools.cache
def _extension():
    """The compiled extension, or None where it cannot be built here (with one warning, unless it
    was switched off or this install has no sources)."""
    name, csrc = _sources()
    if os.environ.get("DUALKV_NATIVE", "1") == "0" or not csrc.is_dir():
        return None
    try:
        from torch.utils.cpp_extension import load

        sources = [str(path) for path in (csrc / "dualkv_sm90.cpp", *sorted(csrc.glob("*.cu")))]
        return load(name=name, sources=sources,
                    extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"],
                    extra_cflags=["-O3", "-std=c++17"])
    except Exception as exc:  # no nvcc, no sources in this install, a compiler error
        warnings.warn(f"DualKV: the native sm_90 kernels could not be built ({exc}); using the Triton kernels",
                      stacklevel=3)
        return None


def native_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: Optional[int],
                     softcap: Optional[float], deterministic: bool) -> bool:
    """Whether a native kernel covers this call, at least the forward (then the extension is built
    or loaded); the backward also needs ``q.shape[2] in NATIVE_BLOCK_N``."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.shape[2] not in NATIVE_FWD_BLOCK_M or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if softcap is not None or deterministic:
        return False
    if window_size is not None and (q.shape[2] not in NATIVE_WINDOW_HEAD_DIMS or window_size >= 1 << 30):
        return False
    if not all(t.stride(-1) == 1 and tma_aligned(t) for t in (q, k, v)):
        return False
    return _extension() is not None


def native_forward_takes_pieces() -> bool:
    """Whether the built extension's forward reads multi-range tiles (``fwd_pieces``)."""
    return hasattr(_extension(), "fwd_pieces")


def fwd_sm90(q, k, v, tiles, out, lse, sm_scale: float, window_size: Optional[int] = None,
             pieces: Optional[torch.Tensor] = None) -> None:
    """Native forward, head dim D in NATIVE_FWD_BLOCK_M. q (T, Hq, D); k, v (T, Hkv, D); tiles from
    ``query_tiles(layout, NATIVE_FWD_BLOCK_M[D], window_size)``: (n, 5) int32 of a single-range
    layout, or (n, 6) of a multi-range one with its ``piece_table`` (m, 3) int32 as ``pieces``; a
    left window in logical positions at D in NATIVE_WINDOW_HEAD_DIMS. Writes out (T, Hq, D) and
    lse (Hq, T) fp32 in log2 units."""
    if pieces is None:
        _extension().fwd(q, k, v, tiles, out, lse, sm_scale, window_size or 0)
    else:
        _extension().fwd_pieces(q, k, v, tiles, pieces, out, lse, sm_scale, window_size or 0)


def dkdv_dq_sm90(q, k, v, do, lse, delta, items, dk, dv, partial_dk, partial_dv, dq_acc, sm_scale: float,
                 window_size: Optional[int], positions: torch.Tensor) -> None:
    """One native dK/dV pass with fused dQ, head dim D in NATIVE_BLOCK_N, key tiles of N = NATIVE_BLOCK_N[D].

    q, do (T, Hq, D); k, v (T, Hkv, D); lse, delta (Hq, T) fp32; items (n, 5) int32 from
    ``key_items(layout, N, NATIVE_BLOCK_M, ..., window_size)`` (with a window, each item's queries
    are one run of positions); positions (T,) int64, read with a window. Writes dk, dv (T, Hkv, D)
    rows of unsplit tiles, fp32 partials (slots * N, Hkv, D) of split ones, and adds dQ (softmax
    scale included) to the zeroed contiguous fp32 dq_acc (T, Hq, D), in the kernels' column order:
    ``dq_in_head_dim_order`` reads it back.
    """
    _extension().dkdv_dq(q, k, v, do, lse, delta, items, dk, dv, partial_dk, partial_dv, dq_acc, sm_scale,
                         window_size or 0, positions)


@triton.jit
def _dq_in_head_dim_order_kernel(DQ_ACC, DQ, groups, BLOCK: tl.constexpr):
    # BLOCK 32-column groups per program, read and written whole (coalesced); the chunks move in
    # registers. The buffer holds chunk j (4 columns) of a group at position 4 (j % 2) + j // 2:
    # as (j % 2, j // 2, column) it is (j // 2, j % 2, column) transposed.
    group = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[:, None]
    at = group * 32 + tl.arange(0, 32)[None, :]
    ok = group < groups
    x = tl.load(DQ_ACC + at, mask=ok)
    x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK, 2, 4, 4)), (0, 2, 1, 3)), (BLOCK, 32))
    tl.store(DQ + at, x.to(DQ.dtype.element_ty), mask=ok)


def dq_in_head_dim_order(dq_acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dQ (T, Hq, D) in ``dtype`` from the fp32 buffer of ``dkdv_dq_sm90``, in one pass.

    The kernels stage each 32-column group of a dQ row as 8 chunks of 4 columns, chunk j at
    position 4 (j % 2) + j // 2 (conflict-free shared-memory stores: ``stage_dq`` in
    csrc/dualkv_bwd_sm90.cuh), and the bulk reductions add it to the buffer in that order. (A strided
    ``copy_`` of the permuted view took 0.31 ms at 16x8192x1024, twice a plain cast: PERF_NOTES.md.)
    """
    T, H, D = dq_acc.shape
    dq = torch.empty(T, H, D, dtype=dtype, device=dq_acc.device)
    groups, block = T * H * D // 32, 64
    _dq_in_head_dim_order_kernel[(triton.cdiv(groups, block),)](dq_acc, dq, groups, BLOCK=block, num_warps=4)
    return dq
