"""GRPO and DAPO losses (megatron_dualkv.rl.losses) against a direct per-response implementation."""
import math

import pytest
import torch

from megatron_dualkv import DualKVLayout
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, ResponseTokens, group_normalized_advantages

LAYOUT = DualKVLayout((4, 1, 2), ((3, 1, 5), (2,), (4, 4)), pad_len=3)


def direct_advantages(rewards, eps):
    out = []
    for group in rewards:
        n = len(group)
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1)) if n > 1 else None
        out += [0.0 if std is None else (r - mean) / (std + eps) for r in group]
    return out


def direct_loss(logprobs, old, ref, advantages, eps_low, eps_high, kl_coef, token_mean):
    """Response by response, token by token, in plain Python arithmetic on the nested lists."""
    responses = [r for group in logprobs for r in group]
    olds = [r for group in old for r in group]
    refs = [r for group in ref for r in group] if ref is not None else [None] * len(responses)
    per_response, all_tokens, metrics = [], [], {"ratio_mean": [], "clip_fraction": [], "kl": [], "loss": []}
    for lp, o, rf, a in zip(responses, olds, refs, advantages):
        token_losses, ratios, clipped, kls = [], [], [], []
        for t in range(len(lp)):
            ratio = torch.exp(lp[t] - o[t])
            surrogate = ratio * a
            clipped_surrogate = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
            loss = -torch.minimum(surrogate, clipped_surrogate)
            clipped.append(float(clipped_surrogate < surrogate))
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
        if kls:
            metrics["kl"].append(sum(kls) / len(kls))
    loss = sum(all_tokens) / len(all_tokens) if token_mean else sum(per_response) / len(per_response)
    return loss, metrics


def inputs(seed=0, spread=0.4):
    """log-probs far enough from the old ones that both clip bounds are hit."""
    tokens = ResponseTokens.from_layout(LAYOUT)
    g = torch.Generator().manual_seed(seed)
    n = tokens.num_tokens
    logprobs = (-2 + torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)
    ref = logprobs.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)
    rewards = [torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.7]), torch.tensor([0.0, 1.0])]
    return tokens, logprobs, old, ref, rewards


@pytest.mark.parametrize(
    "loss_fn",
    [
        GRPOLoss(clip_eps=0.2),
        GRPOLoss(clip_eps=0.1, kl_coef=0.05),
        GRPOLoss(clip_eps=0.2, kl_coef=0.1, aggregation="token-mean"),
        DAPOLoss(),
        DAPOLoss(clip_eps_low=0.1, clip_eps_high=0.3, kl_coef=0.02),
    ],
    ids=["grpo", "grpo-kl", "grpo-token-mean", "dapo", "dapo-kl"],
)
def test_loss_matches_a_direct_per_response_implementation(loss_fn):
    tokens, logprobs, old, ref, rewards = inputs()
    ref = ref if loss_fn.kl_coef else None
    advantages = loss_fn.advantages(rewards)
    out = loss_fn(logprobs, old, advantages, tokens, ref)

    nested = tokens.split(logprobs)
    want_adv = direct_advantages([r.tolist() for r in rewards], loss_fn.advantage_eps)
    low, high = loss_fn.clip_range
    want, metrics = direct_loss(
        nested, tokens.split(old), None if ref is None else tokens.split(ref), want_adv, low, high,
        loss_fn.kl_coef, loss_fn.aggregation == "token-mean",
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
    if ref is None:
        assert "kl" not in out.metrics
    else:
        assert flat(out.metrics["kl"]) == pytest.approx(metrics["kl"])
    assert 0 < sum(flat(out.metrics["clip_fraction"])) < tokens.num_responses, "the inputs must exercise clipping"


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
    ],
)
def test_bad_input(call, message):
    tokens, logprobs, old, _, rewards = inputs()
    with pytest.raises(ValueError, match=message):
        call(tokens, logprobs, old, GRPOLoss().advantages(rewards))
