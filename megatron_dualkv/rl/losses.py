"""GRPO and DAPO policy losses on the packed layouts' trained tokens.

Every tensor is flat over the trained tokens (order: ``ResponseTokens``): the response tokens of
a ``PackedBatch``, or the loss-masked tokens of each trajectory of a ``TrajectoryBatch``, where a
token that several trajectories share and train appears once per trajectory. Advantages are one
per response (trajectory). So the loss is defined on the original trajectories: a shared token
counts once per trajectory that trains it, each time with that trajectory's advantage, and in
that trajectory's mean. Per token ``t`` of response ``i`` with advantage ``A_i``:

    ratio_t   = exp(clamp(logp_t - old_logp_t, -20, 20))
    pg_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
    pg_t      = min(pg_t, -A_i * clip_ratio_c)          if A_i < 0  (dual clip, when clip_ratio_c given)
    pg_t      = pg_t * min(exp(old_logp_t - rollout_t), tis_cap)    (truncated importance sampling,
                                                          when tis_cap given; the weight is a constant)
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3 estimator, when ref given)
    loss_t    = pg_t + kl_coef * kl_t

The names and meanings follow verl's ``compute_policy_loss_vanilla`` (``core_algos.py``):

* the log-ratio clamp to +-20 before ``exp`` is always on, as in verl: for a sane ratio it changes
  nothing; a token whose policy moved by more than e^20 gets the ratio e^20, and no gradient
  through the ratio, instead of an overflow to inf (and NaN losses).
* dual-clip PPO (``clip_ratio_c``, Ye et al. 2020, arXiv:1912.09729), verl's meaning: for a
  negative advantage the token loss is capped at ``-A * clip_ratio_c``, so a token whose ratio
  has grown far beyond ``1 + eps_high`` can not dominate the batch; off by default, ``> 1`` when
  set, as verl asserts. Metric ``dual_clip_fraction`` (verl's ``pg_clipfrac_lower``): the share of
  tokens with ``A < 0`` whose cap is active.
* truncated importance sampling (verl's rollout correction, decoupled mode at token level,
  ``rollout_is_threshold`` = ``tis_cap``): the inference engine's log-probs ``rollout`` (of the
  policy that sampled the rollouts) differ from the trainer's behaviour log-probs ``old`` (the
  same weights, other kernels and precision); each token's policy term is weighted by
  ``min(pi_old / pi_rollout, tis_cap)``. The KL term is not weighted (verl adds its KL loss
  after the rollout correction too). Metric ``rollout_mismatch``: mean ``|old - rollout|`` over
  each response's tokens, whenever rollout log-probs are given.

GRPO: symmetric clip, optional KL, "sequence-mean" aggregation (mean over each response's
tokens, then over the micro-batch's responses; a trajectory without trained tokens has no mean
and does not count, as verl's ``exclude_fully_masked_seq``). DAPO: asymmetric clip (eps_high >
eps_low, "clip-higher"), no KL by default, "token-mean" aggregation (all trained tokens of the
micro-batch weigh the same, so long responses are not down-weighted).

Both divide by the micro-batch's own count (responses with trained tokens, or trained tokens) unless given a
``normalizer``: then the sum is divided by it. One batch split over several micro-batches (and DP
ranks) accumulates exactly the gradient of the whole batch when the normaliser is the whole
batch's count over (micro-batches x DP ranks), because Megatron's schedule divides every
micro-batch loss by the number of micro-batches and DDP averages over DP ranks
(``MicroBatchPlan.loss_normalizer`` computes it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Protocol, Sequence

import torch
from torch import Tensor

from .responses import ResponseTokens

AGGREGATIONS = ("sequence-mean", "token-mean")
LOG_RATIO_CLAMP = 20.0  # verl's bound on logp - old_logp before exp (module docstring)


@dataclass
class PolicyLossOutput:
    """loss: scalar to backpropagate; metrics: name -> per group an (N_g,) tensor, one value per response.

    Metrics (detached): ``loss`` (mean token loss), ``ratio_mean``, ``clip_fraction`` (share of
    tokens whose clipped term is the active one), ``advantage``, ``kl`` when reference log-probs
    were given, ``dual_clip_fraction`` with a dual clip, ``rollout_mismatch`` when rollout
    log-probs were given (module docstring).
    """

    loss: Tensor
    metrics: Dict[str, List[Tensor]]


class PolicyLoss(Protocol):
    """What ``forward_backward`` needs from a loss (``GRPOLoss`` and ``DAPOLoss`` are ones)."""

    def advantages(self, rewards: Sequence[Tensor]) -> Tensor:
        """Per-group rewards -> flat (num_responses,) advantages."""

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, tokens: ResponseTokens,
                 ref_logprobs: Optional[Tensor] = None, rollout_logprobs: Optional[Tensor] = None) -> PolicyLossOutput:
        """Flat response-token tensors (order: ``ResponseTokens``) -> loss and per-response metrics.

        ``forward_backward`` passes ``rollout_logprobs`` only to micro-batches that have them, so
        a loss without rollout correction may leave the argument out."""


def group_normalized_advantages(rewards: Sequence[Tensor], eps: float = 1e-6) -> Tensor:
    """GRPO advantages: per group ``(r - mean) / (std + eps)`` -> flat (num_responses,) float32.

    ``std`` is the unbiased sample std (torch.std, as TRL and verl use); a group of one response
    has no contrast and gets advantage 0.
    """
    if rewards is None:
        raise ValueError("advantages need rewards: pack the groups with RolloutGroup.rewards (the trajectories with "
                         "Trajectory.reward), or pass advantages")
    out = []
    for r in rewards:
        r = torch.as_tensor(r, dtype=torch.float32)
        if r.numel() == 1:
            out.append(torch.zeros(1))
        else:
            out.append((r - r.mean()) / (r.std() + eps))
    return torch.cat(out)


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    tokens: ResponseTokens,
    clip_eps_low: float,
    clip_eps_high: float,
    aggregation: str,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    normalizer: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
) -> PolicyLossOutput:
    """The clipped surrogate of the module docstring; shared by ``GRPOLoss`` and ``DAPOLoss``.

    normalizer: None for the mean over this micro-batch (over its trained tokens for "token-mean",
    over its responses with trained tokens for "sequence-mean"); else the sum (of token losses, of
    per-response mean token losses) divided by it.
    clip_ratio_c: the dual clip's bound (None: off). rollout_logprobs: the inference engine's
    log-probs of the response tokens; tis_cap: the truncated importance weight's cap (needs them).
    """
    _check_inputs(logprobs, old_logprobs, advantages, tokens, aggregation, ref_logprobs, kl_coef, rollout_logprobs, tis_cap)
    device = logprobs.device
    advantages = advantages.to(device, torch.float32)
    token_advantage = advantages[tokens.response_id.to(device)]
    old_logprobs = old_logprobs.to(device)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    unclipped_term, clipped_term = ratio * token_advantage, clipped_ratio * token_advantage
    token_loss = -torch.minimum(unclipped_term, clipped_term)
    metrics = {
        "ratio_mean": tokens.response_mean(ratio.detach()),
        "clip_fraction": tokens.response_mean((clipped_term < unclipped_term).float()),
        "advantage": advantages.detach(),
    }
    if clip_ratio_c is not None:
        bound, negative = -token_advantage * clip_ratio_c, token_advantage < 0
        metrics["dual_clip_fraction"] = tokens.response_mean((negative & (token_loss > bound)).float())
        token_loss = torch.where(negative, torch.minimum(token_loss, bound), token_loss)
    if rollout_logprobs is not None:
        log_weight = old_logprobs - rollout_logprobs.to(device)
        metrics["rollout_mismatch"] = tokens.response_mean(log_weight.abs().detach())
        if tis_cap is not None:
            token_loss = token_loss * torch.exp(log_weight).clamp(max=tis_cap).detach()
    if ref_logprobs is not None:
        log_ref_ratio = ref_logprobs.to(device) - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        token_loss = token_loss + kl_coef * kl
        metrics["kl"] = tokens.response_mean(kl.detach())
    metrics["loss"] = tokens.response_mean(token_loss.detach())
    if aggregation == "token-mean":
        terms, count = token_loss, tokens.num_tokens
    else:
        terms, count = tokens.response_mean(token_loss), tokens.num_trained_responses
    loss = terms.sum() / (max(count, 1) if normalizer is None else normalizer)
    return PolicyLossOutput(loss, {name: tokens.split_groups(value) for name, value in metrics.items()})


class _GroupRelativeClippedLoss:
    """What GRPOLoss and DAPOLoss share: advantages from group rewards, the clipped surrogate."""

    clip_range: tuple  # (eps_low, eps_high), provided by the subclass
    aggregation: str
    kl_coef: float
    advantage_eps: float
    normalizer: Optional[float]
    clip_ratio_c: Optional[float]
    tis_cap: Optional[float]

    def __post_init__(self):
        low, high = self.clip_range
        if not (0.0 <= low < 1.0 and high >= 0.0):
            raise ValueError(f"{type(self).__name__}: clip eps must satisfy 0 <= eps_low < 1 and eps_high >= 0, got {self.clip_range}")
        if self.kl_coef < 0 or self.advantage_eps < 0:
            raise ValueError(f"{type(self).__name__}: kl_coef and advantage_eps must be >= 0")
        if self.normalizer is not None and not self.normalizer > 0:
            raise ValueError(f"{type(self).__name__}: normalizer must be > 0 (or None), got {self.normalizer!r}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"{type(self).__name__}: clip_ratio_c (dual clip) must be > 1 (or None: off), "
                             f"got {self.clip_ratio_c!r}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"{type(self).__name__}: tis_cap (truncated importance sampling) must be > 0 (or None: off), "
                             f"got {self.tis_cap!r}")

    def advantages(self, rewards: Sequence[Tensor]) -> Tensor:
        """Flat (num_responses,) group-normalised advantages of per-group rewards."""
        return group_normalized_advantages(rewards, self.advantage_eps)

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, tokens: ResponseTokens,
        ref_logprobs: Optional[Tensor] = None, rollout_logprobs: Optional[Tensor] = None,
    ) -> PolicyLossOutput:
        low, high = self.clip_range
        return clipped_policy_loss(
            logprobs, old_logprobs, advantages, tokens, low, high, self.aggregation, ref_logprobs, self.kl_coef,
            self.normalizer, self.clip_ratio_c, rollout_logprobs, self.tis_cap,
        )


@dataclass(frozen=True)
class GRPOLoss(_GroupRelativeClippedLoss):
    """GRPO: group-normalised advantages, symmetric ratio clip, optional k3 KL to a reference policy,
    sequence-mean then batch-mean aggregation (``aggregation="token-mean"`` is available);
    ``normalizer``, ``clip_ratio_c`` (dual clip), ``tis_cap`` (truncated importance sampling): see
    the module docstring."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    advantage_eps: float = 1e-6
    aggregation: str = "sequence-mean"
    normalizer: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    tis_cap: Optional[float] = None

    @property
    def clip_range(self):
        return self.clip_eps, self.clip_eps


@dataclass(frozen=True)
class DAPOLoss(_GroupRelativeClippedLoss):
    """DAPO: group-normalised advantages, asymmetric clip (clip-higher), token-level aggregation;
    ``normalizer``, ``clip_ratio_c`` (dual clip), ``tis_cap`` (truncated importance sampling): see
    the module docstring."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    advantage_eps: float = 1e-6
    normalizer: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    tis_cap: Optional[float] = None
    aggregation: ClassVar[str] = "token-mean"

    @property
    def clip_range(self):
        return self.clip_eps_low, self.clip_eps_high


def _check_inputs(logprobs, old_logprobs, advantages, tokens, aggregation, ref_logprobs, kl_coef, rollout_logprobs,
                  tis_cap) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    n = tokens.num_tokens
    given = (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
             ("rollout_logprobs", rollout_logprobs))
    for name, value in given:
        if value is not None and value.shape != (n,):
            raise ValueError(f"{name} must be flat over the {n} response tokens, got shape {tuple(value.shape)}")
    if advantages.shape != (tokens.num_responses,):
        raise ValueError(f"advantages must have one value per response ({tokens.num_responses}), got shape {tuple(advantages.shape)}")
    if kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError(f"tis_cap={tis_cap} (truncated importance sampling) needs rollout_logprobs")
