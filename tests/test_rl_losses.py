"""GRPO and DAPO losses (megatron_dualkv.rl.losses) against a direct per-response implementation, and
the dual clip, the log-ratio clamp and truncated importance sampling on hand-computed tokens."""
import dataclasses
import math

import pytest
import torch

from megatron_dualkv import DualKVLayout
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, ResponseTokens, group_normalized_advantages
from megatron_dualkv.rl.losses import LOG_RATIO_CLAMP

LAYOUT = DualKVLayout((4, 1, 2), ((3, 1, 5), (2,), (4, 4)), pad_len=3)


def direct_advantages(rewards, eps):
    out = []
    for group in rewards:
        n = len(group)
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1)) if n > 1 else None
        out += [0.0 if std is None else (r - mean) / (std + eps) for r in group]
    return out


def direct_loss(logprobs, old, ref, advantages, eps_low, eps_high, kl_coef, token_mean, clip_ratio_c=None,
                rollout=None, tis_cap=None):
    """Response by response, token by token, in plain Python arithmetic on the nested lists."""
    responses = [r for group in logprobs for r in group]
    olds = [r for group in old for r in group]
    refs = [r for group in ref for r in group] if ref is not None else [None] * len(responses)
    rollouts = [r for group in rollout for r in group] if rollout is not None else [None] * len(responses)
    per_response, all_tokens = [], []
    metrics = {"ratio_mean": [], "clip_fraction": [], "kl": [], "loss": [], "dual_clip_fraction": [], "rollout_mismatch": []}
    for lp, o, rf, ro, a in zip(responses, olds, refs, rollouts, advantages):
        token_losses, ratios, clipped, kls, dual, gaps = [], [], [], [], [], []
        for t in range(len(lp)):
            ratio = torch.exp(lp[t] - o[t])
            surrogate = ratio * a
            clipped_surrogate = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
            loss = -torch.minimum(surrogate, clipped_surrogate)
            clipped.append(float(clipped_surrogate < surrogate))
            if clip_ratio_c is not None:
                capped = a < 0 and loss.item() > -a * clip_ratio_c
                dual.append(float(capped))
                if capped:
                    loss = loss * 0 - a * clip_ratio_c  # the cap: a constant, no gradient
            if ro is not None:
                gaps.append(abs(o[t].item() - ro[t].item()))
                if tis_cap is not None:
                    loss = loss * min(math.exp(o[t].item() - ro[t].item()), tis_cap)
            if rf is not None:
                kl = torch.exp(rf[t] - lp[t]) - (rf[t] - lp[t]) - 1
                loss = loss + kl_coef * kl
                kls.append(kl.item())
            token_losses.append(loss)
            ratios.append(ratio.item())
        per_response.append(sum(token_losses) / len(token_losses))
        all_tokens += token_losses
        metrics["ratio_mean"].append(sum(ratios) / len(ratios))
        metrics["clip_fraction"].append(sum(clipped) / len(clipped))
        metrics["loss"].append((sum(token_losses) / len(token_losses)).item())
        for name, values in (("kl", kls), ("dual_clip_fraction", dual), ("rollout_mismatch", gaps)):
            if values:
                metrics[name].append(sum(values) / len(values))
    loss = sum(all_tokens) / len(all_tokens) if token_mean else sum(per_response) / len(per_response)
    return loss, metrics


def inputs(seed=0, spread=0.4):
    """log-probs far enough from the old ones that both clip bounds are hit (and the rollout
    log-probs from the old ones that the importance weights are capped on some tokens)."""
    tokens = ResponseTokens.from_layout(LAYOUT)
    g = torch.Generator().manual_seed(seed)
    n = tokens.num_tokens
    logprobs = (-2 + torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)
    ref = logprobs.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)
    rollout = old + spread * torch.randn(n, generator=g, dtype=torch.float64)
    rewards = [torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.7]), torch.tensor([0.0, 1.0])]
    return tokens, logprobs, old, ref, rewards, rollout


@pytest.mark.parametrize(
    "loss_fn, with_rollout",
    [
        (GRPOLoss(clip_eps=0.2), False),
        (GRPOLoss(clip_eps=0.1, kl_coef=0.05), False),
        (GRPOLoss(clip_eps=0.2, kl_coef=0.1, aggregation="token-mean"), False),
        (DAPOLoss(), False),
        (DAPOLoss(clip_eps_low=0.1, clip_eps_high=0.3, kl_coef=0.02), False),
        (GRPOLoss(clip_eps=0.1, clip_ratio_c=1.3), False),
        (GRPOLoss(clip_eps=0.1, kl_coef=0.05), True),
        (DAPOLoss(clip_eps_low=0.1, kl_coef=0.02, clip_ratio_c=1.3, tis_cap=1.2), True),
    ],
    ids=["grpo", "grpo-kl", "grpo-token-mean", "dapo", "dapo-kl", "grpo-dual-clip", "grpo-rollout-mismatch",
         "dapo-dual-clip-tis-kl"],
)
def test_loss_matches_a_direct_per_response_implementation(loss_fn, with_rollout):
    tokens, logprobs, old, ref, rewards, rollout = inputs()
    ref = ref if loss_fn.kl_coef else None
    rollout = rollout if with_rollout else None
    advantages = loss_fn.advantages(rewards)
    out = loss_fn(logprobs, old, advantages, tokens, ref, rollout)

    nested = tokens.split(logprobs)
    want_adv = direct_advantages([r.tolist() for r in rewards], loss_fn.advantage_eps)
    low, high = loss_fn.clip_range
    want, metrics = direct_loss(
        nested, tokens.split(old), None if ref is None else tokens.split(ref), want_adv, low, high,
        loss_fn.kl_coef, loss_fn.aggregation == "token-mean", loss_fn.clip_ratio_c,
        None if rollout is None else tokens.split(rollout), loss_fn.tis_cap,
    )
    torch.testing.assert_close(out.loss, want)
    (got_grad,) = torch.autograd.grad(out.loss, logprobs)
    (want_grad,) = torch.autograd.grad(want, logprobs)
    torch.testing.assert_close(got_grad, want_grad)

    flat = lambda per_group: torch.cat(per_group).tolist()  # noqa: E731
    assert [len(v) for v in out.metrics["loss"]] == [3, 1, 2]
    for name in ("ratio_mean", "clip_fraction", "loss"):
        assert flat(out.metrics[name]) == pytest.approx(metrics[name]), name
    assert flat(out.metrics["advantage"]) == pytest.approx(want_adv)
    for name, given in (("kl", ref is not None), ("dual_clip_fraction", loss_fn.clip_ratio_c is not None),
                        ("rollout_mismatch", rollout is not None)):
        if given:
            assert flat(out.metrics[name]) == pytest.approx(metrics[name]), name
        else:
            assert name not in out.metrics
    assert 0 < sum(flat(out.metrics["clip_fraction"])) < tokens.num_responses, "the inputs must exercise clipping"
    if loss_fn.clip_ratio_c is not None:
        assert 0 < sum(flat(out.metrics["dual_clip_fraction"])) < tokens.num_responses, "the inputs must exercise the dual clip"
    if loss_fn.tis_cap is not None:
        weights = torch.exp(old - rollout)
        assert (weights > loss_fn.tis_cap).any() and (weights < loss_fn.tis_cap).any(), "the inputs must exercise the cap"


def one_token_per_response(logprobs, old, advantages, loss_fn, rollout=None):
    """The loss and its gradient for responses of one token each (one group), log-probs given as floats."""
    n = len(logprobs)
    tokens = ResponseTokens.from_layout(DualKVLayout((1,), ((1,) * n,)))
    logprobs = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    old, advantages = torch.tensor(old, dtype=torch.float64), torch.tensor(advantages)
    out = loss_fn(logprobs, old, advantages, tokens, None, None if rollout is None else torch.tensor(rollout, dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    return out, grad


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """verl's dual clip: with A = -1 and ratio 5, PPO's token loss 5 becomes clip_ratio_c = 3, with
    no gradient; ratio 2 stays below the cap; a positive advantage is left alone."""
    ratios, advantages = [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0]
    logprobs, old = [math.log(r) for r in ratios], [0.0, 0.0, 0.0]
    sequence_mean = GRPOLoss(clip_eps=0.2, normalizer=1.0)  # sum of the token losses: one token per response
    plain, plain_grad = one_token_per_response(logprobs, old, advantages, sequence_mean)
    dual, dual_grad = one_token_per_response(logprobs, old, advantages, dataclasses.replace(sequence_mean, clip_ratio_c=3.0))
    assert torch.cat(plain.metrics["loss"]).tolist() == pytest.approx([5.0, 2.0, -1.2])
    assert torch.cat(dual.metrics["loss"]).tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert torch.cat(dual.metrics["dual_clip_fraction"]).tolist() == [1.0, 0.0, 0.0]
    assert plain_grad.tolist() == pytest.approx([5.0, 2.0, 0.0]) and dual_grad.tolist() == pytest.approx([0.0, 2.0, 0.0])
    assert DAPOLoss(clip_ratio_c=3.0)(*one_token_args(logprobs, old, advantages)).loss.item() == pytest.approx((3.0 + 2.0 - 1.28) / 3)


def one_token_args(logprobs, old, advantages):
    tokens = ResponseTokens.from_layout(DualKVLayout((1,), ((1,) * len(logprobs),)))
    return torch.tensor(logprobs), torch.tensor(old), torch.tensor(advantages), tokens


def test_log_ratio_is_clamped_to_20_before_exp():
    """A log-ratio of 100 (exp overflows float32) and one of 30 both give the ratio e^20, with no
    gradient through it; -100 gives e^-20."""
    loss_fn = GRPOLoss(clip_eps=0.2, normalizer=1.0)
    tokens = ResponseTokens.from_layout(DualKVLayout((1,), ((1, 1, 1),)))
    logprobs = torch.tensor([100.0, 30.0, -100.0], requires_grad=True)
    out = loss_fn(logprobs, torch.zeros(3), torch.tensor([-1.0, -1.0, 1.0]), tokens)
    assert torch.isfinite(out.loss)
    assert torch.cat(out.metrics["ratio_mean"]).tolist() == pytest.approx([math.exp(20), math.exp(20), math.exp(-20)])
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    assert grad.tolist() == [0.0, 0.0, 0.0]
    assert LOG_RATIO_CLAMP == 20.0


def test_truncated_importance_weights_multiply_the_policy_term_only():
    """weight = min(exp(old - rollout), cap): 3 -> capped at 2, 0.5 kept; the KL term is not weighted."""
    tokens = ResponseTokens.from_layout(DualKVLayout((1,), ((1, 1),)))
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = logprobs.detach().clone()  # ratio 1: the policy term is -A
    rollout = old - torch.log(torch.tensor([3.0, 0.5]))
    ref = logprobs.detach() - 0.5
    advantages = torch.tensor([1.0, -2.0])
    plain = GRPOLoss(kl_coef=0.1, normalizer=1.0)
    out = dataclasses.replace(plain, tis_cap=2.0)(logprobs, old, advantages, tokens, ref, rollout)
    kl = math.exp(-0.5) + 0.5 - 1
    assert torch.cat(out.metrics["loss"]).tolist() == pytest.approx([-1.0 * 2.0 + 0.1 * kl, 2.0 * 0.5 + 0.1 * kl])
    assert torch.cat(out.metrics["rollout_mismatch"]).tolist() == pytest.approx([math.log(3.0), math.log(2.0)])
    without = plain(logprobs, old, advantages, tokens, ref, rollout)  # rollout log-probs for the metric only
    assert torch.cat(without.metrics["loss"]).tolist() == pytest.approx([-1.0 + 0.1 * kl, 2.0 + 0.1 * kl])


def test_dapo_clips_asymmetrically():
    tokens = ResponseTokens.from_layout(DualKVLayout((1,), ((2,),)))
    logprobs = torch.log(torch.tensor([1.25, 0.75]))  # ratios 1.25 and 0.75 against old log-prob 0
    old, advantages = torch.zeros(2), torch.tensor([1.0])
    dapo = DAPOLoss(clip_eps_low=0.2, clip_eps_high=0.28)(logprobs, old, advantages, tokens)
    grpo = GRPOLoss(clip_eps=0.2)(logprobs, old, advantages, tokens)
    # A > 0: only the upper bound clips; 1.25 < 1 + 0.28 stays, but 1.25 > 1 + 0.2 is clipped
    assert dapo.metrics["clip_fraction"][0].item() == 0.0 and grpo.metrics["clip_fraction"][0].item() == 0.5
    assert dapo.loss.item() == pytest.approx(-(1.25 + 0.75) / 2)
    assert grpo.loss.item() == pytest.approx(-(1.2 + 0.75) / 2)


def test_advantages_are_group_normalised():
    rewards = [torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([3.0]), torch.tensor([2.0, 2.0])]
    got = group_normalized_advantages(rewards, eps=1e-6)
    assert got.tolist() == pytest.approx(direct_advantages([r.tolist() for r in rewards], 1e-6))
    assert got[4] == 0 and got[5:].tolist() == [0.0, 0.0], "a lone response and a tie carry no signal"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t, lp, o, a: GRPOLoss()(lp[:-1], o, a, t), "logprobs must be flat over the 19 response tokens"),
        (lambda t, lp, o, a: GRPOLoss()(lp, o[:3], a, t), "old_logprobs must be flat"),
        (lambda t, lp, o, a: GRPOLoss()(lp, o, a[:2], t), r"one value per response \(6\)"),
        (lambda t, lp, o, a: GRPOLoss(kl_coef=0.1)(lp, o, a, t), "needs ref_logprobs"),
        (lambda t, lp, o, a: GRPOLoss(aggregation="sum")(lp, o, a, t), "aggregation must be one of"),
        (lambda t, lp, o, a: DAPOLoss(clip_eps_low=1.5), "clip eps must satisfy"),
        (lambda t, lp, o, a: GRPOLoss().advantages(None), "advantages need rewards"),
        (lambda t, lp, o, a: GRPOLoss(clip_ratio_c=1.0), r"GRPOLoss: clip_ratio_c \(dual clip\) must be > 1"),
        (lambda t, lp, o, a: DAPOLoss(tis_cap=0.0), r"DAPOLoss: tis_cap \(truncated importance sampling\) must be > 0"),
        (lambda t, lp, o, a: GRPOLoss(tis_cap=-1.0), "must be > 0"),
        (lambda t, lp, o, a: GRPOLoss(tis_cap=2.0)(lp, o, a, t), r"tis_cap=2.0 \(truncated importance sampling\) needs rollout_logprobs"),
        (lambda t, lp, o, a: GRPOLoss()(lp, o, a, t, None, o[:4]), "rollout_logprobs must be flat over the 19 response tokens"),
    ],
)
def test_bad_input(call, message):
    tokens, logprobs, old, _, rewards, _ = inputs()
    with pytest.raises(ValueError, match=message):
        call(tokens, logprobs, old, GRPOLoss().advantages(rewards))
