"""One entry for RL frameworks: forward (and backward with a policy loss) over packed micro-batches.

``forward_backward`` runs Megatron-Core's own schedule (``get_forward_backward_func``), so loss
scaling over micro-batches, DDP gradient-sync deferral and the MoE auxiliary-loss scale behave as
in any Megatron training step; ``rl_forward_step`` is the matching Megatron ``forward_step_func``
for loops that call the schedule themselves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from ..packing import PackedBatch
from .logprobs import LAYOUTS, logprobs_from_logits, model_logits_and_targets
from .losses import PolicyLoss
from .responses import ResponseTokens


@dataclass
class RLMicroBatch:
    """One packed micro-batch and what the policy loss needs besides the current log-probs.

    old_logprobs / ref_logprobs: per group, per response (R_i,) tensors, as ``forward_logprobs``
    returns them (behaviour policy, and reference policy for a KL term). advantages: (num_responses,)
    flat over responses; by default the loss derives them from ``batch.rewards``.
    """

    batch: PackedBatch
    old_logprobs: Optional[Sequence[Sequence[Tensor]]] = None
    ref_logprobs: Optional[Sequence[Sequence[Tensor]]] = None
    advantages: Optional[Tensor] = None


@dataclass
class RLStepOutput:
    """Per micro-batch results (all detached).

    logprobs / entropy: per group, per response (R_i,) tensors; entropy is None unless asked.
    loss: the micro-batch's policy loss (None without a loss). metrics: name -> per group (N_g,).
    """

    logprobs: List[List[Tensor]]
    entropy: Optional[List[List[Tensor]]] = None
    loss: Optional[Tensor] = None
    metrics: Dict[str, List[Tensor]] = field(default_factory=dict)


def rl_forward_step(loss_fn: Optional[PolicyLoss] = None, layout: str = "packed", with_entropy: bool = False):
    """A Megatron ``forward_step_func(data_iterator, model)`` over ``RLMicroBatch`` items.

    Its loss function returns ``(loss, RLStepOutput)``: Megatron's schedule divides the loss by the
    number of micro-batches, backpropagates it unless ``forward_only``, and collects the outputs.
    Without ``loss_fn`` the loss is 0 and only log-probs are produced.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    def forward_step(data_iterator: Iterator[RLMicroBatch], model):
        micro_batch = _checked(next(data_iterator))
        logits, targets = model_logits_and_targets(model, micro_batch.batch, layout)
        return logits, partial(_policy_loss, model, micro_batch, targets, loss_fn, with_entropy)

    return forward_step


def forward_backward(
    model,
    micro_batches: Sequence[RLMicroBatch],
    loss_fn: Optional[PolicyLoss] = None,
    *,
    layout: str = "packed",
    with_entropy: bool = False,
) -> List[RLStepOutput]:
    """Forward ``micro_batches`` through ``model`` and, with ``loss_fn``, backpropagate its loss.

    model: a model from ``build_model`` (optionally wrapped in Megatron's DDP / Float16Module).
    loss_fn: ``GRPOLoss(...)``, ``DAPOLoss(...)`` or any ``PolicyLoss``; every
        micro-batch then needs ``old_logprobs``. Gradients of ``mean over micro-batches of the
        loss`` accumulate in the parameters (``.grad``, or DDP's ``main_grad``); the optimizer step
        is the caller's. Without ``loss_fn`` nothing is backpropagated and no graph is kept.
    layout: "packed" (DualKV attention) or "replicated" (standard layout baseline).
    Returns one ``RLStepOutput`` per micro-batch, in order.
    """
    micro_batches = [_checked(mb) for mb in micro_batches]
    if not micro_batches:
        raise ValueError("forward_backward: no micro-batches given")
    forward_only = loss_fn is None
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=rl_forward_step(loss_fn, layout, with_entropy),
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.batch.num_tokens for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )


def _checked(micro_batch) -> RLMicroBatch:
    if not isinstance(micro_batch, RLMicroBatch):
        raise ValueError(f"micro-batches must be RLMicroBatch items, got {type(micro_batch).__name__}")
    return micro_batch


def _policy_loss(model, micro_batch: RLMicroBatch, targets: Tensor, loss_fn, with_entropy: bool, logits: Tensor):
    tokens = ResponseTokens.from_layout(micro_batch.batch.layout)
    logprobs, entropy = logprobs_from_logits(model, logits, targets, with_entropy)
    output = RLStepOutput(logprobs=tokens.split(logprobs.detach()))
    if entropy is not None:
        output.entropy = tokens.split(entropy.detach())
        output.metrics["entropy"] = tokens.split_groups(tokens.response_mean(entropy.detach()))
    if loss_fn is None:
        return logprobs.new_zeros(()), output
    if micro_batch.old_logprobs is None:
        raise ValueError("a policy loss needs the micro-batch's old_logprobs (forward_logprobs of the behaviour policy)")
    advantages = micro_batch.advantages
    if advantages is None:
        advantages = loss_fn.advantages(micro_batch.batch.rewards)
    ref = micro_batch.ref_logprobs
    result = loss_fn(
        logprobs,
        tokens.flatten(micro_batch.old_logprobs, "old_logprobs"),
        advantages,
        tokens,
        None if ref is None else tokens.flatten(ref, "ref_logprobs"),
    )
    # A copy: Megatron's schedule scales the returned loss in place.
    output.loss = result.loss.detach().clone()
    output.metrics.update(result.metrics)
    return result.loss, output
