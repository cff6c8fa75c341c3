"""``dualkv_attn_func``: the public DualKV attention entry point and its backend choice."""
from __future__ import annotations

from typing import Optional

import torch

from .layout import PackedLayout, PrefixedLayout
from .ops.checks import check_attention_inputs, runs_kernels, triton_available
from .ops.fa4_chains import fa4_chains_attn, fa4_takes
from .ops.reference import dualkv_attention_reference, dualkv_prefix_attention_reference

# "auto": the fastest kernels on the device (the native sm_90 kernels where they apply, FA4's on
# plain causal sequences where it is installed, else Triton); the float64-exact reference off GPU
# and for float64 inputs (the kernels take 16- and 32-bit floats);
# "triton": the portable Triton kernels only
BACKENDS = ("auto", "triton", "reference")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    device = q.device
    if backend not in BACKENDS:
        raise ValueError(f"unknown DualKV attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "triton" if runs_kernels(q) else "reference"
    if backend == "triton" and not triton_available(device):
        raise RuntimeError(
            f"the triton backend cannot run on {device}: it needs triton installed and a CUDA device, "
            "or TRITON_INTERPRET=1 on CPU"
        )
    return backend


def dualkv_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """DualKV attention on the packed layout: a ``DualKVLayout`` or a ``TreeLayout``.

    q: (T, Hq, D), k/v: (T, Hkv, D), Hq a multiple of Hkv -> out (T, Hq, D).
    A query sees its segment's ancestors (a response: its group's prompt; a tree segment: its path
    from the root) whole and its own segment causally. ``window_size`` is a left window in logical positions,
    ``softcap`` caps scores with ``softcap * tanh(s / softcap)``. ``deterministic`` makes the
    kernels' gradients bitwise reproducible. ``backend``: "auto" (on GPU the native sm_90 kernels
    where they apply, else the Triton kernels; FlashAttention-4's causal kernels where it is installed
    and faster: plain causal sequences at head dim 128, ``ops.fa4_chains``; the reference off GPU),
    "triton" (the Triton kernels only) or "reference".
    """
    scale = check_attention_inputs(q, k, v, layout, softmax_scale, window_size, softcap)
    if resolve_backend(backend, q) == "reference":
        return dualkv_attention_reference(q, k, v, layout, softmax_scale, window_size, softcap)
    if backend == "auto" and fa4_takes(q, layout, window_size, softcap, deterministic):
        return fa4_chains_attn(q, k, v, layout, scale)
    from .ops.dualkv_attn import dualkv_attn_triton

    return dualkv_attn_triton(q, k, v, layout, softmax_scale, window_size, softcap, deterministic,
                              native=backend == "auto")


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
    if resolve_backend(backend, q) == "reference":
        return dualkv_prefix_attention_reference(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size,
                                                 softcap)
    from .ops.dualkv_prefix_attn import dualkv_prefix_attn_triton

    return dualkv_prefix_attn_triton(q, k, v, prefix_k, prefix_v, layout, softmax_scale, window_size, softcap,
                                     deterministic)
