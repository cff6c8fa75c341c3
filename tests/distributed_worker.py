"""One rank of the multi-process tests (gloo on CPU):

    RANK=r WORLD_SIZE=n RENDEZVOUS=file python tests/distributed_worker.py OUT_DIR SCENARIO [SCENARIO ...]

Scenarios run one after the other in the same world, each on fresh Megatron parallel state, and
each saves its results to ``OUT_DIR/<scenario>.rank<r>.pt``; a scenario that raises saves its
traceback instead and ends the rank, so that the others fail fast instead of waiting for it.

* ``tp2``: the tiny dense model at tp=2 without sequence parallelism (log-probs, GRPO gradients),
  vocab_parallel_logprobs on a shard of fixed logits, and linear_logprobs_func on a shard of a
  fixed weight (``FUSED_CASES``: padded vocabularies, one leaving rank 1 all padding); ``ep2``:
  the tiny MoE model at ep=2 on the packed and replicated layouts (test_rl_logprobs).
* ``PARALLEL_RUNS``: a policy-update step through Megatron's DDP and schedule (test_parallel): the
  per-response results every rank returns (and forward_logprobs on the packed and the replicated
  layout), and every parameter and its gradient as pieces (global names, tensor-parallel split)
  that the test assembles into full tensors. Among them a layer count that pp splits unevenly
  and a vocabulary that tp pads to another size than one process does; the ``trees_`` runs take
  the step on prefix trees of trajectories (``TREE_MICRO_BATCHES``) instead of rollout groups,
  the ``reuse_`` runs on one long group's prefix-reuse parts (``REUSE_PARTS``), or a tree's
  (``REUSE_TREE_PARTS``).
* ``ppo_dp2``: two PPO mini-batches (``ppo_updates``) at dp=2, one of them with a padding
  micro-batch: the parameters after both optimizer steps (test_parallel runs ``ppo_run`` in one
  process too).
"""
import math
import os
import random
import subprocess
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from megatron_dualkv import Trajectory, pack_trajectories
from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.models import ModelCard, build_model, load_card
from megatron_dualkv.models.hf_export import _global_name  # the single-rank model's name of a parameter
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_dualkv.ops.linear_logprobs import linear_logprobs_func
from megatron_dualkv.rl import prefix_reuse
from megatron_dualkv.rl import (
    GRPOLoss, RLMicroBatch, ResponseTokens, forward_backward, forward_logprobs, forward_only, pack_prefix_reuse,
    pack_prefix_reuse_trajectories, plan_mini_batches, ppo_updates, vocab_parallel_logprobs,
)
from gloo_world import join_world, new_rendezvous
from rollouts import make_batch, make_groups, perturbed

VOCAB_LOGITS_SEED = 5
SEED = 1234
# Uneven groups (a one-token prompt, one-token responses, a single-response group); the two
# micro-batches differ in length, as pipeline stages then exchange differently shaped tensors.
MICRO_BATCH_SHAPES = [
    [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1])],
    [(3, [1]), (9, [2, 7, 3, 1]), (2, [4])],
]
LOSS = GRPOLoss(clip_eps=0.2, kl_coef=0.05)
# 300 tokens: the embedding and output layer have 384 rows in one process, 512 at tp=2
VOCAB_300 = ModelCard("qwen3-tiny-vocab300", {**load_card("qwen3-tiny").config, "vocab_size": 300})


@dataclass(frozen=True)
class ParallelRun:
    """A model card and build_model arguments (parallel sizes, architecture overrides and the
    activation recompute of the parallel run, which the one-process reference runs without)."""

    card: str
    world: int
    sizes: Dict = field(default_factory=dict)
    overrides: Dict = field(default_factory=dict)
    recompute: Dict = field(default_factory=dict)
    trees: bool = False  # micro-batches of trajectories (TREE_MICRO_BATCHES) instead of rollout groups
    reuse: bool = False  # one long group's prefix-reuse parts (REUSE_SHAPE, REUSE_PARTS) instead

    def build_kwargs(self) -> Dict:
        return dict(self.sizes, seed=SEED, **self.overrides, **self.recompute)

    def reference_kwargs(self) -> Dict:
        """The one-process model's: no parallelism, no recompute."""
        return dict(seed=SEED, **self.overrides)


# MoE runs keep the card's load-balancing loss: padding is excluded from its token statistics, so
# the single-process run on unpadded micro-batches computes the same loss.
PARALLEL_RUNS = {
    "dense_tp2": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=False)),
    "dense_tp2_sp": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True)),
    "dense_pp2": ParallelRun("qwen3-tiny", 2, dict(pp=2)),
    "dense_pp2_vpp2": ParallelRun("qwen3-tiny", 2, dict(pp=2, vpp=2), dict(num_layers=4)),
    "dense_pp2_three_layers": ParallelRun("qwen3-tiny", 2, dict(pp=2), dict(num_layers=3)),
    "dense_tp2_padded_vocab": ParallelRun(VOCAB_300, 2, dict(tp=2)),
    "dense_cp2": ParallelRun("qwen3-tiny", 2, dict(cp=2)),
    "dense_cp2_one_kv_head": ParallelRun("qwen3-tiny", 2, dict(cp=2), dict(num_query_groups=1)),
    "dense_cp2_three_kv_heads": ParallelRun("qwen3-tiny", 2, dict(cp=2), dict(num_attention_heads=6, num_query_groups=3)),
    "moe_tp2_sp": ParallelRun("qwen3-moe-tiny", 2, dict(tp=2)),
    "moe_ep2": ParallelRun("qwen3-moe-tiny", 2, dict(ep=2)),
    "moe_pp2": ParallelRun("qwen3-moe-tiny", 2, dict(pp=2)),
    "moe_cp2": ParallelRun("qwen3-moe-tiny", 2, dict(cp=2)),
    # output layer tied to the embedding: under PP the last stage's copy of it, summed with the
    # first stage's by finalize_model_grads
    "gemma3_tp2_sp": ParallelRun("gemma3-tiny", 2, dict(tp=2)),
    "gemma3_pp2": ParallelRun("gemma3-tiny", 2, dict(pp=2)),
    # selective recompute: the linears save their local (sequence-parallel) inputs, the first of a
    # stage's two layers is recomputed whole, the norms and RoPE run on a context-parallel token
    # slice (q and k recomputed before the all-to-all), and the experts' activations are recomputed
    # on each expert rank
    "dense_tp2_sp_selective": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True), recompute=dict(recompute="selective")),
    "dense_pp2_selective_1": ParallelRun("qwen3-tiny", 2, dict(pp=2), dict(num_layers=4),
                                         dict(recompute="selective", recompute_layers=1)),
    "gemma3_cp2_selective": ParallelRun("gemma3-tiny", 2, dict(cp=2), recompute=dict(recompute="selective")),
    "moe_ep2_selective": ParallelRun("qwen3-moe-tiny", 2, dict(ep=2), recompute=dict(recompute="selective")),
    # offloaded layers: under the interleaved schedule each micro-batch's chunks start their own chain
    # of copies back; under TP with SP the linears' sequence-parallel inputs go to the host
    "dense_pp2_vpp2_offload_1": ParallelRun("qwen3-tiny", 2, dict(pp=2, vpp=2), dict(num_layers=4), dict(
        recompute="offload", recompute_layers=1, offload_min_bytes=0)),
    "hybrid_tp2_sp_offload_1": ParallelRun("qwen3_5-tiny", 2, dict(tp=2, sp=True), recompute=dict(
        recompute="offload", recompute_layers=1, offload_min_bytes=0)),
    "dense_tp2_cp2": ParallelRun("qwen3-tiny", 4, dict(tp=2, cp=2)),
    "hybrid_tp2_sp_cp2": ParallelRun("qwen3_5-tiny", 4, dict(tp=2, sp=True, cp=2),
                                     dict(linear_num_key_heads=4, linear_num_value_heads=8)),
    "reuse_hybrid_pp2_cp2": ParallelRun("qwen3_5-tiny", 4, dict(pp=2, cp=2), reuse=True),
    "moe_pp2_tp2": ParallelRun("qwen3-moe-tiny", 4, dict(pp=2, tp=2)),
    "moe_tp2_ep2_etp1_dp2": ParallelRun("qwen3-moe-tiny", 4, dict(tp=2, ep=2, etp=1)),
    # prefix trees of trajectories: TP with SP, CP (Ulysses over the tree layout), EP, PP with
    # Gemma's windows along path positions and its tied output layer, the interleaved schedule
    # (which pads the tree micro-batches to one length)
    "trees_dense_tp2_sp": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True), trees=True),
    "trees_dense_cp2": ParallelRun("qwen3-tiny", 2, dict(cp=2), trees=True),
    "trees_moe_ep2": ParallelRun("qwen3-moe-tiny", 2, dict(ep=2), trees=True),
    "trees_gemma3_pp2": ParallelRun("gemma3-tiny", 2, dict(pp=2), trees=True),
    "trees_dense_pp2_vpp2": ParallelRun("qwen3-tiny", 2, dict(pp=2, vpp=2), dict(num_layers=4), trees=True),
    # Qwen3.5: Gated DeltaNet heads split by tp (in_proj grouped per key head), its layers split by pp
    # (two GDN layers on the first stage, a GDN and the full-attention layer on the second)
    "hybrid_tp2_sp": ParallelRun("qwen3_5-tiny", 2, dict(tp=2, sp=True)),
    "hybrid_pp2": ParallelRun("qwen3_5-tiny", 2, dict(pp=2)),
    "hybrid_moe_ep2": ParallelRun("qwen3-next-tiny", 2, dict(ep=2)),  # with the gated shared expert
    # the interleaved schedule: each rank's two model chunks hold layers 1 and 3 (GDN, GDN) or 2 and
    # 4 (GDN, full attention), so each chunk's layer types come from the whole model's numbering
    "hybrid_pp2_vpp2": ParallelRun("qwen3_5-tiny", 2, dict(pp=2, vpp=2)),
    # Ulysses CP: each GDN layer runs its rank's key heads over the whole sequence, the conv, A_log
    # and dt_bias on their rows, the gated norm on the rank's tokens; selective recompute
    # recomputes the conv (on the CPU) and the gated norm after the all-to-all
    "hybrid_cp2": ParallelRun("qwen3_5-tiny", 2, dict(cp=2)),
    "hybrid_cp2_selective": ParallelRun("qwen3_5-tiny", 2, dict(cp=2), recompute=dict(recompute="selective")),
    "hybrid_moe_cp2": ParallelRun("qwen3-next-tiny", 2, dict(cp=2)),
    "trees_hybrid_cp2": ParallelRun("qwen3_5-tiny", 2, dict(cp=2), trees=True),
    # prefix reuse: every rank holds its heads' prompt K/V; the prompt's last hidden state's
    # gradient, one vocabulary shard's share per rank, is summed over TP in the prompt's backward
    # (all-gathered rows under SP, copied ones without)
    "reuse_dense_tp2": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=False), reuse=True),
    "reuse_dense_tp2_sp": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True), reuse=True),
    # the prompt's saved activations (sequence-parallel shards, all-gathered inputs) on the host
    # until its backward; a memory setting the reference runs without, like recompute
    "reuse_dense_tp2_sp_on_host": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True), reuse=True,
                                              recompute=dict(recompute="full", prefix_reuse_prompt_on_host=True)),
    # each expert rank runs its experts on every part's tokens and the prompt's
    "reuse_moe_ep2": ParallelRun("qwen3-moe-tiny", 2, dict(ep=2), reuse=True),
    # a split tree's held path (REUSE_TREE_PARTS of the first tree of TREE_SHAPES), the same under TP with SP
    "reuse_trees_dense_tp2_sp": ParallelRun("qwen3-tiny", 2, dict(tp=2, sp=True), trees=True, reuse=True),
    # Ulysses CP: each rank holds every prompt row of its heads (one KV head: a replicated copy), the
    # prompt's last row lives in one rank's slice, and the ranks' output layers share the parts' rows
    "reuse_dense_cp2": ParallelRun("qwen3-tiny", 2, dict(cp=2), reuse=True),
    "reuse_dense_cp2_one_kv_head": ParallelRun("qwen3-tiny", 2, dict(cp=2), dict(num_query_groups=1), reuse=True),
    "reuse_dense_cp2_selective_on_host": ParallelRun("qwen3-tiny", 2, dict(cp=2), reuse=True, recompute=dict(
        recompute="selective", prefix_reuse_prompt_on_host=True)),
    "reuse_trees_gemma3_cp2": ParallelRun("gemma3-tiny", 2, dict(cp=2), trees=True, reuse=True),
    # pipeline parallelism: each stage holds its layers' prompt K/V, and the prompt's hidden states and
    # their gradient go between stages beside the schedule's exchange; the first of a stage's layers
    # recomputed whole in the prompt's backward, the prompt's saved activations (the received stage
    # input among them) on the host; a tree's held path with Gemma's tied output layer
    "reuse_dense_pp2": ParallelRun("qwen3-tiny", 2, dict(pp=2), reuse=True),
    "reuse_dense_pp2_selective_1_on_host": ParallelRun("qwen3-tiny", 2, dict(pp=2), dict(num_layers=4), reuse=True,
                                                       recompute=dict(recompute="selective", recompute_layers=1,
                                                                      prefix_reuse_prompt_on_host=True)),
    "reuse_trees_gemma3_pp2": ParallelRun("gemma3-tiny", 2, dict(pp=2), trees=True, reuse=True),
    # Qwen3.5: each rank holds its GDN heads' prompt state and conv tail, each stage its layers'
    "reuse_hybrid_tp2_sp": ParallelRun("qwen3_5-tiny", 2, dict(tp=2, sp=True), reuse=True),
    "reuse_hybrid_pp2": ParallelRun("qwen3_5-tiny", 2, dict(pp=2), reuse=True),
    "reuse_hybrid_moe_ep2": ParallelRun("qwen3-next-tiny", 2, dict(ep=2), reuse=True),
    "reuse_hybrid_cp2": ParallelRun("qwen3_5-tiny", 2, dict(cp=2), reuse=True),
    "reuse_dense_tp2_sp_cp2": ParallelRun("qwen3-tiny", 4, dict(tp=2, sp=True, cp=2), reuse=True),
    # each TP rank's stages exchange its sequence-parallel shard of the prompt's hidden states, each
    # CP rank's its slice (the last stage's CP ranks then share out the prompt's last row)
    "reuse_dense_pp2_tp2_sp": ParallelRun("qwen3-tiny", 4, dict(pp=2, tp=2, sp=True), reuse=True),
    "reuse_dense_pp2_cp2": ParallelRun("qwen3-tiny", 4, dict(pp=2, cp=2), reuse=True),
    # middle stages both receive the prompt's hidden states and send them on
    "reuse_dense_pp4": ParallelRun("qwen3-tiny", 4, dict(pp=4), dict(num_layers=4), reuse=True),
}
REUSE_SHAPE, REUSE_PARTS = (13, [5, 1, 7, 3, 4]), [[0, 1], [2], [3, 4]]
REUSE_TREE_PARTS = [[0, 1], [2, 3], [4]]


def random_tree_shapes(seed: int, groups: range, depth: int = 5, branching: int = 4) -> list:
    """Seeded random trees in TREE_SHAPES' form, one per group: up to ``depth`` segments on a path and
    ``branching`` children at a node (siblings of distinct lengths, so that they are distinct
    segments), segments of 1-6 tokens, and trajectories that also end at some inner nodes."""
    rng = random.Random(seed)
    shapes = []

    def grow(group, lens, masks):
        children = rng.choice([0, 1, 1, 2, branching]) if len(lens) < depth else 0
        if children == 0 or rng.random() < 0.3:
            shapes.append((group, tuple(lens), tuple(masks)))
        for n in rng.sample(range(1, 7), children):
            grow(group, lens + [n], masks + [rng.randint(0, 1)])

    for group in groups:
        grow(group, [rng.randint(1, 6)], [0])
    return shapes


# Per micro-batch, trajectories as (group, segments, loss mask per segment): segments are token
# counts along the path, cut from one seeded draw per distinct prefix, so that trajectories share
# what they share by construction: multi-turn episodes branching at depth 3 with a masked tool
# output, one-token segments, a trajectory that ends at an inner node, a duplicate, two groups.
# The second micro-batch also holds six random trees (seed 22: 17 trajectories in 96 packed tokens,
# paths of 5 segments, a node with 4 children, five one-token segments, five trajectories ending at
# inner nodes), so that every parallel run sees depth and branching no hand-written tree has.
TREE_SHAPES = [
    [(0, (5, 3, 2, 4), (0, 1, 0, 1)), (0, (5, 3, 2, 1), (0, 1, 0, 1)), (0, (5, 3, 1), (0, 1, 1)), (0, (5, 1, 3), (0, 1, 1)),
     (0, (5, 3), (0, 1)), (1, (2, 3), (0, 1)), (1, (2, 2), (0, 1)), (1, (2, 2), (0, 1))],
    [(0, (7, 1, 6), (0, 1, 1)), (0, (7, 2), (1, 1)), (1, (3, 4, 1), (0, 0, 1))] + random_tree_shapes(22, range(2, 8)),
]


def tree_trajectories(shapes, seed: int) -> List[Trajectory]:
    """The trajectories of ``shapes`` (TREE_SHAPES), with seeded token ids and rewards."""
    g = torch.Generator().manual_seed(seed)
    drawn = {}  # (group, prefix of segment counts) -> that segment's token ids

    def segment(key, n):
        if key not in drawn:
            drawn[key] = torch.randint(0, 256, (n,), generator=g).tolist()
        return drawn[key]

    out = []
    for group, lens, masks in shapes:
        tokens = [t for depth, n in enumerate(lens) for t in segment((group, lens[: depth + 1]), n)]
        loss_mask = [m for n, m in zip(lens, masks) for _ in range(n)]
        out.append(Trajectory(tokens, loss_mask, reward=float(torch.rand((), generator=g).round(decimals=1)), group=group))
    return out


def micro_batches(pad_to_multiple_of: int, trees: bool = False, reuse: bool = False) -> List[RLMicroBatch]:
    """The micro-batches of every parallel run: the same rollouts (or trajectories, or prefix-reuse
    parts), padded as the run needs, with behaviour and reference log-probs near those of a tiny
    random model (-log 256)."""
    if reuse and trees:
        tree = [t for t in tree_trajectories(TREE_SHAPES[0], 0) if t.group == 0]
        batches = pack_prefix_reuse_trajectories(tree, REUSE_TREE_PARTS, pad_to_multiple_of)
    elif reuse:
        batches = pack_prefix_reuse(make_groups([REUSE_SHAPE])[0], REUSE_PARTS, pad_to_multiple_of)
    elif trees:
        batches = [pack_trajectories(tree_trajectories(shapes, seed), pad_to_multiple_of=pad_to_multiple_of)
                   for seed, shapes in enumerate(TREE_SHAPES)]
    else:
        batches = [make_batch(shapes, seed=seed, pad_to_multiple_of=pad_to_multiple_of)
                   for seed, shapes in enumerate(MICRO_BATCH_SHAPES)]
    out = []
    for seed, batch in enumerate(batches):
        tokens = ResponseTokens.of(batch.stub if reuse else batch)
        uniform = tokens.split(torch.full((tokens.num_tokens,), -math.log(256)))
        out.append(RLMicroBatch(batch, perturbed(uniform, 0.1, seed), perturbed(uniform, 0.1, seed + 10)))
    return out


def parallel_run(run: ParallelRun) -> Dict:
    built = build_model(run.card, **run.build_kwargs())
    chunks = built if isinstance(built, list) else [built]
    config = chunks[0].config
    ddp = [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c) for c in chunks]
    config.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    model = ddp if len(ddp) > 1 else ddp[0]
    sizes = ParallelSizes(**run.sizes)
    batches = micro_batches(sizes.token_multiple, run.trees, run.reuse)
    with torch.no_grad():
        # one micro-batch at a time: not under the interleaved schedule (it runs at least pp)
        logprobs = None if sizes.vpp else packed_logprobs(model, batches, run.reuse)
        # the baseline layout, wherever Megatron's attention runs it (no context parallelism), on whole groups
        alone = not (sizes.vpp or run.reuse) and sizes.cp == 1
        replicated = [forward_logprobs(model, mb.batch, "replicated") for mb in batches] if alone else None
    with counted_prompt_passes() as prompt_passes:
        outputs = forward_backward(model, batches, LOSS, with_entropy=True)
    return dict(
        logprobs=logprobs, replicated=replicated, outputs=outputs, parameters=parameter_pieces(chunks),
        unpadded_error=None if run.trees or run.reuse else unpadded_error(model, sizes), prompt_passes=prompt_passes,
    )


def packed_logprobs(model, batches: List[RLMicroBatch], reuse: bool) -> list:
    """Per micro-batch, forward_logprobs of its batch; prefix-reuse parts, which run after their
    first part in one schedule, all in one forward-only forward_backward."""
    if reuse:
        return [out.logprobs for out in forward_backward(model, [RLMicroBatch(mb.batch) for mb in batches])]
    return [forward_logprobs(model, mb.batch) for mb in batches]


@contextmanager
def counted_prompt_passes():
    """How often prefix reuse's prompt forward and backward run on this rank meanwhile."""
    passes = dict(forward=0, backward=0)
    forward, backward = prefix_reuse._prompt_forward, prefix_reuse.HeldPrompt.backward

    def counted_forward(*args):
        passes["forward"] += 1
        return forward(*args)

    def counted_backward(held):
        passes["backward"] += 1
        backward(held)

    prefix_reuse._prompt_forward, prefix_reuse.HeldPrompt.backward = counted_forward, counted_backward
    try:
        yield passes
    finally:
        prefix_reuse._prompt_forward, prefix_reuse.HeldPrompt.backward = forward, backward


def unpadded_error(model, sizes: ParallelSizes):
    """The error for a micro-batch of 35 tokens, where CP/SP need a multiple of token_multiple."""
    batch = micro_batches(pad_to_multiple_of=1)[0].batch
    assert batch.num_tokens == 35
    if sizes.token_multiple == 1 or sizes.pp > 1:
        return None
    try:
        forward_logprobs(model, batch)
    except ValueError as error:
        return str(error)
    return "no error"


def parameter_pieces(chunks) -> Dict[str, Dict]:
    """Every parameter of this rank under its name in the whole model (global layer and expert
    numbers; a tied output layer's copy on the last pipeline stage under the embedding's name),
    with its gradient and, when split by tensor parallelism, how."""
    pieces = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"
            expert = ".experts." in name
            split = None
            if getattr(param, "tensor_model_parallel", False):
                if expert:
                    rank, size = parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
                else:
                    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
                split = dict(rank=rank, size=size, dim=param.partition_dim, stride=param.partition_stride)
            pieces[_global_name(chunk, name)] = dict(value=param.detach().clone(), grad=param.main_grad.clone(), split=split)
    return pieces


VOCAB_SIZES = (None, 200, 100)


def fixed_logits_and_targets():
    g = torch.Generator().manual_seed(VOCAB_LOGITS_SEED)
    return 3 * torch.randn(7, 256, generator=g), torch.randint(0, 256, (7,), generator=g)


# linear_logprobs_func at tp=2: (vocab_size, softcap) over a weight of 2 x 24 rows, 9 columns per chunk
FUSED_CASES = [(48, None), (41, 3.0), (20, 3.0)]


def fixed_projection(vocab_size):
    """float64 hidden states (7, 5), weight (48, 5), targets in [0, vocab_size) and upstream gradients."""
    g = torch.Generator().manual_seed(VOCAB_LOGITS_SEED)
    hidden, weight = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((7, 5), (48, 5)))
    targets = torch.randint(0, vocab_size, (7,), generator=g)
    return hidden, weight, targets, torch.randn(2, 7, generator=g, dtype=torch.float64)


def fused_projection(hidden, weight, targets, upstream, vocab_size, softcap, tp_group=None):
    """(log-probs, entropy, d hidden, d weight) of linear_logprobs_func on this rank's weight shard;
    the hidden gradient summed over the ranks as Megatron's output layer sums it."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    shared = h if tp_group is None else copy_to_tensor_model_parallel_region(h, group=tp_group)
    logprobs, entropy = linear_logprobs_func(shared, w, targets, tp_group=tp_group, vocab_size=vocab_size,
                                             softcap=softcap, with_entropy=True, chunk_columns=9)
    ((upstream[0] * logprobs).sum() + (upstream[1] * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), h.grad, w.grad


def tp2():
    model = build_model("qwen3-tiny", tp=2, sp=False)
    batch = make_batch()
    packed = forward_logprobs(model, batch)
    replicated = forward_logprobs(model, batch, layout="replicated")
    forward_backward(model, [RLMicroBatch(batch, old_logprobs=perturbed(packed, 0.05))], GRPOLoss())
    logits, targets = fixed_logits_and_targets()
    rank = parallel_state.get_tensor_model_parallel_rank()
    vocab = {}
    for vocab_size in VOCAB_SIZES:  # None: all 256 columns; 200: rank 1's shard partly padding; 100: all of it
        shard = logits[:, rank * 128 : (rank + 1) * 128].clone().requires_grad_()
        logprobs, entropy = vocab_parallel_logprobs(
            shard, targets % (vocab_size or 256), parallel_state.get_tensor_model_parallel_group(), True, vocab_size
        )
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        vocab[vocab_size] = dict(logprobs=logprobs, entropy=entropy, grad=shard.grad)
    return dict(
        packed=packed, replicated=replicated, final_norm_grad=model.decoder.final_layernorm.weight.grad,
        output_grad=model.output_layer.weight.grad, vocab=vocab,
        fused=[fused_projection_of_shard(rank, *case) for case in FUSED_CASES],
    )


def fused_projection_of_shard(rank, vocab_size, softcap):
    hidden, weight, targets, upstream = fixed_projection(vocab_size)
    return fused_projection(hidden, weight[rank * 24 : (rank + 1) * 24], targets, upstream, vocab_size, softcap,
                            parallel_state.get_tensor_model_parallel_group())


def ep2():
    model = build_model("qwen3-moe-tiny", ep=2, moe_aux_loss_coeff=0.0)
    batch = make_batch()
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 4
    return dict(packed=forward_logprobs(model, batch), replicated=forward_logprobs(model, batch, layout="replicated"))


# Mini-batch 1: one group of 3 responses, split between 2 DP ranks; mini-batch 2: a group of one
# response, so that the second rank runs a padding micro-batch.
PPO_SHAPES = [(5, [3, 1, 4]), (3, [2])]


def ppo_run() -> Dict:
    """Two mini-batches of GRPO with a KL term (reference: the behaviour log-probs) through
    ``ppo_updates`` on the data-parallel ranks of this world, SGD; the parameters after both steps
    and the mini-batches' number of micro-batches with the padding ones of this rank."""
    model = build_model("qwen3-tiny", seed=SEED)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=0.0), [ddp])
    groups = make_groups(PPO_SHAPES)
    loss_fn = GRPOLoss(clip_eps=0.2, kl_coef=0.5)
    minis = plan_mini_batches(groups, 2, 64, loss_fn.advantages([torch.tensor(g.rewards) for g in groups]),
                              dp_size=parallel_state.get_data_parallel_world_size(), dp_rank=parallel_state.get_data_parallel_rank())
    behaviour = [[out.logprobs for out in outs] for outs in forward_only(ddp, minis)]
    minis = [mini.with_logprobs(old=b, ref=b) for mini, b in zip(minis, behaviour)]
    for _ in ppo_updates(ddp, optimizer, minis, loss_fn):
        pass
    return dict(parameters={n: p.detach().clone() for n, p in model.named_parameters()},
                padding=[[mb.is_padding for mb in mini.micro_batches] for mini in minis])


def run_scenario(name: str) -> Dict:
    if name in PARALLEL_RUNS:
        return parallel_run(PARALLEL_RUNS[name])
    return {"tp2": tp2, "ep2": ep2, "ppo_dp2": ppo_run}[name]()


def main(out_dir: str, scenarios: List[str]) -> None:
    rank = int(os.environ["RANK"])
    join_world(rank, int(os.environ["WORLD_SIZE"]), os.environ["RENDEZVOUS"])
    for name in scenarios:
        try:
            result = run_scenario(name)
        except Exception:  # noqa: BLE001 - reported by the test that reads the file
            torch.save(dict(error=traceback.format_exc()), os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            os._exit(1)  # at once: the other ranks' collectives then fail instead of waiting
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
        parallel_state.destroy_model_parallel()
    # gloo: leaving while a peer still finishes point-to-point traffic can abort the process
    dist.barrier()
    dist.destroy_process_group()


def launch(scenarios: List[str], world_size: int, out_dir, timeout: float = 600) -> Dict[str, List[Dict]]:
    """Run ``scenarios`` in a gloo world of ``world_size`` processes; per scenario, each rank's
    results. AssertionError with the ranks' output when a rank fails."""
    rendezvous = new_rendezvous(out_dir)
    procs, logs = [], [os.path.join(out_dir, f"rank{rank}.log") for rank in range(world_size)]
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), RENDEZVOUS=rendezvous, OMP_NUM_THREADS="1")
        # output to files: a rank blocked on a full pipe would stall the others in a collective
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(out_dir), *scenarios], env=env, stdout=log, stderr=log,
            ))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = "\n".join(f"rank {rank}:\n{open(log).read()[-3000:]}" for rank, log in enumerate(logs))
        raise AssertionError(f"the {world_size} ranks did not finish {scenarios} within {timeout} s\n{tails}")
    outputs = [open(log).read() for log in logs]
    results = {}
    for name in scenarios:
        paths = [os.path.join(out_dir, f"{name}.rank{rank}.pt") for rank in range(world_size)]
        assert all(map(os.path.exists, paths)), f"not every rank reached {name}:\n" + "\n".join(o[-3000:] for o in outputs)
        results[name] = [torch.load(path, weights_only=False) for path in paths]
        errors = [f"rank {rank}:\n{r['error']}" for rank, r in enumerate(results[name]) if "error" in r]
        assert not errors, f"{name} failed on\n" + "\n".join(errors)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output[-3000:]}"
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
