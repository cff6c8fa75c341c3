"""``SequenceParallelTorchNorm``: Megatron's torch-native norm, also under sequence parallelism,
with RMSNorm fused on CUDA.

Megatron's ``WrappedTorchNorm`` (the local spec's LayerNorm/RMSNorm) asserts
``not config.sequence_parallel``, although a norm is per token and runs unchanged on the token
slice that sequence parallelism leaves on each tensor-parallel rank. What SP does need is the
gradient of the (replicated) norm weights summed over the tensor-parallel group, since every rank
only sees its own tokens: Megatron's ``finalize_model_grads`` does that for every parameter marked
``sequence_parallel`` (as its Transformer Engine and apex norms mark theirs).

torch runs RMSNorm's backward as separate elementwise kernels (pow, mean, mul, ...), and its
forward too where the weight's dtype is not the input's. On the H200, 17 norms of a 4-layer Qwen3-8B
step cost more than the forward attention, and a Qwen3-4B q norm (24,576 tokens x 32 heads x 128)
took 1.8 ms forward where one pass over its bytes takes 0.12 (PERF_NOTES.md, run DU). On CUDA
``FusedRMSNorm`` runs ``ops.rms_norm``: one Triton kernel per direction, in float32 with the
weight's dtype as it comes, also in forward-only passes and in the forwards that selective
recompute runs without autograd. (Compiling torch's norm did the same, but took a graph per stride,
batch and grad mode: PERF_NOTES.md, run DV.) Elsewhere it is torch's RMSNorm. Its output can be
recomputed instead of kept (``RecomputableOutput``: the selective recompute of ``mcore.recompute``).
"""
from __future__ import annotations

import copy
from dataclasses import fields, is_dataclass, replace
from typing import Any, Tuple

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from ..ops.checks import runs_kernels
from ..ops.rms_norm import rms_norm_func
from .recompute import RecomputableOutput


class FusedRMSNorm(RecomputableOutput, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with one Triton kernel per direction on CUDA (float32 math, one rounding)."""

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if runs_kernels(x) and self.weight is not None and self.eps is not None:
            return rms_norm_func(x, self.weight, self.eps)
        return torch.nn.RMSNorm.forward(self, x)


class SequenceParallelTorchNorm(WrappedTorchNorm):
    """``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``, the latter as ``FusedRMSNorm``)
    whose parameters are marked ``sequence_parallel`` under sequence parallelism."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        # Megatron's other checks (zero-centred gamma, persistent norm, ...) still apply.
        without_sp = copy.copy(config)
        without_sp.sequence_parallel = False
        norm = super().__new__(cls, without_sp, hidden_size, eps, **kwargs)
        if type(norm) is torch.nn.RMSNorm:
            norm = FusedRMSNorm(hidden_size, eps=eps)
        # The parameter dtype, as Transformer Engine's and Gemma's norms: Megatron's mixed-precision
        # optimizer pairs its state with the 16-bit parameters alone, and a float32 weight among
        # them shifts that pairing (a checkpoint's optimizer state then fails to save).
        norm.to(dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_torch_norms(spec: Any, replacing: Tuple[type, ...] = (WrappedTorchNorm,)) -> Any:
    """``spec`` (a ``ModuleSpec``, a submodules dataclass, or a list of them) with every norm class
    of ``replacing`` (Megatron's ``WrappedTorchNorm``; in the TE spec also TE's standalone norms)
    replaced by ``SequenceParallelTorchNorm``."""
    if isinstance(spec, type) and spec in replacing:
        return SequenceParallelTorchNorm
    if isinstance(spec, list):
        return [with_sequence_parallel_torch_norms(s, replacing) for s in spec]
    if isinstance(spec, ModuleSpec):
        return replace(
            spec,
            module=with_sequence_parallel_torch_norms(spec.module, replacing),
            submodules=with_sequence_parallel_torch_norms(spec.submodules, replacing),
        )
    if is_dataclass(spec) and not isinstance(spec, type):
        return replace(spec, **{f.name: with_sequence_parallel_torch_norms(getattr(spec, f.name), replacing)
                                for f in fields(spec) if f.init})
    return spec
