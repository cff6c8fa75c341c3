"""Prefix reuse (rl.prefix_reuse): a group split into response micro-batches that share one prompt
forward and backward gives the one-micro-batch step's log-probs, losses and gradients, at float64
on the CPU, through Megatron's schedule."""
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dualkv import Trajectory, held_path_len, pack_groups, pack_trajectories, plan_micro_batches
from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.mcore.gated_delta_net import DualKVGatedDeltaNet
from megatron_dualkv.models import build_model
from megatron_dualkv.rl.prefix_reuse import prefix_reuse_part
from megatron_dualkv.rl import (DAPOLoss, GRPOLoss, PrefixReuseBatch, ResponseTokens, RLMicroBatch, forward_backward,
                                forward_logprobs, pack_prefix_reuse, pack_prefix_reuse_trajectories)
from rollouts import make_groups, perturbed
from strategies import trajectory_sets

SHAPE = (11, [5, 1, 7, 3, 4])
PARTS = [[0, 1], [2], [3, 4]]


# exact MoE comparison: no load-balancing loss, whose token statistics are per micro-batch; its
# grouped expert matmuls have no float64 kernel on the CPU, so it runs at float32
MODELS = [("qwen3-tiny", None), ("qwen3-tiny", "selective"), ("qwen3-tiny", "full"), ("qwen3-moe-tiny", None),
          ("gemma3-tiny", None), ("qwen3_5-tiny", None), ("qwen3_5-tiny", "selective"), ("qwen3_5-tiny", "full")]


def float64_model(card, recompute=None):
    model = build_model(card, recompute=recompute, moe_aux_loss_coeff=0.0)
    return model if "moe" in card else model.double()


@pytest.fixture(scope="module")
def model():
    return float64_model("qwen3-tiny")


def whole_and_parts(model, parts, pad=1, seed=0, shape=SHAPE):
    """The group as one RLMicroBatch and as prefix-reuse parts, with the same old / reference
    log-probs and the whole group's advantages."""
    group = make_groups([shape], seed=seed)[0]
    batch = pack_groups([group], pad_to_multiple_of=pad)
    with torch.no_grad():
        current = forward_logprobs(model, batch)
    old, ref = perturbed(current, 0.3, seed), perturbed(current, 0.1, seed + 10)
    advantages = GRPOLoss().advantages(batch.rewards)
    whole = RLMicroBatch(batch, old, ref, advantages=advantages)
    pieces = pack_prefix_reuse(group, parts, pad_to_multiple_of=pad)
    split = [RLMicroBatch(piece, [[old[0][i] for i in part]], [[ref[0][i] for i in part]], advantages=advantages[part])
             for piece, part in zip(pieces, parts)]
    return whole, split


def step(model, micro_batches, loss_fn):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, micro_batches, loss_fn, with_entropy=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


def tolerance(model):
    """float64 rounding, unless the model is float32 (MoE) or computes part of a layer in float32 as
    transformers does (a Gated DeltaNet's gates and gated norm), where float64 rounding differences
    upstream come out as float32 ones."""
    if next(model.parameters()).dtype != torch.float64:
        return dict(rtol=1e-4, atol=1e-6)
    if any(isinstance(module, DualKVGatedDeltaNet) for module in model.modules()):
        return dict(rtol=1e-6, atol=1e-7)
    return dict(rtol=1e-10, atol=1e-12)


def assert_equal_steps(model, loss, parts, pad=1, float32_norms=False, shape=SHAPE):
    """``float32_norms``: norms computed in float32 whatever the model's dtype (Gemma's), so their
    weights' gradients sum float32 terms in another order."""
    tol = tolerance(model)
    whole, split = whole_and_parts(model, parts, pad, shape=shape)
    responses, tokens = len(shape[1]), sum(shape[1])
    count = responses if loss == "grpo" else tokens
    make = (lambda n: GRPOLoss(clip_eps=0.2, kl_coef=0.05, normalizer=n)) if loss == "grpo" else (
        lambda n: DAPOLoss(normalizer=n))
    (one,), one_grads = step(model, [whole], make(count))
    outputs, grads = step(model, split, make(count / len(parts)))
    for out, part in zip(outputs, parts):
        for got, i in zip(out.logprobs[0], part):
            torch.testing.assert_close(got, one.logprobs[0][i], **tol)
        for got, i in zip(out.entropy[0], part):
            torch.testing.assert_close(got, one.entropy[0][i], **tol)
    # the schedule averages the parts' losses
    torch.testing.assert_close(sum(out.loss for out in outputs) / len(parts), one.loss, **tol)
    assert grads.keys() == one_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        norm = float32_norms and "norm" in name
        torch.testing.assert_close(grad, one_grads[name], **(dict(rtol=1e-6, atol=1e-8) if norm else tol), msg=name)


@pytest.mark.parametrize("card, recompute", MODELS, ids=[f"{c}-{r or 'no recompute'}" for c, r in MODELS])
def test_prefix_reuse_equals_one_micro_batch(card, recompute):
    assert_equal_steps(float64_model(card, recompute), "grpo", PARTS, float32_norms="gemma" in card)


@pytest.mark.parametrize("parts", [[[4, 2, 0, 1, 3]], [[3], [0, 4], [2], [1]]], ids=["1 part", "4 parts"])
def test_token_mean_loss_and_padded_parts(model, parts):
    assert_equal_steps(model, "dapo", parts, pad=8)


@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3_5-tiny"])
def test_forward_only_logprobs(model, card):
    model = model if card == "qwen3-tiny" else float64_model(card)
    whole, split = whole_and_parts(model, PARTS)
    one = forward_backward(model, [RLMicroBatch(whole.batch)])[0]
    outputs = forward_backward(model, [RLMicroBatch(mb.batch) for mb in split])
    for out, part in zip(outputs, PARTS):
        assert not out.logprobs[0][0].requires_grad
        torch.testing.assert_close(torch.cat(out.logprobs[0]), torch.cat([one.logprobs[0][i] for i in part]),
                                   rtol=0, atol=tolerance(model)["atol"])
    assert split[0].batch.prompt.held is None and all(p.grad is None for p in model.parameters())


def test_a_prompt_shorter_than_the_conv_window():
    """Two prompt tokens: each GDN layer holds two conv inputs, and a part's windows read zeros before
    them, as packed after the prompt."""
    assert_equal_steps(float64_model("qwen3_5-tiny"), "grpo", PARTS, shape=(2, SHAPE[1]))


def test_megatron_ddp_reduces_once_after_the_prompt_backward():
    """Megatron DDP (grads in its buffer, no_sync over all but the last micro-batch, the reduce in
    finalize_model_grads): the same main_grad as the one-micro-batch step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model = build_model("qwen3-tiny", seed=5)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    whole, split = whole_and_parts(ddp, PARTS)
    grads = []
    for micro_batches in ([whole], split):
        ddp.zero_grad_buffer()
        forward_backward(ddp, micro_batches, GRPOLoss(normalizer=len(SHAPE[1]) / len(micro_batches)))
        grads.append({name: p.main_grad.clone() for name, p in ddp.module.named_parameters()})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().max() > 0 for g in grads[0].values())


def test_unsupported_combinations_are_named(model, monkeypatch):
    from megatron.core import parallel_state

    _, split = whole_and_parts(model, PARTS)
    with pytest.raises(ValueError, match="prefix reuse .* does not support the replicated layout"):
        forward_backward(model, split, GRPOLoss(), layout="replicated")
    with monkeypatch.context() as patch:  # named before the interleaved schedule pads the micro-batches
        patch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
        with pytest.raises(ValueError, match=r"does not support the interleaved pipeline schedule \(virtual pipeline"):
            forward_backward(model, split, GRPOLoss())
    with pytest.raises(ValueError, match="part 1 runs before its prompt's first part"):
        forward_backward(model, split[1:], GRPOLoss())
    with pytest.raises(ValueError, match=r"parts \[\[0\], \[0, 1\]\] must split the group's responses \(5\)"):
        pack_prefix_reuse(make_groups([SHAPE])[0], [[0], [0, 1]])
    model.zero_grad(set_to_none=True)


PLAN_SHAPES = [(3, [2, 4]), (17, [5, 1, 7, 3, 4, 2]), (2, [1]), (9, [3, 3])]


def test_plan_runs_a_long_group_with_prefix_reuse():
    groups = make_groups(PLAN_SHAPES, seed=4)
    for dp_size in (1, 2, 3):
        plan = plan_micro_batches(groups, 28, dp_size, prefix_reuse=True)
        # parts spread over ranks each compute the prompt there
        sub_groups = plan_micro_batches(groups, 28, dp_size).packed_tokens
        assert plan.packed_tokens < sub_groups if dp_size == 1 else plan.packed_tokens <= sub_groups
        for rank in plan.ranks:
            shared = [mb for mb in rank if mb.shared_prompt is not None]
            assert all(mb.source_groups == (1,) for mb in shared)
            # one prompt per rank, its parts one after the other, in order
            assert len({id(mb.shared_prompt) for mb in shared}) <= 1
            first = next((i for i, mb in enumerate(rank) if mb.shared_prompt is not None), 0)
            assert [mb.part for mb in rank[first : first + len(shared)]] == list(range(len(shared)))
            assert all(mb.shared_prompt.num_parts == len(shared) for mb in shared)
        responses = sorted(i for rank in plan.ranks for mb in rank if mb.shared_prompt is not None
                           for i in mb.source_responses[0])
        assert responses == list(range(len(PLAN_SHAPES[1][1])))


def test_planned_prefix_reuse_step_equals_the_sub_group_step(model):
    """The plan with prefix reuse and today's sub-groups: the same losses' sum and gradients."""
    groups = make_groups(PLAN_SHAPES, seed=4)
    advantages = GRPOLoss().advantages([torch.tensor(g.rewards) for g in groups])
    results = []
    for prefix_reuse in (False, True):
        plan = plan_micro_batches(groups, 28, prefix_reuse=prefix_reuse)
        loss_fn = GRPOLoss(normalizer=plan.loss_normalizer("sequence-mean"))
        micro_batches = [RLMicroBatch(mb.pack(8), advantages=mb.select_responses(advantages), on_policy=True)
                         for mb in plan.ranks[0]]
        outputs, grads = step(model, micro_batches, loss_fn)
        results.append((sum(out.loss for out in outputs) / len(outputs), grads))
    assert any(isinstance(mb.batch, PrefixReuseBatch) for mb in micro_batches)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-14)
    for name, grad in results[1][1].items():
        torch.testing.assert_close(grad, results[0][1][name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("mode, rows", [("none", 2), ("selective", 3), ("full", 4)])
def test_memory_model_counts_the_held_prompt(mode, rows):
    """Per layer: the held K/V's accumulated gradients, and the copies the layer does not keep."""
    from megatron_dualkv.memory import MemoryModel

    memory = MemoryModel.for_card("qwen3-tiny", dtype=torch.bfloat16)
    config = memory.config
    per_row = config.num_layers * config.num_query_groups * config.kv_channels * 2 * 100
    estimate = memory.predict(160, recompute=mode, held_prompt_tokens=100)
    assert estimate.parts["held prompt"] == rows * per_row
    assert estimate.total == memory.predict(160, recompute=mode).total + rows * per_row
    # a pipeline stage holds its own layers' K/V, and the prompt's activations once however many of
    # its parts are in flight (2 on the first of two stages, 60 tokens each)
    staged = MemoryModel.for_card("qwen3-tiny", ParallelSizes(pp=2), dtype=torch.bfloat16)
    assert [staged.held_prompt_bytes(100, mode, pp_rank=rank) for rank in (0, 1)] == [rows * per_row / 2] * 2
    per_token = staged.activation_bytes_per_token(mode)
    assert staged.in_flight_micro_batches(4) == 2
    held = staged.predict(160, recompute=mode, num_micro_batches=4, held_prompt_tokens=100)
    assert held.parts["activations"] == per_token * (100 + 2 * 60)
    gemma = MemoryModel.for_card("gemma4-tiny", dtype=torch.bfloat16)  # full-attention layers: their own K/V shape
    layers = [gemma.config.for_layer(n) for n in range(1, gemma.config.num_layers + 1)]
    assert len({(layer.num_query_groups, layer.kv_channels) for layer in layers}) == 2
    assert gemma.held_prompt_bytes(100, mode) == rows * 2 * 100 * sum(l.num_query_groups * l.kv_channels for l in layers)


def test_memory_model_counts_a_gated_deltanet_layer_s_held_state():
    """A GDN layer holds its prompt's final state (fp32) and last K-1 conv inputs, with their
    gradients, whatever the prompt's length; the attention layers their K/V rows."""
    from megatron_dualkv.memory import MemoryModel

    memory = MemoryModel.for_card("qwen3_5-tiny", dtype=torch.bfloat16)
    c = memory.config
    kinds = list(c.layer_types)
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    gdn = kinds.count("linear_attention") * 2 * (state + (c.linear_conv_kernel_dim - 1) * conv * 2)
    kv_row = kinds.count("full_attention") * c.num_query_groups * c.kv_channels * 2
    for tokens in (100, 1000):
        assert memory.held_prompt_bytes(tokens, "none") == gdn + 2 * kv_row * tokens


def test_memory_model_counts_a_context_parallel_rank_s_held_heads():
    """Ulysses CP: a rank holds every prompt row of its heads after the all-to-all, a replicated
    copy of the one KV head where cp does not divide the KV heads (``ulysses_attention``)."""
    from megatron_dualkv.memory import MemoryModel

    def held(cp, **overrides):
        return MemoryModel.for_card("qwen3-tiny", ParallelSizes(cp=cp), **overrides).held_prompt_bytes(100, "none")

    assert held(2) * 2 == held(1)
    assert held(2, num_query_groups=1) == held(1, num_query_groups=1)
    # a GDN layer's state and conv tail, of its key heads' share (two key heads: one each)
    hybrid = [MemoryModel.for_card("qwen3_5-tiny", ParallelSizes(cp=cp)).held_prompt_bytes(100, "none") for cp in (1, 2)]
    assert hybrid[1] * 2 == hybrid[0]


def test_a_layer_that_holds_nothing_is_named(monkeypatch):
    """An attention layer whose core attention is not DualKV attention holds no K/V."""
    from megatron_dualkv.mcore import attention

    model = build_model("qwen3_5-tiny")
    monkeypatch.setattr(attention.DualKVAttention, "forward", _attention_without_held_prompt(attention.DualKVAttention.forward))
    _, split = whole_and_parts(model, PARTS)
    with pytest.raises(ValueError, match=r"3 of 4 layers held their prompt's K/V or state; it needs DualKVAttention"):
        forward_backward(model, split, GRPOLoss())
    model.zero_grad(set_to_none=True)


def _attention_without_held_prompt(forward):
    def without(self, *args, packed_seq_params=None, **kwargs):
        return forward(self, *args, packed_seq_params=replace(packed_seq_params, held_prompt=None), **kwargs)
    return without


def make_tree(seed=0, vocab=256):
    """One tree of trajectories: an untrained 6-token prompt, then branches at several depths,
    trained turns with masked tool tokens, odd lengths; one trajectory ends inside another."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt, turn, tool, a, b = ids(6), ids(3), ids(2), ids(5), ids(1)
    paths = [
        (prompt + turn + tool + a, [0] * 6 + [1] * 3 + [0] * 2 + [1] * 5),
        (prompt + turn + tool + b + ids(4), [0] * 6 + [1] * 3 + [0] * 2 + [1] * 5),
        (prompt + turn + ids(7), [0] * 6 + [1] * 10),
        (prompt + ids(1), [0] * 6 + [1]),
        (prompt + turn + tool + a[:3], [0] * 6 + [1] * 3 + [0, 0] + [1] * 3),
        (prompt + ids(2) + tool + ids(3), [0] * 6 + [1, 1, 0, 0, 1, 1, 1]),
    ]
    rewards = torch.rand(len(paths), generator=g).round(decimals=1).tolist()
    return [Trajectory(tokens, mask, reward, "tree") for (tokens, mask), reward in zip(paths, rewards)]


TREE_PARTS = [[0, 1, 4], [2], [3, 5]]


def tree_whole_and_parts(model, trajectories, parts, pad=1, seed=0):
    """The tree as one RLMicroBatch and as prefix-reuse parts (``whole_and_parts`` for trees)."""
    batch = pack_trajectories(trajectories, pad_to_multiple_of=pad)
    with torch.no_grad():
        current = forward_logprobs(model, batch)
    old, ref = perturbed(current, 0.3, seed), perturbed(current, 0.1, seed + 10)
    advantages = GRPOLoss().advantages(ResponseTokens.of(batch).group_rewards(batch))
    whole = RLMicroBatch(batch, old, ref, advantages=advantages)
    pieces = pack_prefix_reuse_trajectories(trajectories, parts, pad_to_multiple_of=pad)
    split = [RLMicroBatch(piece, [[old[0][i] for i in part]], [[ref[0][i] for i in part]], advantages=advantages[part])
             for piece, part in zip(pieces, parts)]
    return whole, split


def assert_equal_tree_steps(model, trajectories, parts, pad=1):
    tol = tolerance(model)
    whole, split = tree_whole_and_parts(model, trajectories, parts, pad)
    count = len(trajectories)
    (one,), one_grads = step(model, [whole], GRPOLoss(clip_eps=0.2, kl_coef=0.05, normalizer=count))
    outputs, grads = step(model, split, GRPOLoss(clip_eps=0.2, kl_coef=0.05, normalizer=count / len(parts)))
    for out, part in zip(outputs, parts):
        for name in ("logprobs", "entropy"):
            for got, i in zip(getattr(out, name)[0], part):
                torch.testing.assert_close(got, getattr(one, name)[0][i], **tol)
    torch.testing.assert_close(sum(out.loss for out in outputs) / len(parts), one.loss, **tol)
    assert grads.keys() == one_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], **tol, msg=name)


@pytest.mark.parametrize("card, recompute", [("qwen3-tiny", None), ("qwen3-tiny", "full"), ("qwen3_5-tiny", None)],
                         ids=["no recompute", "full recompute", "qwen3_5-tiny"])
def test_prefix_reuse_of_a_split_tree_equals_one_micro_batch(model, card, recompute):
    """On the hybrid card each part's segments also start from the held path's GDN state and conv
    tail, and the deeper ones from their parents' inside the part."""
    trajectories = make_tree()
    assert held_path_len(trajectories) == 6
    pieces = pack_prefix_reuse_trajectories(trajectories, TREE_PARTS, pad_to_multiple_of=8)
    assert [piece.layout.is_tree for piece in pieces] == [True, False, False]
    model = model if (card, recompute) == ("qwen3-tiny", None) else float64_model(card, recompute)
    assert_equal_tree_steps(model, trajectories, TREE_PARTS, pad=8)


@st.composite
def split_trees(draw):
    """(a tree's trajectories, each training its last token, with a held path; parts of them)."""
    trajectories = draw(trajectory_sets(grouped=False, max_segment=4, max_segments=6, vocab=7))
    first = trajectories[0].tokens[0]
    tree = [t for t in trajectories if t.tokens[0] == first and len(t.tokens) > 1]
    assume(tree)
    tree = [replace(t, loss_mask=[*(t.loss_mask or [False] * len(t.tokens))[:-1], True], reward=float(i % 3))
            for i, t in enumerate(tree)]
    labels = draw(st.lists(st.integers(0, 2), min_size=len(tree), max_size=len(tree)))
    parts = [[i for i, label in enumerate(labels) if label == part] for part in sorted(set(labels))]
    return tree, parts


@given(split_trees(), st.sampled_from([1, 8]))
@settings(max_examples=4, deadline=None)
def test_prefix_reuse_of_drawn_trees_equals_one_micro_batch(model, tree_and_parts, pad):
    assert_equal_tree_steps(model, *tree_and_parts, pad=pad)


def test_trees_without_a_held_path_are_named():
    with pytest.raises(ValueError, match="share no path to hold: a trajectory of one token"):
        pack_prefix_reuse_trajectories([Trajectory([1, 2, 3]), Trajectory([1])], [[0], [1]])
    with pytest.raises(ValueError, match=r"must be one prefix tree \(one group, one first token\)"):
        pack_prefix_reuse_trajectories([Trajectory([1, 2, 3]), Trajectory([2, 2])], [[0, 1]])
    with pytest.raises(ValueError, match=r"parts \[\[0\]\] must split the trajectories \(2\)"):
        pack_prefix_reuse_trajectories([Trajectory([1, 2, 3]), Trajectory([1, 2])], [[0]])
    tree = make_tree()
    shared = pack_prefix_reuse_trajectories(tree, [[0, 1, 2, 3, 4, 5]])[0].prompt
    first = tree[0]
    for bad in (replace(first, tokens=first.tokens[:6], loss_mask=None),  # nothing after the path
                replace(first, loss_mask=[0, 0, 1] + first.loss_mask[3:]),  # trains inside it
                replace(first, tokens=[first.tokens[0] + 1] + first.tokens[1:])):  # another path
        with pytest.raises(ValueError, match="trajectory 1 of part 2 does not start with the held path of 6 tokens"):
            prefix_reuse_part(shared, 2, [tree[1], bad])
    # the path ends where a trajectory first trains a token, and before every trajectory's last token
    assert held_path_len([Trajectory([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), Trajectory([1, 2, 3, 4, 6])]) == 1
    assert held_path_len([Trajectory([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), Trajectory([1, 2, 3, 4], [0, 0, 0, 1])]) == 3
    assert held_path_len([Trajectory([1, 2, 3, 4, 5], [0, 0, 0, 0, 1]), Trajectory([1, 2, 3], [0, 0, 1])]) == 2


def planned_tree_trajectories():
    """Two trees of one group (the second small) and a tree of another group."""
    tree = make_tree()
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    small = [Trajectory([tree[0].tokens[0] + 1] + ids(4), None, 0.5, "tree"),
             Trajectory([tree[0].tokens[0] + 1] + ids(2), None, 1.0, "tree")]
    other = [Trajectory(ids(9), [0] * 4 + [1] * 5, 0.0, "other"), Trajectory(ids(3), None, 1.0, "other")]
    return tree[:3] + small + tree[3:] + other


def test_plan_runs_a_split_tree_with_prefix_reuse():
    trajectories = planned_tree_trajectories()
    for dp_size in (1, 2):
        plan = plan_micro_batches(trajectories, 20, dp_size, prefix_reuse=True)
        carried = plan_micro_batches(trajectories, 20, dp_size).packed_tokens
        # parts spread over ranks each compute the held path there
        assert plan.packed_tokens < carried if dp_size == 1 else plan.packed_tokens <= carried
        for rank in plan.ranks:
            shared = [mb for mb in rank if mb.shared_prompt is not None]
            assert len({id(mb.shared_prompt) for mb in shared}) <= 1
            first = next((i for i, mb in enumerate(rank) if mb.shared_prompt is not None), 0)
            assert [mb.part for mb in rank[first : first + len(shared)]] == list(range(len(shared)))
            assert all(len(mb.shared_prompt.tokens) == 6 and mb.shared_prompt.num_parts == len(shared) for mb in shared)
            assert all(mb.num_tokens <= 20 for mb in rank)
        assert sorted(i for rank in plan.ranks for mb in rank if mb.shared_prompt is not None
                      for i in mb.source_responses[0]) == [0, 1, 2, 5, 6, 7]
    # no path to hold (a trajectory of the tree's first token alone): parts carry their paths
    pathless = trajectories + [Trajectory(trajectories[0].tokens[:1], None, 0.0, "tree")]
    plan = plan_micro_batches(pathless, 20, prefix_reuse=True)
    assert all(mb.shared_prompt is None for rank in plan.ranks for mb in rank)
    assert plan.packed_tokens == plan_micro_batches(pathless, 20).packed_tokens


def test_planned_tree_step_equals_the_one_micro_batch_step(model):
    """A plan whose split tree runs with prefix reuse: the one-micro-batch step's losses and gradients."""
    trajectories = planned_tree_trajectories()
    batch = pack_trajectories(trajectories)
    advantages = GRPOLoss().advantages(ResponseTokens.of(batch).group_rewards(batch))
    results = []
    for max_tokens in (None, 20):
        plan = plan_micro_batches(trajectories, max_tokens or batch.num_tokens, prefix_reuse=True)
        loss_fn = GRPOLoss(normalizer=plan.loss_normalizer("sequence-mean"))
        micro_batches = [RLMicroBatch(mb.pack(8), advantages=mb.select_responses(advantages), on_policy=True)
                         for mb in plan.ranks[0]]
        outputs, grads = step(model, micro_batches, loss_fn)
        results.append((sum(out.loss for out in outputs) / len(outputs), grads))
    assert sum(isinstance(mb.batch, PrefixReuseBatch) for mb in micro_batches) > 1
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-14)
    for name, grad in results[1][1].items():
        torch.testing.assert_close(grad, results[0][1][name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("card, recompute", [("qwen3-tiny", None), ("qwen3-tiny", "selective"), ("qwen3-tiny", "full"),
                                             ("qwen3_5-tiny", "selective")])
def test_prompt_activations_on_the_host_give_the_same_step(monkeypatch, card, recompute):
    """``prefix_reuse_prompt_on_host``: the prompt's forward saves into the host stash (the parts'
    forwards do not), parameters stay where they are, and the step is still the one-micro-batch step
    (on the hybrid card, with the GDN layers' held state and tail on the GPU beside it)."""
    from megatron_dualkv.rl import prefix_reuse
    from megatron_dualkv.rl.host_stash import HostStash

    stash, packed = HostStash(pin=False, slab_bytes=4096), []
    real = stash._pack
    monkeypatch.setattr(stash, "_pack", lambda t: packed.append(t) or real(t))
    monkeypatch.setattr(prefix_reuse, "host_stash", lambda: stash)
    model = build_model(card, recompute=recompute, prefix_reuse_prompt_on_host=True).double()
    assert_equal_steps(model, "grpo", PARTS)
    params = [t for t in packed if isinstance(t, torch.nn.Parameter)]
    assert len(params) < len(packed) and len(stash.slabs) > 1
    assert params and all(real(p) is p for p in params)


def test_the_prompt_backward_drops_the_held_copies_and_each_gradient_once_used(model, monkeypatch):
    """The prompt's backward starts without the held K/V (read no more) and frees each layer's
    accumulated gradient as that layer's backward adds it: what the memory model's backward phase
    counts."""
    from megatron_dualkv.rl import prefix_reuse

    seen, real = [], prefix_reuse.HeldPrompt.add_held_gradients

    def spy(self, layer, dk, dv):
        seen.append((layer, len(self.kv), len(self.grads)))
        return real(self, layer, dk, dv)

    monkeypatch.setattr(prefix_reuse.HeldPrompt, "add_held_gradients", spy)
    _, split = whole_and_parts(model, PARTS)
    step(model, split, GRPOLoss(clip_eps=0.2, kl_coef=0.05))
    layers = model.config.num_layers
    assert seen == [(layer, 0, layer) for layer in range(layers, 0, -1)]


@pytest.mark.parametrize("recompute, on_host", [(None, False), ("selective", True)])
def test_the_prompt_backward_frees_the_held_copies_the_last_part_still_references(monkeypatch, recompute, on_host):
    """The last part's graph (alive until its backward call, which runs the prompt's, ends) references
    the held leaves: the prompt's backward frees the storage of the copies and drops every .grad
    there, and leaves the views (of what the prompt's backward reads) whole."""
    from megatron_dualkv.rl import prefix_reuse
    from megatron_dualkv.rl.host_stash import HostStash

    monkeypatch.setattr(prefix_reuse, "host_stash", lambda: HostStash(pin=False, slab_bytes=4096))
    model = build_model("qwen3-tiny", recompute=recompute, prefix_reuse_prompt_on_host=on_host).double()
    held, real = [], prefix_reuse.HeldPrompt.backward

    def spy(self):
        held.append([(t, t._base is None) for pair in self.kv.values() for t in pair])  # a view has a base
        real(self)

    monkeypatch.setattr(prefix_reuse.HeldPrompt, "backward", spy)
    _, split = whole_and_parts(model, PARTS)
    step(model, split, GRPOLoss(clip_eps=0.2, kl_coef=0.05))
    (tensors,) = held
    assert all(copied == on_host for _, copied in tensors)  # a layer that keeps its k/v holds views
    assert all(t.grad is None for t, _ in tensors)
    assert all((t.numel() == 0) == copied for t, copied in tensors)


def test_memory_model_with_the_prompt_on_the_host():
    """The larger of two phases: a part beside the held K/V and their gradients (4 rows a layer), or
    the prompt's backward at its length beside the gradients alone (2 rows); the prompt's saved
    activations count on the host, and a setting whose host share is over budget does not fit."""
    from megatron_dualkv.memory import MemoryModel, layer_activation_bytes

    memory = MemoryModel.for_card("qwen3-tiny", dtype=torch.bfloat16)
    config = memory.config
    per_row = config.num_layers * config.num_query_groups * config.kv_channels * 2 * 1000
    on_host = memory.predict(1060, 60, recompute="full", held_prompt_tokens=1000, prompt_on_host=True)
    assert on_host.host == memory.activation_bytes_per_token("full") * 1000
    # selective recompute saves nothing on the host: its consumers' copies are there
    selective = dict(held_prompt_tokens=1000, prompt_on_host=True, recompute="selective")
    assert memory.predict(1060, 60, **selective).host == memory.activation_bytes_per_token("none") * 1000
    layer_none = memory.activation_bytes_per_token("none") / config.num_layers
    layer_full = memory.activation_bytes_per_token("full") / config.num_layers
    assert memory.predict(1060, 60, **selective, recompute_layers=1).host == pytest.approx(
        (layer_full + (config.num_layers - 1) * layer_none) * 1000)
    # here the prompt's backward is the larger phase: one layer at the prompt's length, its
    # no-recompute activations (back from the host, or recomputed) and its backward's working set
    widest = max(layer_activation_bytes(config, n, memory.sizes, "none") for n in range(1, config.num_layers + 1))
    assert on_host.parts == {**memory.static_parts(), "activations": widest * 1000,
                             "transient": memory.transient_bytes(1000, 1, "none", None), "held prompt": 2 * per_row}
    part_alone = memory.predict(60, 60, recompute="full")
    assert on_host.total >= part_alone.total + 4 * per_row
    resident = memory.predict(1060, 60, recompute="none", held_prompt_tokens=1000)
    assert memory.predict(1060, 60, recompute="none", held_prompt_tokens=1000, prompt_on_host=True).total < resident.total
    fits = dict(budget_bytes=on_host.total, min_tokens=1060, predicting_fraction=60 / 1060, recompute="full",
                held_prompt_tokens=1000, prompt_on_host=True)
    assert memory.fit(**fits, host_budget_bytes=on_host.host).prompt_on_host
    with pytest.raises(ValueError, match=r"the held prompt's activations need .* GiB of pinned host memory with full "
                                         r"recompute, over the host budget of"):
        memory.fit(**fits, host_budget_bytes=on_host.host - 1)


def test_a_gated_deltanet_layer_reads_one_held_prompt():
    """Prefix reuse holds one prompt per step: a part with two groups' prompts is refused by name."""
    from megatron_dualkv.layout import PrefixedLayout
    from megatron_dualkv.mcore.gated_delta_net import _after_held_tail

    two = PrefixedLayout((4, 5), ((2,), (3,)))
    with pytest.raises(ValueError, match="prefix reuse holds one prompt, got a PrefixedLayout of 2"):
        _after_held_tail(torch.zeros(5, 3), torch.zeros(3, 3), two, 4)
