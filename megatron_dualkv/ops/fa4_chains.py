"""FlashAttention-4's causal kernels on a layout of plain causal sequences (an optional backend).

A layout in which no segment has two children (every group with one response, a tree without
branches, padding) is a set of causal sequences: each root with its chain of descendants,
contiguous in packed order. On those the DualKV mask is plain causal attention per sequence, and
FA4's own causal kernels (``flash-attn-4``, CuTe DSL) ran it 5-7% faster than our D128 kernels on
an H200 (one causal sequence of 16,384, forward + backward: 12.88 ms batched, 13.18 varlen, against
our 13.85). Everywhere a prompt is shared ours are faster, so ``dualkv_attn_func(backend="auto")``
takes this path only where ``fa4_takes`` says so: FA4 importable, an sm_90 GPU, head dim 128, bf16,
no window, softcap or deterministic gradients, and a layout of chains. ``DUALKV_FA4=0`` switches it
off.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch

from ..layout import PackedLayout

FA4_HEAD_DIMS = (128,)  # where it was measured faster than ours (bf16)


def chain_starts(layout: PackedLayout) -> Optional[Tuple[int, ...]]:
    """The packed starts of the layout's causal sequences and its end (FA4's ``cu_seqlens``), or None
    when a segment has two children (a shared prompt or a branching tree: the DualKV mask is not
    causal attention per sequence there). Roots start at logical position 0 in a ``PackedLayout``
    built by ``DualKVLayout`` or ``TreeLayout``; a root that starts later (``PrefixedLayout``) is not
    a chain's start either."""
    def build():
        children = [0] * len(layout.nodes)
        starts = []
        for node in layout.nodes:
            if node.parent >= 0:
                children[node.parent] += 1
                if children[node.parent] > 1:
                    return None
            elif node.position != 0:
                return None
            else:
                starts.append(node.start)
        return (*starts, layout.total_tokens)

    return layout.derived("fa4_chain_starts", build)


@functools.lru_cache(maxsize=None)
def fa4_installed() -> bool:
    """``flash_attn.cute`` (FA4) can be found. Finding it imports ``flash_attn``, which raises where a
    FlashAttention-2 build does not match torch: then FA4 is not usable either."""
    try:
        return importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:
        return False


def fa4_takes(q: torch.Tensor, layout: PackedLayout, window_size: Optional[int], softcap: Optional[float],
              deterministic: bool) -> bool:
    """Whether ``dualkv_attn_func(backend="auto")`` runs FA4 on these inputs."""
    if os.environ.get("DUALKV_FA4", "1") == "0" or not q.is_cuda:
        return False
    if window_size is not None or softcap is not None or deterministic:
        return False
    if q.shape[-1] not in FA4_HEAD_DIMS or q.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9 or torch.compiler.is_compiling():
        return False
    return fa4_installed() and chain_starts(layout) is not None


def fa4_chains_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                    softmax_scale: float) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) on a layout of chains (``chain_starts``) -> (T, Hq, D): FA4's causal
    attention, one sequence per chain (GQA as FA4 takes it, autograd through FA4's backward). Chains
    of one length run as a batch in FA4's causal kernel (12.88 ms against its varlen kernel's 13.18
    on one sequence of 16,384), others through its varlen kernel."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    starts = chain_starts(layout)
    lengths = {b - a for a, b in zip(starts, starts[1:])}
    if len(lengths) == 1:
        batch = (len(starts) - 1, lengths.pop())
        out = flash_attn_func(*(t.reshape(*batch, *t.shape[1:]) for t in (q, k, v)), softmax_scale=softmax_scale,
                              causal=True)
        return _output(out).view(q.shape)
    cu_seqlens = layout.derived("fa4_cu_seqlens", lambda: torch.tensor(starts, dtype=torch.int32, device=q.device))
    longest = max(lengths, default=0)
    return _output(flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                          max_seqlen_q=longest, max_seqlen_k=longest, softmax_scale=softmax_scale,
                                          causal=True))


def _output(result) -> torch.Tensor:
    """FA4's attention output: its functions return (out, lse)."""
    return result[0] if isinstance(result, tuple) else result
