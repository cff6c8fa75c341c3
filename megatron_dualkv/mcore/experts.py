"""``GroupedMMExperts``: Megatron's ``SequentialMLP`` experts run as grouped matmuls.

Without Transformer Engine, Megatron's local spec runs the experts of a MoE layer one after
another (``SequentialMLP``): at Qwen3-30B-A3B's 128 experts that is ~4,000 small matmul launches
per step, and the step waits on the host (PERF_NOTES.md, run L). Here each of the two expert linears is one
``torch._grouped_mm`` over all local experts, forward and backward. The module *is* a
``SequentialMLP`` (same parameters, state dict, checkpoints and Hugging Face mapping); it only
replaces the loop, and takes the loop where the grouped path does not apply (biases, fp8,
Transformer Engine activations, a clamp or offset on the gate, probabilities applied on the
input, deferred weight gradients, misaligned widths, and on CUDA anything but bf16 on sm_90+).

The grouped matmuls take each linear's weights as one (E, out, in) tensor. The module allocates
the experts' weights back to back in one storage, so that tensor is a view. Stacking them into a
copy on every call moved ~29 GB per packed step at Qwen3-30B-A3B dimensions (24 copies of 0.4-0.8 GB
in 4 layers, ~8 ms of HBM time; PERF_NOTES.md, run BO). Where something has moved the weights apart
since (``module.to(dtype)``, the distributed optimizer's parameter buffer, a materialised meta
model), the call stacks them as before.

On the grouped path the experts' SwiGLU output can be recomputed instead of kept
(``recompute_activations``, ``mcore.recompute``); a model built with that setting where the grouped
path does not apply is refused, since SequentialMLP's loop would keep it.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from .glu import plain_gated_linear_unit
from .recompute import RecomputableActivation, checkpoint_without_output
from .spec_entries import module_of, submodules_of, with_module, with_submodules


def store_back_to_back(weights: List[torch.Tensor]) -> None:
    """Move the equally shaped ``weights`` (parameters) into one new storage, in order, each becoming
    a view of it; values, dtypes and devices unchanged."""
    with torch.no_grad():
        stack = torch.stack([w.detach() for w in weights])
    for w, view in zip(weights, stack.unbind(0)):
        w.data = view


def back_to_back_view(weights: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The (E, out, in) tensor of the E weights without a copy when they are contiguous, equally
    shaped, and lie back to back in the first one's storage (as ``store_back_to_back`` leaves
    them); else None."""
    w0 = weights[0]
    size = w0.numel() * w0.element_size()
    for e, w in enumerate(weights):
        if w.data_ptr() != w0.data_ptr() + e * size or w.shape != w0.shape or w.dtype != w0.dtype or not w.is_contiguous():
            return None
    storage = w0.untyped_storage()
    if storage.data_ptr() + storage.nbytes() < w0.data_ptr() + len(weights) * size:  # adjacent allocations
        return None
    return w0.detach().as_strided((len(weights), *w0.shape), (w0.numel(), *w0.stride()), w0.storage_offset())


def stacked(weights: List[torch.Tensor]) -> torch.Tensor:
    """The E weights as one (E, out, in) tensor: a view where they lie back to back, else a copy."""
    view = back_to_back_view(weights)
    return view if view is not None else torch.stack(weights)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ W_e^T for expert row ranges ending at ``ends``.

    The stacked (E, out, in) weight is taken again in the backward instead of saved: where it is a
    copy, saving it would hold one of every expert's weight per layer until the backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, *weights)
        return torch._grouped_mm(x, stacked(weights).transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, ends, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, stacked(weights), offs=ends) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(dy.t(), x, offs=ends)  # (E, out, in): groups along the rows of x and dy
        return (dx, None, *dw.unbind(0))


def grouped_linear(x: torch.Tensor, ends: torch.Tensor, weights: List[torch.Tensor]) -> torch.Tensor:
    """x (tokens, in) sorted by expert, ends (E,) int32 cumulative row counts, weights E x (out, in) -> (tokens, out)."""
    return _GroupedLinear.apply(x, ends, *weights)


def _aligned(*widths_in_bytes: int) -> bool:
    return all(width % 16 == 0 for width in widths_in_bytes)  # torch._grouped_mm's stride rule


def _weighted_swiglu(fc1_output: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As each expert's MLP: SwiGLU, times the routing probability in float32, in ``dtype``."""
    gate, linear = torch.chunk(fc1_output, 2, -1)
    return (F.silu(gate) * linear * probs.unsqueeze(-1)).to(dtype)


class GroupedMMExperts(RecomputableActivation, SequentialMLP):
    """``SequentialMLP`` whose experts run as two grouped matmuls (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.num_local_experts > 1:
            for linear in ("linear_fc1", "linear_fc2"):
                store_back_to_back(self.expert_weights(linear))
        if getattr(self.config, "recompute_activations", False) and not self._grouped_path_applies(self._input_like()):
            raise ValueError(
                "recompute_activations: the experts' activation is recomputed on GroupedMMExperts' grouped path only "
                "(2+ local experts, SwiGLU without biases, clamps or fused activations, bf16 on sm_90+ GPUs, 16-byte "
                "aligned widths), which this model does not take"
            )

    def expert_weights(self, linear: str) -> List[torch.Tensor]:
        """The local experts' weights of ``linear`` ("linear_fc1" or "linear_fc2"), in expert order."""
        return [getattr(e, linear).weight for e in self.local_experts]

    def _input_like(self) -> torch.Tensor:
        """An empty input of the model's dtype and width on its device, for checks before any input."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        width = self.local_experts[0].linear_fc1.weight.shape[1]
        return torch.empty(0, width, dtype=self.config.params_dtype, device=device)

    def _grouped_path_applies(self, x: torch.Tensor) -> bool:
        config, expert = self.config, self.local_experts[0]
        if self.num_local_experts < 2 or not plain_gated_linear_unit(config) or config.add_bias_linear:
            return False
        if config.activation_func is not F.silu or config.bias_activation_fusion or config.moe_apply_probs_on_input:
            return False
        if getattr(config, "use_te_activation_func", False) or getattr(config, "fp8", None) or getattr(config, "fp4", None):
            return False
        if getattr(config, "delay_wgrad_compute", False):  # Megatron's deferred weight gradients (backward_dw)
            return False
        if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
            return False
        inner = expert.linear_fc2.weight.shape[1]
        return _aligned(x.shape[1] * x.element_size(), inner * x.element_size())

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if not self._grouped_path_applies(x):
            if self.recompute_activation:
                raise ValueError(f"recompute_activations: GroupedMMExperts' grouped path does not take {x.dtype} input "
                                 f"on {x.device}")
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        ends = torch.cumsum(torch.as_tensor(tokens_per_expert).to(x.device), 0).to(torch.int32)
        fc1_output = grouped_linear(x, ends, self.expert_weights("linear_fc1"))
        activation = partial(_weighted_swiglu, dtype=x.dtype)
        hidden, release = checkpoint_without_output(activation, fc1_output, permuted_probs,
                                                    enabled=self.recompute_activation)
        output = grouped_linear(hidden, ends, self.expert_weights("linear_fc2"))
        release(output)
        return output, None


def with_grouped_mm_experts(mlp):
    """A layer's ``mlp`` spec entry with ``GroupedMMExperts`` for ``SequentialMLP`` experts; others unchanged."""
    submodules = submodules_of(mlp)
    experts = getattr(submodules, "experts", None)
    if module_of(experts) is not SequentialMLP:
        return mlp
    return with_submodules(mlp, replace(submodules, experts=with_module(experts, GroupedMMExperts)))
