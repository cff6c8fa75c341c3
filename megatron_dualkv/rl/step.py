"""One entry for RL frameworks: forward (and backward with a policy loss) over packed micro-batches.

``forward_backward`` runs Megatron-Core's own schedule (``get_forward_backward_func``), so loss
scaling over micro-batches, DDP gradient-sync deferral and the MoE auxiliary-loss scale behave as
in any Megatron training step; ``rl_forward_step`` is the matching Megatron ``forward_step_func``
for loops that call the schedule themselves.

A micro-batch is a ``PackedBatch`` (``pack_groups``: prompts and responses) or a
``TrajectoryBatch`` (``pack_trajectories``: prefix trees of trajectories); per-response results
are nested per group, per response, where a trajectory is a response (``ResponseTokens``).
Whatever the parallel layout, every rank gets the full per-response results: under context
parallelism the per-token log-probs are gathered over the CP ranks (``logprobs``), under pipeline
parallelism the last stage's results are broadcast to the other stages.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from ..layout import DualKVLayout, TreeLayout
from ..packing import PackedBatch
from ..trajectories import TrajectoryBatch
from .logprobs import LAYOUTS, logprobs_from_output, model_output, response_logprobs
from .losses import PolicyLoss
from .prefix_reuse import PrefixReuseBatch, check_prefix_reuse_supported, prefix_reuse_output
from .prompt_pipeline import prompt_pipeline_step
from .responses import ResponseTokens


@dataclass
class RLMicroBatch:
    """One packed micro-batch and what the policy loss needs besides the current log-probs.

    batch: a ``PackedBatch`` or a ``TrajectoryBatch`` (whose trajectories are its responses), or a
    ``PrefixReuseBatch`` (``pack_prefix_reuse``: responses of a group whose prompt runs once;
    ``pack_prefix_reuse_trajectories``: a part of a tree whose shared path runs once).
    old_logprobs / ref_logprobs / rollout_logprobs: per group, per response (R_i,) tensors of its
    trained tokens, as ``forward_logprobs`` returns them (behaviour policy; reference policy, for a
    KL term; the inference engine's log-probs of the sampled tokens, for the loss's rollout
    correction). advantages: (num_responses,) flat over responses (``ResponseTokens`` order); by
    default the loss derives them from the batch's rewards, per group. is_padding: a padding
    micro-batch of a plan (``PlannedMicroBatch.is_padding``, run so that every rank runs as many
    micro-batches): its loss is exactly 0, with no gradient, and needs none of the above.
    on_policy: the loss's old log-probs are the current ones, detached (then ``old_logprobs`` is
    None): the one update of a rollout batch by the policy that would have computed them, whose
    ratio is 1 (verl's actor does the same when ``on_policy``), with no forward pass for them.
    """

    batch: Union[PackedBatch, TrajectoryBatch, PrefixReuseBatch]
    old_logprobs: Optional[Sequence[Sequence[Tensor]]] = None
    ref_logprobs: Optional[Sequence[Sequence[Tensor]]] = None
    advantages: Optional[Tensor] = None
    rollout_logprobs: Optional[Sequence[Sequence[Tensor]]] = None
    is_padding: bool = False
    on_policy: bool = False


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
    number of micro-batches, backpropagates it unless ``forward_only``, and collects the outputs
    (under pipeline parallelism on the last stage only; ``forward_backward`` broadcasts them).
    Without ``loss_fn`` the loss is 0 and only log-probs are produced.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    def forward_step(data_iterator: Iterator[RLMicroBatch], model):
        micro_batch = _checked(next(data_iterator))
        reuse = isinstance(micro_batch.batch, PrefixReuseBatch)
        if reuse:
            output, micro_batch = prefix_reuse_output(model, micro_batch, layout)
        else:
            output = model_output(model, micro_batch.batch, layout)
        return output, partial(_policy_loss, model, micro_batch, layout, loss_fn, with_entropy, reuse)

    return forward_step


def forward_logprobs(model, batch, layout: str = "packed") -> List[List[Tensor]]:
    """Per group, per response, the (R_i,) float32 log-probs of the trained tokens of ``batch`` (a
    ``PackedBatch`` or a ``TrajectoryBatch``) under ``model``.

    ``layout``: "packed" (DualKV attention) or "replicated" (the standard layout: the baseline and
    equivalence oracle). Differentiable (runs under the caller's grad mode), except under pipeline
    parallelism: there it runs Megatron's schedule forward-only (``forward_backward`` without a
    loss), and every stage returns the last stage's result.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        logprobs, _ = response_logprobs(model, batch, layout)
        return ResponseTokens.of(batch).split(logprobs)
    if parallel_state.get_virtual_pipeline_model_parallel_world_size():
        raise ValueError(
            "the interleaved pipeline schedule runs at least pp micro-batches together: collect log-probs with "
            "forward_backward(model, [RLMicroBatch(batch) for batch in batches])"
        )
    return forward_backward(model, [RLMicroBatch(batch)], layout=layout)[0].logprobs


def trajectory_logprobs(model, batch: TrajectoryBatch, layout: str = "packed") -> List[Tensor]:
    """Per trajectory of ``batch`` (input order), the (L_i - 1,) float32 log-probs
    ``log p(token t | tokens < t)``, t = 1..L_i-1, whatever its loss mask; as ``forward_logprobs``
    (a token that trajectories share is computed once, with DualKV attention on the packed trees,
    or on each trajectory's own sequence with ``layout="replicated"``).
    """
    if not isinstance(batch, TrajectoryBatch):
        raise ValueError(f"trajectory_logprobs takes a TrajectoryBatch (megatron_dualkv.pack_trajectories), "
                         f"got {type(batch).__name__}")
    every = TrajectoryBatch(batch.tokens, batch.layout, batch.trajectory_index, batch.predictor_index,
                            [torch.ones_like(mask) for mask in batch.loss_masks], batch.rewards, batch.groups,
                            batch.group_index, batch.trajectory_segments)
    nested = forward_logprobs(model, every, layout)
    order = ResponseTokens.of(every).trajectory_of.tolist()
    out: List[Optional[Tensor]] = [None] * batch.num_trajectories
    for i, values in zip(order, (values for group in nested for values in group)):
        out[i] = values
    return out


def forward_backward(
    model,
    micro_batches: Sequence[RLMicroBatch],
    loss_fn: Optional[PolicyLoss] = None,
    *,
    layout: str = "packed",
    with_entropy: bool = False,
) -> List[RLStepOutput]:
    """Forward ``micro_batches`` through ``model`` and, with ``loss_fn``, backpropagate its loss.

    model: a model from ``build_model`` (optionally wrapped in Megatron's DDP / Float16Module), or
        its list of model chunks under interleaved pipeline parallelism.
    loss_fn: ``GRPOLoss(...)``, ``DAPOLoss(...)`` or any ``PolicyLoss``; every
        micro-batch then needs ``old_logprobs``. Gradients of ``mean over micro-batches of the
        loss`` accumulate in the parameters (``.grad``, or DDP's ``main_grad``); the optimizer step
        is the caller's. Without ``loss_fn`` nothing is backpropagated and no graph is kept.
    layout: "packed" (DualKV attention) or "replicated" (standard layout baseline).
    Returns one ``RLStepOutput`` per micro-batch, in order, on every rank.
    """
    micro_batches = [_checked(mb) for mb in micro_batches]
    if not micro_batches:
        raise ValueError("forward_backward: no micro-batches given")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if any(isinstance(mb.batch, PrefixReuseBatch) for mb in micro_batches):
        check_prefix_reuse_supported(chunks[0], layout)  # before the interleaved schedule's padding
    if parallel_state.get_virtual_pipeline_model_parallel_world_size():
        micro_batches = _same_length(micro_batches, layout)
    forward_only = loss_fn is None
    with torch.no_grad() if forward_only else contextlib.nullcontext(), prompt_pipeline_step():
        outputs = get_forward_backward_func()(
            forward_step_func=rl_forward_step(loss_fn, layout, with_entropy),
            # every model chunk (virtual pipeline stage) walks through the same micro-batches
            data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=max(mb.batch.num_tokens for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return _from_last_pipeline_stage(outputs, next(chunks[0].parameters()).device)


def _same_length(micro_batches: List[RLMicroBatch], layout: str) -> List[RLMicroBatch]:
    """The micro-batches padded to the longest one's token count.

    Megatron-Core 0.16.1's interleaved schedule deadlocks in its variable-sequence-length
    exchange (each p2p call first swaps shapes, and its calls do not pair up one-to-one between
    stages), so the interleaved schedule exchanges one fixed shape (``ParallelSizes`` turns
    ``variable_seq_lengths`` off) and the packed micro-batches get more padding instead, which is
    its own segment and leaves every result unchanged.
    """
    if layout != "packed":
        raise NotImplementedError("the interleaved pipeline schedule runs the packed layout only (fixed-shape stage exchange)")
    longest = max(mb.batch.num_tokens for mb in micro_batches)
    return [replace(mb, batch=_padded(mb.batch, longest)) for mb in micro_batches]


def _padded(batch, num_tokens: int):
    """``batch`` with padding up to ``num_tokens`` packed tokens (more of its padding segment)."""
    extra = num_tokens - batch.num_tokens
    if not extra:
        return batch
    layout, tokens = batch.layout, torch.cat([batch.tokens, batch.tokens.new_zeros(extra)])
    if isinstance(batch, PackedBatch):
        longer = DualKVLayout(layout.prompt_lens, layout.response_lens, layout.pad_len + extra, layout.device)
        return PackedBatch(tokens, longer, batch.rewards)
    longer = TreeLayout(layout.segment_lens, layout.segment_parent, layout.pad_len + extra, layout.device)
    # the padding segment, a root: -1 at its start, then the token before
    pad_start = batch.num_tokens - layout.pad_len
    pad_predictors = torch.arange(pad_start - 1, num_tokens - 1, device=batch.predictor_index.device)
    pad_predictors[0] = -1
    predictors = torch.cat([batch.predictor_index[:pad_start], pad_predictors])
    return TrajectoryBatch(tokens, longer, batch.trajectory_index, predictors,
                           batch.loss_masks, batch.rewards, batch.groups, batch.group_index, batch.trajectory_segments)


def _from_last_pipeline_stage(outputs: List[RLStepOutput], device: torch.device) -> List[RLStepOutput]:
    """The last pipeline stage's outputs on every stage (Megatron's schedule returns them there only)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return outputs
    source = parallel_state.get_pipeline_model_parallel_last_rank()
    payload = [[_moved(output, "cpu") for output in outputs]]
    dist.broadcast_object_list(payload, src=source, group=parallel_state.get_pipeline_model_parallel_group())
    if dist.get_rank() == source:  # the source keeps its own outputs where they are
        return outputs
    return [_moved(output, device) for output in payload[0]]


def _moved(output: RLStepOutput, device) -> RLStepOutput:
    def nested(values):
        return None if values is None else [[x.to(device) for x in group] for group in values]

    return RLStepOutput(
        logprobs=nested(output.logprobs),
        entropy=nested(output.entropy),
        loss=None if output.loss is None else output.loss.to(device),
        metrics={name: [x.to(device) for x in values] for name, values in output.metrics.items()},
    )


def _checked(micro_batch) -> RLMicroBatch:
    if not isinstance(micro_batch, RLMicroBatch):
        raise ValueError(f"micro-batches must be RLMicroBatch items, got {type(micro_batch).__name__}")
    return micro_batch


def _policy_loss(model, micro_batch: RLMicroBatch, layout: str, loss_fn, with_entropy: bool, all_tokens: bool,
                 hidden: Tensor):
    tokens = ResponseTokens.of(micro_batch.batch, hidden.device)
    logprobs, entropy = logprobs_from_output(model, micro_batch.batch, hidden, layout, with_entropy, all_tokens)
    output = RLStepOutput(logprobs=tokens.split(logprobs.detach()))
    if entropy is not None:
        output.entropy = tokens.split(entropy.detach())
        output.metrics["entropy"] = tokens.split_groups(tokens.response_mean(entropy.detach()))
    if loss_fn is None:
        return logprobs.new_zeros(()), output
    if micro_batch.is_padding:  # in the graph, so that the schedule's backward runs as for any micro-batch
        output.loss = logprobs.new_zeros(())
        return logprobs.sum() * 0.0, output
    if micro_batch.on_policy and micro_batch.old_logprobs is not None:
        raise ValueError("an on_policy micro-batch takes the current log-probs as its old ones: give it no old_logprobs")
    if not micro_batch.on_policy and micro_batch.old_logprobs is None:
        raise ValueError("a policy loss needs the micro-batch's old_logprobs (forward_logprobs of the behaviour "
                         "policy), or on_policy=True")
    advantages = micro_batch.advantages
    if advantages is None:
        advantages = loss_fn.advantages(tokens.group_rewards(micro_batch.batch))
    ref, rollout = micro_batch.ref_logprobs, micro_batch.rollout_logprobs
    # rollout log-probs only where given: a PolicyLoss without rollout correction need not take them
    extra = {} if rollout is None else {"rollout_logprobs": tokens.flatten(rollout, "rollout_logprobs")}
    result = loss_fn(
        logprobs,
        logprobs.detach() if micro_batch.on_policy else tokens.flatten(micro_batch.old_logprobs, "old_logprobs"),
        advantages,
        tokens,
        None if ref is None else tokens.flatten(ref, "ref_logprobs"),
        **extra,
    )
    # A copy: Megatron's schedule scales the returned loss in place.
    output.loss = result.loss.detach().clone()
    output.metrics.update(result.metrics)
    return result.loss, output
