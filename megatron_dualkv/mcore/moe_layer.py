"""``GatheredPermutationMoELayer``: Megatron's ``MoELayer`` whose first token permutation has a
gather-and-sum backward.

Without Transformer Engine's fused permutation, Megatron's all-to-all dispatcher puts the tokens in
expert order with ``index_select``, whose backward is ``index_add_``: bf16 atomics, 14 ms of the
packed Qwen3-30B-A3B-dims step on an H200 (PERF_NOTES.md, run BO; gone in run DC). With top-k
routing and no token dropped or padded, each token appears exactly k times, so its gradient is the
sum of its k rows: one gather into token order and a sum over k, without atomics (and
deterministic). The layer is a ``MoELayer`` (same parameters, state dict and checkpoints); wherever
its input feeds more than the permutation (shared experts, a latent projection) or the dispatcher is
another one, it is Megatron's layer unchanged.

Megatron-Core 0.17+ only: 0.16's ``TransformerLayer`` hands its process groups to the MLP classes
it lists and no others, so a subclass there would be built with the default groups, not the
model's. On 0.16 the spec keeps Megatron's ``MoELayer``.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from .spec_entries import module_of, with_module


class _PermutedWithGatheredGrad(torch.autograd.Function):
    """(tokens (n, ...), permuted (m, h) = tokens rows at ``index`` (m,)) -> permuted, whose
    gradient reaches ``tokens`` as each token's rows summed: a gather and a sum over ``topk`` where
    m = n * topk, else ``index_add_``."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, permuted: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.tokens_shape, ctx.topk = tokens.shape, topk
        return permuted.view_as(permuted)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        hidden = grad.shape[-1]
        num_tokens = ctx.tokens_shape.numel() // hidden
        if index.numel() == num_tokens * ctx.topk:
            order = torch.argsort(index, stable=True)  # token t's k rows at [t k, t k + k)
            dtokens = grad.index_select(0, order).view(num_tokens, ctx.topk, hidden).sum(1)
        else:
            dtokens = grad.new_zeros(num_tokens, hidden).index_add_(0, index, grad)
        return dtokens.view(ctx.tokens_shape), None, None, None


class GatheredPermutationMoELayer(MoELayer):
    """``MoELayer`` with the gather-and-sum backward of the token permutation (module docstring)."""

    def _gathered_backward_applies(self, hidden_states: torch.Tensor) -> bool:
        config, dispatcher = self.config, self.token_dispatcher
        if not (torch.is_grad_enabled() and hidden_states.requires_grad):
            return False
        if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher) or dispatcher.drop_and_pad or config.moe_permute_fusion:
            return False  # other token orders: padded expert slots, Transformer Engine's row maps
        if self.shared_experts is not None or getattr(config, "moe_latent_size", None):
            return False  # the input feeds more than the permutation
        if config.moe_expert_capacity_factor is not None or getattr(config, "moe_router_padding_for_quantization", False):
            return False  # tokens dropped or added: not k rows each
        return getattr(config, "cuda_graph_impl", "none") == "none" and not getattr(config, "enable_cuda_graph", False)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        if not self._gathered_backward_applies(hidden_states):
            return super().preprocess(hidden_states, probs, routing_map)
        # The permutation runs on a detached input (its autograd edge would be index_select's);
        # the edge to hidden_states is this function's. probs keep Megatron's graph.
        permuted, permuted_probs = super().preprocess(hidden_states.detach(), probs, routing_map)
        index = self.token_dispatcher.reversed_local_input_permutation_mapping
        permuted = _PermutedWithGatheredGrad.apply(hidden_states, permuted, index, self.config.moe_router_topk)
        return permuted, permuted_probs


def with_gathered_permutation(mlp):
    """A layer's ``mlp`` spec entry with ``GatheredPermutationMoELayer`` for ``MoELayer``; others,
    and 0.16's ``ModuleSpec`` entries (module docstring), unchanged."""
    if isinstance(mlp, ModuleSpec) or module_of(mlp) is not MoELayer:
        return mlp
    return with_module(mlp, GatheredPermutationMoELayer)
