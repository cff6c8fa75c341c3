"""Several optimizer steps per rollout batch: PPO mini-batches and epochs on packed micro-batches.

With one update per rollout batch the behaviour policy is the current one: the ratio is 1 and the
clip never acts. PPO takes ``M`` optimizer steps per rollout batch, each on ``1/M`` of it, and
repeats them for ``E`` epochs. The names follow verl's actor (``ppo_mini_batch_size``, here as the
number of mini-batches, and ``ppo_epochs``; its Megatron actor's ``make_minibatch_iterator`` with
``shuffle=False``, its default):

1. ``plan_mini_batches(groups, M, max_tokens, advantages, ...)``: mini-batch ``j`` holds the groups
   ``[j G/M, (j+1) G/M)`` of the rollout batch (rollout groups, or the groups of trajectories,
   ``trajectory_groups``), in every epoch (no shuffling: its plan and its
   behaviour log-probs are computed once, and a resumed run repeats the same updates), planned
   into packed micro-batches for the DP ranks (``plan_micro_batches``) with its share of the
   advantages (computed by the caller on whole groups) and its own loss normaliser
   (``MicroBatchPlan.loss_normalizer``, DP ranks included).
2. ``forward_only(model, mini_batches)``: the behaviour log-probs, once per rollout batch and
   before the first update (so that later updates have ratios != 1), in one forward-only run of
   Megatron's schedule over every mini-batch's micro-batches; a frozen reference policy's the
   same way. With one update (M = E = 1) the behaviour policy is the one being updated:
   ``with_logprobs(on_policy=True)`` takes its log-probs from the update's own forward, detached,
   and no forward-only pass runs for them (a quarter of the step's FLOPs). The inference engine's
   log-probs may stand in for the behaviour ones (verl's rollout-correction "bypass mode": no
   forward pass), or go beside them for truncated importance sampling (``GRPOLoss(tis_cap=...)``,
   ``MiniBatch.with_logprobs(rollout=...)``).
3. ``ppo_updates(model, optimizer, mini_batches, loss_fn, epochs)``: ``E x M`` updates, each
   ``forward_backward`` over one mini-batch's micro-batches, then the optimizer step; it yields
   after each step (log it, or look at the model between updates). A learning-rate scheduler
   steps once per rollout batch, after all of them, as in verl's Megatron actor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from torch import Tensor

from ..packing import RolloutGroup
from ..planner import DEFAULT_ATTENTION_WEIGHT, MicroBatchPlan, PlannedMicroBatch, plan_micro_batches, trajectory_groups
from ..trajectories import Trajectory
from .losses import PolicyLoss
from .step import RLMicroBatch, RLStepOutput, forward_backward

Nested = List[List[Tensor]]  # per group, per response (trajectory), an (R_i,) tensor


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's share of a rollout batch.

    group_index:   its groups' positions in the rollout batch
    plan:          its micro-batch plan, all DP ranks
    planned:       this DP rank's planned micro-batches (``plan.ranks[dp_rank]``)
    micro_batches: this rank's packed micro-batches with their advantages and the log-probs that
                   ``with_logprobs`` set; the padding ones (``is_padding``) need none
    """

    group_index: Tuple[int, ...]
    plan: MicroBatchPlan
    planned: Tuple[PlannedMicroBatch, ...]
    micro_batches: Tuple[RLMicroBatch, ...]

    def loss_fn(self, loss_fn: PolicyLoss) -> PolicyLoss:
        """``loss_fn`` normalised so that the mini-batch's gradient is that of all its groups in one piece."""
        return replace(loss_fn, normalizer=self.plan.loss_normalizer(loss_fn.aggregation))

    def share(self, per_group: Sequence[Sequence[Tensor]]) -> List[Optional[Nested]]:
        """Per-response values of the whole rollout batch (per group, per response: rollout
        log-probs; for trajectories per group of ``trajectory_groups``, per trajectory) -> per
        micro-batch of this rank, its responses' values (None for padding)."""
        return [None if mb.is_padding else self._responses_of(mb, per_group) for mb in self.planned]

    def _responses_of(self, planned: PlannedMicroBatch, per_group: Sequence[Sequence[Tensor]]) -> Nested:
        return [[per_group[self.group_index[g]][i] for i in responses]
                for g, responses in zip(planned.source_groups, planned.source_responses)]

    def with_logprobs(self, old: Optional[Sequence[Nested]] = None, ref: Optional[Sequence[Nested]] = None,
                      rollout: Optional[Sequence[Optional[Nested]]] = None, on_policy: bool = False) -> "MiniBatch":
        """The mini-batch with behaviour (``old``), reference and rollout log-probs on its real
        micro-batches: one entry per micro-batch of this rank, as ``forward_only`` (its outputs'
        ``logprobs``) or ``share`` give them; None leaves that kind as it was. ``on_policy``: no
        ``old``, the update's own log-probs stand in for them (``RLMicroBatch.on_policy``)."""
        if on_policy and old is not None:
            raise ValueError("with_logprobs: on_policy takes the update's own log-probs as the old ones; give no old")
        given = {name: values for name, values in
                 (("old_logprobs", old), ("ref_logprobs", ref), ("rollout_logprobs", rollout)) if values is not None}
        for name, values in given.items():
            if len(values) != len(self.micro_batches):
                raise ValueError(f"{name}: {len(values)} entries for {len(self.micro_batches)} micro-batches")
        extra = {"on_policy": True} if on_policy else {}
        micro_batches = tuple(
            mb if mb.is_padding else replace(mb, **{name: values[i] for name, values in given.items()}, **extra)
            for i, mb in enumerate(self.micro_batches)
        )
        return replace(self, micro_batches=micro_batches)


@dataclass(frozen=True)
class PPOUpdate:
    """One optimizer step of ``ppo_updates``: its epoch and mini-batch (0-based) and the
    ``forward_backward`` outputs of this rank's micro-batches."""

    epoch: int
    index: int
    mini_batch: MiniBatch
    outputs: List[RLStepOutput]


def plan_mini_batches(
    groups: Union[Sequence[RolloutGroup], Sequence[Trajectory]],
    num_mini_batches: int,
    max_tokens: int,
    advantages: Tensor,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
    pad_to_multiple_of: int = 1,
    prefix_reuse: bool = False,
) -> List[MiniBatch]:
    """The rollout batch ``groups`` as ``num_mini_batches`` mini-batches of as many consecutive
    groups each, planned (``plan_micro_batches(max_tokens, dp_size, attention_weight)``) and
    packed (``pad_to_multiple_of``: ``ParallelSizes.token_multiple``) for DP rank ``dp_rank``.

    groups: ``RolloutGroup`` s, or ``Trajectory`` s (their groups are ``trajectory_groups``).
    advantages: (num_responses,) of the whole rollout batch, flat in its order (group by group):
    ``loss_fn.advantages`` of the rewards of all groups. ValueError when the groups do not split
    into ``num_mini_batches`` equal parts or the advantages do not match the responses.
    prefix_reuse: a group (tree) over ``max_tokens`` runs its prompt (shared path) once (``plan_micro_batches``).
    """
    if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int) or num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be a positive int, got {num_mini_batches!r}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
    groups = list(groups)
    members = trajectory_groups(groups) if groups and isinstance(groups[0], Trajectory) else None
    units = groups if members is None else members
    if not units or len(units) % num_mini_batches:
        raise ValueError(f"{len(units)} rollout groups do not split into {num_mini_batches} mini-batches of equal size")
    offsets = list(accumulate((len(g.responses) for g in groups) if members is None else map(len, members), initial=0))
    if tuple(advantages.shape) != (offsets[-1],):
        raise ValueError(f"advantages must have one value per response of the rollout batch ({offsets[-1]}), "
                         f"got shape {tuple(advantages.shape)}")
    size = len(units) // num_mini_batches
    mini_batches = []
    for first in range(0, len(units), size):
        index = tuple(range(first, first + size))
        inputs = [groups[g] for g in index] if members is None else [groups[i] for g in index for i in members[g]]
        plan = plan_micro_batches(inputs, max_tokens, dp_size, attention_weight, prefix_reuse)
        own_advantages = advantages[offsets[first] : offsets[first + size]]
        planned = plan.ranks[dp_rank]
        micro_batches = tuple(RLMicroBatch(mb.pack(pad_to_multiple_of), advantages=mb.select_responses(own_advantages),
                                           is_padding=mb.is_padding) for mb in planned)
        mini_batches.append(MiniBatch(index, plan, planned, micro_batches))
    return mini_batches


def forward_only(model, mini_batches: Sequence[MiniBatch], layout: str = "packed", with_entropy: bool = False
                 ) -> List[List[RLStepOutput]]:
    """Per mini-batch, per micro-batch of this rank, the log-probs (and entropies) of ``model``:
    one forward-only run of Megatron's schedule over all the mini-batches' micro-batches."""
    flat = [RLMicroBatch(mb.batch) for mini in mini_batches for mb in mini.micro_batches]
    outputs = forward_backward(model, flat, layout=layout, with_entropy=with_entropy)
    counts = [len(mini.micro_batches) for mini in mini_batches]
    return [outputs[start : start + count] for start, count in zip(accumulate(counts, initial=0), counts)]


def ppo_updates(
    model,
    optimizer,
    mini_batches: Sequence[MiniBatch],
    loss_fn: PolicyLoss,
    epochs: int = 1,
    *,
    layout: str = "packed",
    with_entropy: bool = False,
) -> Iterator[PPOUpdate]:
    """``epochs`` x ``len(mini_batches)`` optimizer steps of ``loss_fn``, mini-batch by mini-batch;
    yields after each step.

    model: Megatron's ``DistributedDataParallel`` (or its list of model chunks); optimizer:
    Megatron's (``get_megatron_optimizer``); gradients are zeroed before each update, as Megatron's
    training loop does. loss_fn: ``GRPOLoss`` or ``DAPOLoss`` (or a dataclass loss with their
    ``aggregation`` and ``normalizer`` fields: each mini-batch sets its normaliser). Every real
    micro-batch needs its ``old_logprobs`` (``with_logprobs``).
    with_entropy: entropies in the first epoch's updates (each response once).
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for epoch in range(epochs):
        for index, mini in enumerate(mini_batches):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            outputs = forward_backward(model, mini.micro_batches, mini.loss_fn(loss_fn), layout=layout,
                                       with_entropy=with_entropy and epoch == 0)
            optimizer.step()
            yield PPOUpdate(epoch, index, mini, outputs)
