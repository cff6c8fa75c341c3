"""Prefix trees of trajectories through the model and the RL losses, against each trajectory run
alone (the replicated layout computed independently: a plain causal forward of the model per
trajectory, its full logits, a float64 log-softmax, and the GRPO/DAPO loss written trajectory by
trajectory in test_rl_losses.direct_loss): per-trajectory log-probs and entropies, the losses and
every parameter gradient, on hypothesis-fuzzed trees (depth up to 5, branching up to 4, one-token
segments, trajectories ending inside the tree, several groups), for the dense, MoE, Gemma
(sliding window along path positions) and Qwen3.5 (Gated DeltaNet: each segment from its
parent's state) tiny models; the library's own replicated layout; bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import Trajectory, pack_trajectories, trajectory_groups
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import (
    DAPOLoss, GRPOLoss, RLMicroBatch, ResponseTokens, forward_backward, forward_logprobs, trajectory_logprobs,
)
from rollouts import device_of, max_abs_diff
from strategies import trajectory_sets
from test_rl_losses import direct_advantages, direct_loss

LOSSES = {"grpo-kl": GRPOLoss(clip_eps=0.2, kl_coef=0.05), "dapo": DAPOLoss()}
# segments from a vocabulary of 5, so that siblings often start alike and the trie merges them
TREES = trajectory_sets(max_groups=3, max_depth=5, max_branching=4, max_segment=4, max_segments=9, grouped=True)


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "qwen3_5-tiny"])
def model(request):
    # MoE: no load-balancing loss, whose token statistics differ between layouts (a shared prefix counts once)
    return build_model(request.param, moe_aux_loss_coeff=0.0)


@pytest.fixture(scope="module")
def dense():
    return build_model("qwen3-tiny")


def alone(model, trajectory):
    """float64 log-probs and entropies (L - 1,) of the trajectory as one causal sequence of its own."""
    tokens = torch.tensor(list(trajectory.tokens), device=device_of(model))
    positions = torch.arange(len(tokens), device=tokens.device)
    logits = model(tokens[None], positions[None], None)[0, :-1, : model.unpadded_vocab_size].double()
    log_softmax = torch.log_softmax(logits, -1)
    return log_softmax.gather(1, tokens[1:, None]).squeeze(1), -(log_softmax.exp() * log_softmax).sum(-1)


def trained(trajectory):
    """Positions t >= 1 whose token the trajectory trains."""
    mask = [True] * len(trajectory.tokens) if trajectory.loss_mask is None else [bool(m) for m in trajectory.loss_mask]
    return [t for t in range(1, len(mask)) if mask[t]]


def with_rewards(trajectories, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (len(trajectories),), generator=g).tolist()
    return [Trajectory(t.tokens, t.loss_mask, float(r), t.group) for t, r in zip(trajectories, rewards)]


def nested(trajectories, per_trajectory):
    """Per-trajectory values of the trained tokens, nested per group, per trajectory (ResponseTokens order)."""
    return [[per_trajectory[i] for i in members] for members in trajectory_groups(trajectories)]


def reference_step(model, trajectories, old, ref, loss_fn):
    """The loss of each trajectory alone, and its gradients: test_rl_losses.direct_loss over the
    trajectories that train a token (the sequence mean leaves the others out), with group
    advantages over every trajectory of a group."""
    groups = trajectory_groups(trajectories)
    advantages = [0.0] * len(trajectories)
    flat = direct_advantages([[trajectories[i].reward for i in m] for m in groups], loss_fn.advantage_eps)
    for i, a in zip([i for m in groups for i in m], flat):
        advantages[i] = a
    model.zero_grad(set_to_none=True)
    logprobs, entropies, keep = [], [], []
    for i, trajectory in enumerate(trajectories):
        lp, entropy = alone(model, trajectory)
        positions = torch.tensor(trained(trajectory), dtype=torch.long) - 1
        logprobs.append(lp[positions.to(lp.device)])
        entropies.append(entropy[positions.to(lp.device)].detach())
        if positions.numel():
            keep.append(i)
    low, high = loss_fn.clip_range
    kl_coef = loss_fn.kl_coef
    if keep:
        loss, _ = direct_loss([[logprobs[i] for i in keep]], [[old[i].double() for i in keep]],
                              [[ref[i].double() for i in keep]] if kl_coef else None, [advantages[i] for i in keep],
                              low, high, kl_coef, loss_fn.aggregation == "token-mean")
    else:  # nothing trained: a zero loss, zero gradients
        loss = sum(lp.sum() for lp in logprobs) * 0.0
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, [x.detach() for x in logprobs], entropies


def packed_step(model, trajectories, old, ref, loss_fn, layout="packed"):
    batch = pack_trajectories(trajectories, pad_to_multiple_of=8)
    model.zero_grad(set_to_none=True)
    (out,) = forward_backward(model, [RLMicroBatch(batch, nested(trajectories, old), nested(trajectories, ref))],
                              loss_fn, layout=layout, with_entropy=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def behaviour(model, trajectories, seed):
    """Behaviour and reference log-probs of the trained tokens near the model's own."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        own = [alone(model, t)[0].float().cpu() for t in trajectories]
    pick = [x[torch.tensor(trained(t), dtype=torch.long) - 1] for x, t in zip(own, trajectories)]
    return ([x + 0.3 * torch.randn(x.shape, generator=g) for x in pick],
            [x + 0.1 * torch.randn(x.shape, generator=g) for x in pick])


@pytest.mark.parametrize("loss_name", list(LOSSES))
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_losses_and_gradients_on_trees_are_those_of_each_trajectory_alone(model, loss_name, data):
    loss_fn = LOSSES[loss_name]
    trajectories = with_rewards(data.draw(TREES), data.draw(st.integers(0, 99)))
    old, ref = behaviour(model, trajectories, seed=1)
    out, grads = packed_step(model, trajectories, old, ref, loss_fn)
    want_loss, want_grads, want_logprobs, want_entropies = reference_step(model, trajectories, old, ref, loss_fn)
    assert max_abs_diff(out.logprobs, nested(trajectories, want_logprobs)) < 2e-6
    assert max_abs_diff(out.entropy, nested(trajectories, want_entropies)) < 2e-6
    torch.testing.assert_close(out.loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name].to(grad.dtype), rtol=1e-4, atol=1e-6, msg=name)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trajectories=trajectory_sets(max_segments=9))
def test_trajectory_logprobs_are_those_of_each_trajectory_alone(dense, trajectories):
    """Every token t >= 1 of every trajectory, whatever its loss mask; shared tokens computed once."""
    batch = pack_trajectories(trajectories, pad_to_multiple_of=4)
    with torch.no_grad():
        got = trajectory_logprobs(dense, batch)
        want = [alone(dense, t)[0] for t in trajectories]
    assert [x.shape for x in got] == [(len(t.tokens) - 1,) for t in trajectories]
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=0, atol=2e-6)
    tokens = ResponseTokens.of(batch)
    assert tokens.num_predictions == len({int(i) for i in tokens.token_index}) <= batch.num_tokens


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_the_replicated_layout_gives_the_packed_results(dense, loss_name):
    """forward_backward(layout="replicated"): each trajectory its own sequence through the same model."""
    trajectories = with_rewards(TRAJECTORIES, seed=3)
    old, ref = behaviour(dense, trajectories, seed=2)
    packed, packed_grads = packed_step(dense, trajectories, old, ref, LOSSES[loss_name])
    replicated, replicated_grads = packed_step(dense, trajectories, old, ref, LOSSES[loss_name], layout="replicated")
    assert max_abs_diff(packed.logprobs, replicated.logprobs) < 2e-6
    assert max_abs_diff(packed.entropy, replicated.entropy) < 2e-6
    torch.testing.assert_close(packed.loss, replicated.loss, rtol=1e-5, atol=1e-6)
    for name in packed.metrics:
        torch.testing.assert_close(torch.cat(packed.metrics[name]), torch.cat(replicated.metrics[name]))
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, replicated_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        batch = pack_trajectories(trajectories)
        for x, y in zip(trajectory_logprobs(dense, batch), trajectory_logprobs(dense, batch, "replicated")):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-6)


# two groups; in group "a" an episode's turns shared by pairs, one trajectory a prefix of another,
# one with no trained token; group "b" a single trajectory (advantage 0)
TRAJECTORIES = [
    Trajectory([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 0], group="a"),
    Trajectory([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 0, 1, 1], group="a"),
    Trajectory([1, 2, 3, 9, 9], [0, 0, 0, 1, 1], group="a"),
    Trajectory([1, 2, 3, 4], [0, 0, 0, 1], group="a"),
    Trajectory([1, 2, 3], [1, 0, 0], group="a"),
    Trajectory([7, 7, 8], group="b"),
]


def test_a_shared_token_counts_once_per_trajectory_that_trains_it(dense):
    """The index of the trees: one prediction row per distinct packed token, one loss term per
    trajectory that trains it, the sequence mean over the trajectories that train a token."""
    trajectories = with_rewards(TRAJECTORIES, seed=0)
    batch = pack_trajectories(trajectories)
    tokens = ResponseTokens.of(batch)
    assert tokens.response_lens == ((2, 4, 2, 1, 0), (2,))
    assert tokens.num_tokens == 11 and tokens.num_trained_responses == 5
    # trained tokens 4 and 5 of the first two trajectories, 4 of the fourth, are the same packed tokens
    assert tokens.num_predictions == 11 - 3
    assert torch.equal(tokens.expand(tokens.distinct(tokens.token_index)), tokens.token_index)
    assert tokens.trajectory_of.tolist() == [0, 1, 2, 3, 4, 5]
    old, ref = behaviour(dense, trajectories, seed=4)
    for loss_fn in LOSSES.values():
        out, _ = packed_step(dense, trajectories, old, ref, loss_fn)
        want_loss, _, _, _ = reference_step(dense, trajectories, old, ref, loss_fn)
        torch.testing.assert_close(out.loss.double(), want_loss, rtol=1e-5, atol=1e-6)
        assert [x.numel() for x in out.logprobs[0]] == [2, 4, 2, 1, 0]


def test_logprobs_of_trees_follow_group_order(dense):
    """forward_logprobs nests per group (first occurrence), per trajectory in input order, its
    trained tokens; trajectory_logprobs has every token t >= 1 of each trajectory, in input order."""
    trajectories = [Trajectory([1, 2, 3], group=1), Trajectory([4, 5], group=0), Trajectory([1, 2, 6], [1, 1, 0], group=1)]
    batch = pack_trajectories(trajectories)
    with torch.no_grad():
        got = forward_logprobs(dense, batch)
        full = trajectory_logprobs(dense, batch)
    assert [[x.numel() for x in group] for group in got] == [[2, 1], [1]] and [x.numel() for x in full] == [2, 1, 2]
    torch.testing.assert_close(got[0][1], full[2][:1])
    torch.testing.assert_close(got[1][0], full[1])
    assert ResponseTokens.of(batch).trajectory_of.tolist() == [0, 2, 1]


def test_bad_input_names_the_trajectory(dense):
    batch = pack_trajectories([Trajectory([1, 2]), Trajectory([3, 300, 4]), Trajectory([5, 300])])
    with pytest.raises(ValueError, match=r"trajectory 1: token id 300 is outside the model.s vocabulary of 256"):
        forward_logprobs(dense, batch)
    with pytest.raises(ValueError, match=r"trajectory 1: empty tokens"):
        pack_trajectories([Trajectory([1, 2]), Trajectory([])])
    with pytest.raises(ValueError, match=r"trajectory 0: loss_mask has shape \(2,\), expected \(3,\)"):
        pack_trajectories([Trajectory([1, 2, 3], [1, 1])])
    with pytest.raises(ValueError, match="trajectory_logprobs takes a TrajectoryBatch"):
        trajectory_logprobs(dense, batch.replicated())
