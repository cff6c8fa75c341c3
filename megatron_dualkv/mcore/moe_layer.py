"""``GatheredPermutationMoELayer``: Megatron's ``MoELayer`` whose token permutation's backward and
expert-output combine are each a gather and a sum over top-k.

Without Transformer Engine's fused permutation, Megatron's all-to-all dispatcher puts the tokens in
expert order with ``index_select``, whose backward is ``index_add_``: bf16 atomics, 14 ms of the
packed Qwen3-30B-A3B-dims step on an H200 (PERF_NOTES.md, run BO; gone in run DC). It combines the
expert outputs back into token order with ``unpermute``'s ``scatter_add_``, atomics again (12.5 ms,
run DC). With top-k routing and no token dropped or padded, each token appears exactly k times, so
both are the sum of each token's k rows: with the rows' order by token, computed once per forward,
one ``row_gather_sum`` each (``ops/row_gather_sum.py``), without atomics (and deterministic); the
combine's gradient is a plain row gather, as ``scatter_add_``'s is. The layer is a ``MoELayer``
(same parameters, state dict and checkpoints); wherever its input feeds more than the permutation
(shared experts, a latent projection) or the dispatcher is another one, it is Megatron's layer
unchanged.

Megatron-Core 0.17+ only: 0.16's ``TransformerLayer`` hands its process groups to the MLP classes
it lists and no others, so a subclass there would be built with the default groups, not the
model's. On 0.16 the spec keeps Megatron's ``MoELayer``.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from ..ops.row_gather_sum import row_gather_sum
from .spec_entries import module_of, with_module


class _PermutedWithGatheredGrad(torch.autograd.Function):
    """(tokens (n, ...), permuted (m, h) = tokens rows at ``index`` (m,), ``order`` (m,) of those
    rows by token or None) -> permuted, whose gradient reaches ``tokens`` as each token's rows
    summed: ``row_gather_sum`` by ``order`` (m = n * topk), else ``index_add_``."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, permuted: torch.Tensor, index: torch.Tensor, order: torch.Tensor | None,
                topk: int) -> torch.Tensor:
        ctx.save_for_backward(index, order)
        ctx.tokens_shape, ctx.topk = tokens.shape, topk
        return permuted.view_as(permuted)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, order = ctx.saved_tensors
        if order is not None:
            dtokens = row_gather_sum(grad, order, ctx.topk)
        else:
            hidden = grad.shape[-1]
            dtokens = grad.new_zeros(ctx.tokens_shape.numel() // hidden, hidden).index_add_(0, index, grad)
        return dtokens.view(ctx.tokens_shape), None, None, None, None


class _CombinedByGather(torch.autograd.Function):
    """(rows (n * topk, h) in expert order, ``order`` (n * topk,) of the rows by token, ``index``
    (n * topk,) the token of each row) -> (n, h), each token's rows summed. Row p's gradient is its
    token's: a gather, as that of ``unpermute``'s ``scatter_add_`` is."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return row_gather_sum(rows, order, topk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None


class GatheredPermutationMoELayer(MoELayer):
    """``MoELayer`` with the permutation's backward and the combine as gathers and sums over top-k
    (module docstring)."""

    _rows_by_token = None  # this forward's order of the permuted rows by token (preprocess), or None

    def _gathered_applies(self) -> bool:
        """Whether the dispatcher and config leave the token order to ``preprocess`` and
        ``postprocess``, with each token's input feeding the permutation only."""
        config, dispatcher = self.config, self.token_dispatcher
        if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher) or dispatcher.drop_and_pad or config.moe_permute_fusion:
            return False  # other token orders: padded expert slots, Transformer Engine's row maps
        if self.shared_experts is not None or getattr(config, "moe_latent_size", None):
            return False  # the input feeds more than the permutation
        if config.moe_expert_capacity_factor is not None or getattr(config, "moe_router_padding_for_quantization", False):
            return False  # tokens dropped or added: not k rows each
        return getattr(config, "cuda_graph_impl", "none") == "none" and not getattr(config, "enable_cuda_graph", False)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self._rows_by_token = None
        if not self._gathered_applies():
            return super().preprocess(hidden_states, probs, routing_map)
        # The permutation runs on a detached input (its autograd edge would be index_select's);
        # the edge to hidden_states is this function's. probs keep Megatron's graph.
        permuted, permuted_probs = super().preprocess(hidden_states.detach(), probs, routing_map)
        index, topk = self.token_dispatcher.reversed_local_input_permutation_mapping, self.config.moe_router_topk
        if index.numel() == hidden_states.numel() // hidden_states.shape[-1] * topk:  # else index_add_ and unpermute
            self._rows_by_token = torch.argsort(index, stable=True)  # token t's k rows at [t k, t k + k)
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            permuted = _PermutedWithGatheredGrad.apply(hidden_states, permuted, index, self._rows_by_token, topk)
        return permuted, permuted_probs

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
        if self._rows_by_token is None:
            return super().postprocess(output, shared_expert_output)
        # Megatron's combine_postprocess here is unpermute without probs (the experts applied
        # them): a scatter_add_ into token order in output's dtype, each add rounded to it (where
        # this sums in float32 and rounds once), then a view to the input's shape. There is no
        # shared expert output to add (_gathered_applies).
        dispatcher = self.token_dispatcher
        combined = _CombinedByGather.apply(output, self._rows_by_token, dispatcher.reversed_local_input_permutation_mapping,
                                           self.config.moe_router_topk)
        return combined.view(dispatcher.hidden_shape)


def with_gathered_permutation(mlp):
    """A layer's ``mlp`` spec entry with ``GatheredPermutationMoELayer`` for ``MoELayer``; others,
    and 0.16's ``ModuleSpec`` entries (module docstring), unchanged."""
    if isinstance(mlp, ModuleSpec) or module_of(mlp) is not MoELayer:
        return mlp
    return with_module(mlp, GatheredPermutationMoELayer)
