"""Micro-batch planning for packed GRPO/DAPO rollouts: ``plan_micro_batches(groups, max_tokens, dp_size)``,
for rollout groups (prompt and responses) or for trajectories that share prefixes at any depth.

A group's responses stay with their prompt: the prompt is then computed once for all of them.
A group longer than the token budget is split into sub-groups that each carry the prompt. That
is still exact: DualKV attention makes a response's states depend on its prompt and itself only,
so a response computes the same log-probs in any sub-group. What must not be split is anything
that mixes responses: GRPO's group-normalised advantages. Compute them on the whole input (one
flat value per response) and hand each micro-batch its share with
``PlannedMicroBatch.select_responses``.

Cost model (what is balanced): the forward FLOPs of a (sub-)group in units of one token through
the linear layers,

    cost = tokens + attention_weight * attention_pairs

where ``attention_pairs`` counts the causal (query, key) pairs DualKV attention computes (a
response sees its prompt and itself) and ``attention_weight`` is the forward FLOPs of one pair
over those of one token, ``4 * heads * head_dim / (2 * matmul parameters per token)``: 3.9e-5 for
Qwen3-8B, 1.3e-4 for Qwen3-30B-A3B (``CostModel.from_config(config, vocab).attention_weight``
computes it for a model). The default, 2**-14 = 6.1e-5, lies between the two.

Algorithm (deterministic):

1. Items: every group that fits ``max_tokens`` is one item; a larger group is split into the
   fewest sub-groups that fit, as found by the greedy packing of step 3. While there are fewer
   items than DP ranks, the costliest item with two or more responses is split in two halves
   (one more prompt computed, instead of a rank with nothing to do).
2. Ranks: items go to DP ranks by longest-processing-time-first (costliest item to the least
   loaded rank). Guarantee: the costliest rank is at most ``total / dp_size + max item cost``,
   i.e. at most twice the ideal (the ideal being at least both terms).
3. Micro-batches: every rank gets the same number ``M`` of micro-batches (Megatron's schedule,
   pipeline and expert-parallel collectives need each rank to run the same number): ``M`` is the
   smallest count for which every rank's items fit the budget, each item going to its rank's
   cheapest micro-batch that still has room (or, when that spreads items so that one finds no
   room, first-fit decreasing by tokens, which packs tighter). A rank with fewer items than ``M``
   gets *padding* micro-batches: ``pack()`` turns one into a dummy group of a 1-token prompt and a 1-token
   response, and ``select_responses`` gives that response 0. With advantage 0 the clipped policy
   term and its gradient are exactly 0; a KL term also vanishes when the dummy's reference
   log-probs are its own current ones, and the whole loss does in ``RLMicroBatch(...,
   is_padding=True)`` (MoE load-balancing losses do see the dummy's two tokens).

Trajectories (``Trajectory`` items, or a ``TrajectoryBatch``): the same steps with prefix trees in
place of groups. A tree (the trajectories of a group that share their first token, packed as by
``pack_trajectories``) stays whole when it fits: a subtree stays with its ancestor path. A tree
over the budget is split into parts that each carry their path from the root, exact for the same
reason as a sub-group: a trajectory's states depend on its own path only. Splitting descends to
the first segment where the trajectories branch (their common path is the part's head); the
branches there (and each trajectory that ends there) are the pieces, split in turn where one
does not fit with the head, and the pieces go into the fewest parts the greedy packing of step 3
finds. Halving for an idle rank splits at that same segment into two parts of balanced cost. The
cost model is the same: tokens + attention_weight x attention pairs, where a token at logical
position p adds p + 1 pairs wherever it is packed. A micro-batch's tokens are those of the union
of its trajectories' paths (two parts of a tree in one micro-batch share their head again).
Trajectories are numbered as in ``pack_trajectories``: group by group (``trajectory_groups``),
trajectory by trajectory, in that flat order ``response_index`` counts them. With prefix reuse
(``prefix_reuse=True``) a split group's parts, and a split tree's where its trajectories share a
path to hold (``held_path_len``), are micro-batches of their own that run against the prompt
(path) computed once per rank (``rl.prefix_reuse``), instead of carrying it.

Normalisation: Megatron's schedule divides each micro-batch loss by ``M`` and DDP averages
gradients over DP ranks, so a loss that divides by its micro-batch's own count is not the loss of
the whole batch. ``MicroBatchPlan.loss_normalizer(aggregation)`` is the divisor that makes the
accumulated gradient exactly that of the whole batch (``GRPOLoss(normalizer=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .layout import PackedLayout, SegmentNode, causal_pairs
from .packing import PackedBatch, RolloutGroup, check_rollout_groups, pack_groups
from .trajectories import Trajectory, TrajectoryBatch, held_path_len, pack_trajectories, trajectory_groups

DEFAULT_ATTENTION_WEIGHT = 2.0**-14


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of a model on a packed layout: ``token_flops`` per token plus ``pair_flops``
    per attention (query, key) pair (both summed over layers); ``output_flops`` of ``token_flops`` are
    the output layer's, which runs only on the rows that predict a trained token.

    Counted: the matmuls (QKV and output projections, the output gate's rows, MLP or routed and
    shared experts with the router, the output layer) and attention's two matmuls, 4 * heads *
    head_dim per pair; a Gated DeltaNet layer's cost is per token (``gated_delta_net_token_flops``),
    it has no pairs. Not counted: norms, RoPE, softmax, embeddings lookups. Sliding windows are
    ignored (full causal pairs). A training step (forward + backward) is 3x the forward.
    """

    token_flops: float
    pair_flops: float
    output_flops: float = 0.0

    @classmethod
    def from_config(cls, config, vocab_size: int) -> "CostModel":
        """From a Megatron ``TransformerConfig`` (and the vocabulary size of the output layer)."""
        h, d = config.hidden_size, config.kv_channels
        heads, kv_heads = config.num_attention_heads, config.num_query_groups
        mlp_matrices = 3 if config.gated_linear_unit else 2
        gates = heads if getattr(config, "attention_output_gate", False) else 0
        attention = 2 * h * d * (2 * heads + gates + 2 * kv_heads)
        dense_mlp = 2 * h * config.ffn_hidden_size * mlp_matrices
        moe_layers = sum(moe_layer_flags(config))
        if moe_layers:
            shared = config.moe_shared_expert_intermediate_size or 0
            moe_mlp = 2 * h * (config.num_moe_experts + (config.moe_router_topk * config.moe_ffn_hidden_size + shared) * mlp_matrices)
        else:
            moe_mlp = 0
        layers = config.num_layers
        linear_layers = list(getattr(config, "layer_types", ())).count("linear_attention")
        mixers = (layers - linear_layers) * attention + linear_layers * gated_delta_net_token_flops(config)
        output = 2 * h * vocab_size
        token_flops = mixers + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp + output
        pair_flops = (layers - linear_layers) * 4 * heads * d
        return cls(token_flops=float(token_flops), pair_flops=float(pair_flops), output_flops=float(output))

    @property
    def attention_weight(self) -> float:
        """The planner's weight of an attention pair against a token."""
        return self.pair_flops / self.token_flops

    def layout_flops(self, layout: PackedLayout, predicting_rows: Optional[int] = None) -> float:
        """Forward FLOPs of the tokens and attention pairs of ``layout``, padding excluded, with the
        output layer on ``predicting_rows`` rows (default: every token)."""
        tokens = layout.total_tokens - layout.pad_len
        rows = tokens if predicting_rows is None else predicting_rows
        pairs = layout.attention_pairs() - causal_pairs(layout.pad_len)
        return (self.token_flops - self.output_flops) * tokens + self.output_flops * rows + self.pair_flops * pairs

    def layer_flops(self, layout: PackedLayout, num_layers: int) -> float:
        """Forward FLOPs of one (average) decoder layer on ``layout``: what recomputing it costs."""
        return self.layout_flops(layout, predicting_rows=0) / num_layers


def gated_delta_net_token_flops(config) -> int:
    """Forward FLOPs per token of one Gated DeltaNet layer (``mcore.gated_delta_net``): its in and out
    projections, the short convolution, and the recurrence per value head, counted as its matmuls
    would be: the decay, k^T S, the rank-one update and the read-out q^T S, 8 Dk Dv. Linear in the
    tokens: no attention pairs."""
    h, width = config.hidden_size, config.linear_conv_kernel_dim
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    qk, v = key_heads * config.linear_key_head_dim, value_heads * config.linear_value_head_dim
    projections = 2 * h * (2 * qk + 2 * v + 2 * value_heads) + 2 * v * h
    return projections + 2 * (2 * qk + v) * width + 8 * value_heads * config.linear_key_head_dim * config.linear_value_head_dim


def moe_layer_flags(config) -> List[int]:
    """1 per layer with experts, as Megatron reads ``moe_layer_freq`` (every k-th layer, or a 0/1 list)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]


@dataclass(frozen=True)
class _Item:
    """A group or a sub-group: the prompt of ``group`` with the responses ``responses`` (indices);
    for trajectories a tree or a part of one: trajectories ``responses`` (indices in their group)."""

    group: int
    responses: Tuple[int, ...]
    tokens: int
    cost: float
    reuse: bool = False  # a part of a group (tree) whose prompt (held path) runs once for all its parts
    tree: int = 0  # for trajectories, the root segment of their tree: with ``group``, which tree a part shares


@dataclass(frozen=True)
class PlannedMicroBatch:
    """One micro-batch of a plan: (sub-)groups of the input groups, each with its whole prompt, or
    trajectories of the input, each with its whole path.

    groups:           the ``RolloutGroup`` s to pack: an input group's prompt with all or some of
                      its responses (and their rewards); empty for a padding micro-batch and for
                      trajectories
    source_groups:    for each of ``groups`` (each group of ``trajectories``), its index in the
                      planner's input (its number in ``trajectory_groups`` order)
    source_responses: for each of those, the indices of its responses (trajectories) in that group
    response_index:   (num_responses,) int64: where each response of the micro-batch (packed
                      order; ``ResponseTokens`` order for trajectories) sits in the flat response
                      order of the whole input (group by group, response by response)
    num_tokens:       packed tokens (prompts counted once per sub-group, shared prefixes once;
                      before any padding)
    cost:             estimated cost (module docstring)
    trajectories:     the ``Trajectory`` s to pack, group by group; empty for rollout groups
    shared_prompt:    prefix reuse (``plan_micro_batches(prefix_reuse=True)``): the one group's
                      ``SharedPrompt`` (the one tree's held path), which this rank's parts of it
                      share; ``part`` is this one's index among them (they run in that order)
    """

    groups: Tuple[RolloutGroup, ...]
    source_groups: Tuple[int, ...]
    source_responses: Tuple[Tuple[int, ...], ...]
    response_index: torch.Tensor
    num_tokens: int
    cost: float
    trajectories: Tuple[Trajectory, ...] = ()
    shared_prompt: Optional[object] = None
    part: int = 0

    @property
    def is_padding(self) -> bool:
        return not self.groups and not self.trajectories

    def pack(self, pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> Union[PackedBatch, TrajectoryBatch]:
        """``pack_groups`` (``pack_trajectories``) of this micro-batch; a padding micro-batch packs
        as one dummy group of ``pad_token_id`` (1-token prompt, 1-token response, reward 0); a part
        of a prefix-reuse group (tree) packs as its ``PrefixReuseBatch``."""
        if self.shared_prompt is not None:
            from .rl.prefix_reuse import prefix_reuse_part

            responses = self.groups[0] if self.groups else self.trajectories
            return prefix_reuse_part(self.shared_prompt, self.part, responses, pad_to_multiple_of, pad_token_id)
        if self.trajectories:
            return pack_trajectories(self.trajectories, pad_to_multiple_of, pad_token_id)
        groups = self.groups or (RolloutGroup([pad_token_id], [[pad_token_id]], rewards=[0.0]),)
        return pack_groups(groups, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)

    def select_responses(self, values: torch.Tensor) -> torch.Tensor:
        """(num input responses, ...) values of the whole input -> this micro-batch's rows, packed order.

        For advantages computed on whole groups. A padding micro-batch gets one zero row (its dummy response).
        """
        if self.is_padding:
            return values.new_zeros((1, *values.shape[1:]))
        return values[self.response_index.to(values.device)]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches per data-parallel rank: ``ranks[dp_rank][i]``; every rank has ``num_micro_batches``.

    num_responses / response_tokens: responses and response tokens of the whole input
                    (trajectories with a trained token, and trained tokens counted per trajectory).
    rollout_tokens: tokens of the replicated layout (every response with its own prompt copy,
                    every trajectory whole).
    packed_tokens:  tokens of all real micro-batches (a prompt once per sub-group).
    """

    ranks: Tuple[Tuple[PlannedMicroBatch, ...], ...]
    num_responses: int
    response_tokens: int
    rollout_tokens: int
    packed_tokens: int

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0])

    @property
    def rho(self) -> float:
        """Token reduction of the plan over the replicated layout (split prompts count each time)."""
        return self.rollout_tokens / self.packed_tokens

    @property
    def rank_costs(self) -> List[float]:
        return [sum(mb.cost for mb in micro_batches) for micro_batches in self.ranks]

    def loss_normalizer(self, aggregation: str) -> float:
        """What each micro-batch loss must divide its sum by so that the gradient Megatron accumulates
        (mean over the ``M`` micro-batches of a rank, then mean over ranks) is that of the whole batch.

        aggregation: "sequence-mean" (sum of per-response mean token losses over all responses)
        or "token-mean" (sum of token losses over all response tokens); the divisor is that count
        over ``M * dp_size`` (a count of at least 1: trajectories that train no token make every
        loss 0, whatever it is divided by).
        """
        counts = {"sequence-mean": self.num_responses, "token-mean": self.response_tokens}
        if aggregation not in counts:
            raise ValueError(f"aggregation must be one of {sorted(counts)}, got {aggregation!r}")
        return max(counts[aggregation], 1) / (self.num_micro_batches * self.dp_size)


def plan_micro_batches(
    groups: Union[Sequence[RolloutGroup], Sequence[Trajectory], TrajectoryBatch],
    max_tokens: int,
    dp_size: int = 1,
    attention_weight: float = DEFAULT_ATTENTION_WEIGHT,
    prefix_reuse: bool = False,
) -> MicroBatchPlan:
    """Plan packed micro-batches of at most ``max_tokens`` tokens for ``dp_size`` data-parallel ranks.

    prefix_reuse: a group over the budget is split into parts as into sub-groups, but each part is
    a micro-batch of its own that runs against the prompt held from one forward on its rank
    (``rl.prefix_reuse``), instead of carrying it: a rank computes the prompt once for all its
    parts. A part counts the prompt in its tokens (its activations stay alive while the parts run,
    as a sub-group's do in its micro-batch), and a rank runs its parts of a group one after the
    other. For trajectories the same holds for a tree over the budget, split as without prefix
    reuse, with the path its trajectories share up to their first trained token as its prompt
    (``held_path_len``); a tree without one keeps parts that carry their paths.

    groups: ``RolloutGroup`` s, or trajectories (``Trajectory`` s or a ``TrajectoryBatch``).
    See the module docstring for what is kept together, the cost model, the balance guarantee and
    padding. Raises ValueError on ``max_tokens < 1``, ``dp_size < 1``, a negative attention weight,
    no groups, a group without responses or with an empty prompt or response, and a prompt plus
    one response longer than ``max_tokens`` (no micro-batch could hold it); for trajectories on
    what ``pack_trajectories`` refuses and on a trajectory longer than ``max_tokens``, each
    named by its input number.
    """
    for name, value in (("max_tokens", max_tokens), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not attention_weight >= 0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight!r}")
    if isinstance(groups, TrajectoryBatch):
        groups = _trajectories_of(groups)
    groups = list(groups)
    if groups and isinstance(groups[0], Trajectory):
        return _plan_trajectories(groups, max_tokens, dp_size, attention_weight, prefix_reuse)
    _check_groups(groups, max_tokens)
    cost = _item_cost(groups, attention_weight)
    items = [replace(item, reuse=prefix_reuse and len(split) > 1)
             for g in range(len(groups)) for split in [_split_to_budget(groups, g, max_tokens, cost)] for item in split]
    items = _split_until_every_rank_has_work(
        items, dp_size, lambda item: [replace(half, reuse=item.reuse)
                                      for half in _split_group(groups, item, max_tokens, cost, parts=2)])
    per_rank = _assign_to_ranks(items, dp_size)
    bins_per_rank = [_parts_in_order(bins) for bins in _pack_ranks(per_rank, max_tokens)]
    offsets = list(accumulate((len(g.responses) for g in groups), initial=0))
    ranks = tuple(_with_shared_prompts([_micro_batch(groups, offsets, b) for b in bins], bins,
                                       lambda item: groups[item.group].prompt)
                  for bins in bins_per_rank)
    lens = [(len(g.prompt), [len(r) for r in g.responses]) for g in groups]
    # a prefix-reuse group's prompt counts once per rank that runs parts of it
    carried = sum(len(groups[item.group].prompt) for item in items if item.reuse)
    held = sum(len(groups[g].prompt) for rank_items in per_rank for g in {item.group for item in rank_items if item.reuse})
    return MicroBatchPlan(
        ranks=ranks,
        num_responses=offsets[-1],
        response_tokens=sum(sum(rs) for _, rs in lens),
        rollout_tokens=sum(len(rs) * p + sum(rs) for p, rs in lens),
        packed_tokens=sum(item.tokens for item in items) - carried + held,
    )


def _check_groups(groups: List[RolloutGroup], max_tokens: int) -> None:
    if not groups:
        raise ValueError("plan_micro_batches: no rollout groups given")
    check_rollout_groups(groups, "plan_micro_batches")
    for g, group in enumerate(groups):
        if len(group.prompt) == 0 or len(group.responses) == 0 or min(map(len, group.responses)) == 0:
            raise ValueError(f"group {g}: needs a non-empty prompt and at least one response, all non-empty")
        longest = len(group.prompt) + max(map(len, group.responses))
        if longest > max_tokens:
            raise ValueError(
                f"group {g}: its prompt ({len(group.prompt)} tokens) plus its longest response "
                f"({longest - len(group.prompt)}) is {longest} tokens, more than max_tokens={max_tokens}; "
                "raise the micro-batch token budget"
            )


def _item_cost(groups: List[RolloutGroup], attention_weight: float) -> Callable[[int, Sequence[int]], _Item]:
    """An ``_Item`` builder: tokens and cost of group ``g``'s prompt with the given responses."""

    def item(g: int, responses: Sequence[int]) -> _Item:
        p = len(groups[g].prompt)
        lens = [len(groups[g].responses[i]) for i in responses]
        tokens = p + sum(lens)
        pairs = causal_pairs(p) + sum(causal_pairs(p + r) - causal_pairs(p) for r in lens)
        return _Item(g, tuple(sorted(responses)), tokens, tokens + attention_weight * pairs)

    return item


def _split_to_budget(groups, g: int, max_tokens: int, cost) -> List[_Item]:
    whole = cost(g, range(len(groups[g].responses)))
    if whole.tokens <= max_tokens:
        return [whole]
    return _split_group(groups, whole, max_tokens, cost, parts=None)


def _split_group(groups, item: _Item, max_tokens: int, cost, parts: Optional[int]) -> List[_Item]:
    """Split ``item``'s responses into ``parts`` sub-groups (None: the fewest that fit) of balanced cost."""
    prompt = len(groups[item.group].prompt)
    responses = [cost(item.group, [i]) for i in item.responses]
    # A response alone is prompt + response: what it adds to a sub-group is that minus the prompt.
    prompt_cost = cost(item.group, []).cost
    sizes = [r.tokens - prompt for r in responses]
    costs = [r.cost - prompt_cost for r in responses]
    if parts is None:
        parts = -(-sum(sizes) // (max_tokens - prompt))
    bins = None
    while bins is None:
        bins = _bins(sizes, costs, parts, max_tokens - prompt)
        parts += 1
    return [cost(item.group, [item.responses[i] for i in b]) for b in bins if b]


def _split_until_every_rank_has_work(items: List[_Item], dp_size: int, halves: Callable[[_Item], List[_Item]]
                                     ) -> List[_Item]:
    items = list(items)
    while len(items) < dp_size:
        splittable = [item for item in items if len(item.responses) > 1]
        if not splittable:
            break
        costliest = max(splittable, key=lambda item: item.cost)
        items.remove(costliest)
        items += halves(costliest)
    return items


def _assign_to_ranks(items: List[_Item], dp_size: int) -> List[List[_Item]]:
    """Longest processing time first: the costliest item to the least loaded rank."""
    ranks: List[List[_Item]] = [[] for _ in range(dp_size)]
    loads = [0.0] * dp_size
    for item in sorted(items, key=lambda item: (-item.cost, -item.tokens, item.group, item.responses)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        ranks[rank].append(item)
        loads[rank] += item.cost
    return ranks


def _pack_ranks(per_rank: List[List[_Item]], max_tokens: int) -> List[List[List[_Item]]]:
    """Every rank's items in the same number of micro-batches, the smallest number that works. A
    prefix-reuse part fills a micro-batch alone (it packs as one group's responses)."""
    sizes = [[max_tokens if i.reuse else i.tokens for i in items] for items in per_rank]
    count = max(1, max(-(-sum(rank_sizes) // max_tokens) for rank_sizes in sizes))
    while True:
        packed = []
        for items, rank_sizes in zip(per_rank, sizes):
            bins = _bins(rank_sizes, [i.cost for i in items], count, max_tokens)
            if bins is None:
                break
            packed.append([[items[i] for i in b] for b in bins])
        else:
            return packed
        count += 1


def _bins(sizes: Sequence[int], costs: Sequence[float], count: int, capacity: int) -> Optional[List[List[int]]]:
    """Indices into ``sizes`` in ``count`` bins of at most ``capacity``, or None.

    Balanced first: costliest entry first, each to the cheapest bin with room. When that spreads
    the entries so that one finds no room, first-fit decreasing (largest first, each to the first
    bin with room), which packs tighter. Bins left empty then take an entry from the bins holding
    the most, so that a bin is empty only when there are fewer entries than bins (the balanced
    placement leaves one empty that way only for entries of no size and cost: trajectories that
    end inside the head of a tree's part).
    """
    entries = range(len(sizes))
    bins = _greedy_bins(sizes, costs, count, capacity, sorted(entries, key=lambda i: (-costs[i], -sizes[i], i)),
                        lambda room, loads, fill: min(room, key=lambda b: (loads[b], fill[b], b)))
    if bins is None:
        bins = _greedy_bins(sizes, costs, count, capacity, sorted(entries, key=lambda i: (-sizes[i], -costs[i], i)),
                            lambda room, loads, fill: room[0])
    if bins is None:
        return None
    for empty in [b for b in bins if not b]:
        fullest = max(bins, key=len)
        if len(fullest) < 2:
            break
        empty.append(fullest.pop())
    return [sorted(b) for b in bins]


def _greedy_bins(sizes, costs, count: int, capacity: int, order, choose) -> Optional[List[List[int]]]:
    """Entries in ``order``, each to the bin ``choose(bins with room, loads, fill)``; None when one finds no room."""
    bins: List[List[int]] = [[] for _ in range(count)]
    loads, fill = [0.0] * count, [0] * count
    for i in order:
        room = [b for b in range(count) if fill[b] + sizes[i] <= capacity]
        if not room:
            return None
        b = choose(room, loads, fill)
        bins[b].append(i)
        loads[b] += costs[i]
        fill[b] += sizes[i]
    return [sorted(b) for b in bins]


def _parts_in_order(bins: List[List[_Item]]) -> List[List[_Item]]:
    """A rank's micro-batches with the parts of each prefix-reuse group (tree) one after the other,
    after the others: a held prompt stays alive from its first part to its last only."""
    return sorted(bins, key=lambda b: (b[0].group, b[0].tree) if b and b[0].reuse else (-1, -1))


def _with_shared_prompts(planned: List[PlannedMicroBatch], bins: List[List[_Item]],
                         prompt_of: Callable[[_Item], Sequence[int]]) -> Tuple[PlannedMicroBatch, ...]:
    """A rank's planned micro-batches (of ``bins``), the parts of each prefix-reuse group (tree)
    sharing one ``SharedPrompt`` of the tokens ``prompt_of(part)``."""
    reused = sorted({(b[0].group, b[0].tree) for b in bins if b and b[0].reuse})
    if reused:
        from .rl.prefix_reuse import SharedPrompt

        for key in reused:
            where = [i for i, b in enumerate(bins) if b and b[0].reuse and (b[0].group, b[0].tree) == key]
            prompt = SharedPrompt(torch.as_tensor(list(prompt_of(bins[where[0]][0])), dtype=torch.long), len(where))
            for part, i in enumerate(where):
                planned[i] = replace(planned[i], shared_prompt=prompt, part=part)
    return tuple(planned)


def _micro_batch(groups: List[RolloutGroup], offsets: List[int], items: List[_Item]) -> PlannedMicroBatch:
    # Input order inside a micro-batch: packed layouts then follow the rollouts' own order.
    items = sorted(items, key=lambda item: (item.group, item.responses))
    sub_groups = []
    for item in items:
        sub_groups.append(groups[item.group].with_responses(item.responses))
    return PlannedMicroBatch(
        groups=tuple(sub_groups),
        source_groups=tuple(item.group for item in items),
        source_responses=tuple(item.responses for item in items),
        response_index=torch.tensor([offsets[item.group] + i for item in items for i in item.responses], dtype=torch.long),
        num_tokens=sum(item.tokens for item in items),
        cost=sum(item.cost for item in items),
    )


# ------------------------------------------------------------------------------ trajectories
def _trajectories_of(batch: TrajectoryBatch) -> List[Trajectory]:
    """The trajectories a ``TrajectoryBatch`` was packed from."""
    rewards = [None] * batch.num_trajectories if batch.rewards is None else batch.rewards.tolist()
    groups = batch.groups or (None,) * batch.num_trajectories
    return [Trajectory(batch.tokens[index].tolist(), mask.tolist(), reward, group)
            for index, mask, reward, group in zip(batch.trajectory_index, batch.loss_masks, rewards, groups)]


@dataclass(frozen=True)
class _Forest:
    """The prefix trees of the planner's trajectories as ``pack_trajectories`` finds them.

    nodes: the segments of the packed input; paths: per trajectory, (segment, tokens of it on the
    path) root first; weight: the attention weight of the cost model.
    """

    nodes: Tuple[SegmentNode, ...]
    paths: Tuple[Tuple[Tuple[int, int], ...], ...]
    weight: float

    @classmethod
    def of(cls, batch: TrajectoryBatch, weight: float) -> "_Forest":
        nodes = batch.layout.nodes
        paths = tuple(
            tuple((s, nodes[s].length) for s in segments[:-1]) + ((segments[-1], n - nodes[segments[-1]].position),)
            for segments, n in zip(batch.trajectory_segments, batch.trajectory_lens)
        )
        return cls(nodes, paths, weight)

    def tokens_and_cost(self, members: Sequence[int]) -> Tuple[int, float]:
        """Packed tokens and cost of the union of the members' paths."""
        taken: Dict[int, int] = {}
        for i in members:
            for s, n in self.paths[i]:
                taken[s] = max(taken.get(s, 0), n)
        tokens = sum(taken.values())
        starts = ((self.nodes[s].position, n) for s, n in taken.items())
        pairs = sum(causal_pairs(p + n) - causal_pairs(p) for p, n in starts)
        return tokens, tokens + self.weight * pairs

    def branch_depth(self, members: Sequence[int]) -> int:
        """The depth (0: the root) of the first segment of the members' common path after which
        they part, or where one of them ends."""
        depth = 0
        while all(len(self.paths[i]) > depth + 1 for i in members) and \
                len({self.paths[i][depth + 1][0] for i in members}) == 1:
            depth += 1
        return depth

    def pieces(self, members: Sequence[int], depth: int) -> List[List[int]]:
        """The members below segment ``depth`` of their common path: each member that ends in it
        alone, the others by the child segment they continue through (in order of first occurrence)."""
        ending = [[i] for i in members if len(self.paths[i]) == depth + 1]
        by_child: Dict[int, List[int]] = {}
        for i in members:
            if len(self.paths[i]) > depth + 1:
                by_child.setdefault(self.paths[i][depth + 1][0], []).append(i)
        return ending + list(by_child.values())


def _split_tree(forest: _Forest, members: List[int], capacity: int, parts: Optional[int] = None) -> List[List[int]]:
    """``members`` (trajectories of one tree) in parts of at most ``capacity`` tokens that each
    carry their whole path: the fewest parts the greedy packing finds, or ``parts`` (module docstring)."""
    depth = forest.branch_depth(members)
    node = forest.nodes[forest.paths[members[0]][depth][0]]
    head = node.position + max(forest.paths[i][depth][1] for i in members)  # the common path's tokens
    head_cost = head + forest.weight * causal_pairs(head)
    pieces = []  # (trajectories, tokens, cost)
    for piece in forest.pieces(members, depth):
        tokens, cost = forest.tokens_and_cost(piece)
        pieces += ([(piece, tokens, cost)] if tokens <= capacity else
                   [(part, *forest.tokens_and_cost(part)) for part in _split_tree(forest, piece, capacity)])
    room = capacity - head
    sizes = [max(0, tokens - head) for _, tokens, _ in pieces]
    costs = [max(0.0, cost - head_cost) for _, _, cost in pieces]
    count = parts or max(1, -(-sum(sizes) // max(room, 1)))
    bins = None
    while bins is None:
        bins = _bins(sizes, costs, count, room)
        count += 1
    return [sorted(i for p in b for i in pieces[p][0]) for b in bins if b]


def _plan_trajectories(trajectories: List[Trajectory], max_tokens: int, dp_size: int,
                       attention_weight: float, prefix_reuse: bool) -> MicroBatchPlan:
    whole = pack_trajectories(trajectories)  # checks every trajectory, named by its input number
    for i, n in enumerate(whole.trajectory_lens):
        if n > max_tokens:
            raise ValueError(f"trajectory {i} has {n} tokens, more than max_tokens={max_tokens}; "
                             "raise the micro-batch token budget")
    forest = _Forest.of(whole, attention_weight)
    members_of = trajectory_groups(trajectories)
    group_of, position_of = {}, {}
    for g, members in enumerate(members_of):
        for position, i in enumerate(members):
            group_of[i], position_of[i] = g, position

    def item(members: Sequence[int]) -> _Item:
        tokens, cost = forest.tokens_and_cost(members)
        return _Item(group_of[members[0]], tuple(sorted(position_of[i] for i in members)), tokens, cost,
                     tree=forest.paths[members[0]][0][0])

    def members(it: _Item) -> List[int]:
        return [members_of[it.group][position] for position in it.responses]

    trees: Dict[Tuple[int, int], List[int]] = {}  # (group, root segment) -> its trajectories
    for i, path in enumerate(forest.paths):
        trees.setdefault((group_of[i], path[0][0]), []).append(i)
    items, held_paths = [], {}  # a prefix-reuse tree's held path, by its (group, root segment)
    for (g, root), tree in trees.items():
        whole_tree = item(tree)
        if whole_tree.tokens <= max_tokens:
            items.append(whole_tree)
            continue
        held = held_path_len([trajectories[i] for i in tree]) if prefix_reuse else 0
        if held:
            held_paths[g, root] = trajectories[tree[0]].tokens[:held]
        items += [replace(item(part), reuse=held > 0) for part in _split_tree(forest, tree, max_tokens)]
    items = _split_until_every_rank_has_work(
        items, dp_size,
        lambda it: [replace(item(part), reuse=it.reuse)
                    for part in _split_tree(forest, members(it), max_tokens, parts=2)])
    bins_per_rank = [_parts_in_order(bins) for bins in _pack_ranks(_assign_to_ranks(items, dp_size), max_tokens)]
    offsets = list(accumulate((len(m) for m in members_of), initial=0))
    ranks = tuple(_with_shared_prompts([_trajectory_micro_batch(trajectories, forest, members_of, offsets, b)
                                        for b in bins], bins, lambda it: held_paths[it.group, it.tree])
                  for bins in bins_per_rank)
    trained = [int(mask[1:].sum()) for mask in whole.loss_masks]
    # a held path counts once per rank that runs parts of its tree, not once per part
    shared = {id(mb.shared_prompt): mb.shared_prompt for mbs in ranks for mb in mbs if mb.shared_prompt is not None}
    return MicroBatchPlan(
        ranks=ranks,
        num_responses=sum(n > 0 for n in trained),
        response_tokens=sum(trained),
        rollout_tokens=sum(whole.trajectory_lens),
        packed_tokens=sum(mb.num_tokens - (0 if mb.shared_prompt is None else len(mb.shared_prompt.tokens))
                          for mbs in ranks for mb in mbs) + sum(len(p.tokens) for p in shared.values()),
    )


def _trajectory_micro_batch(trajectories: List[Trajectory], forest: _Forest, members_of: List[List[int]],
                            offsets: List[int], items: List[_Item]) -> PlannedMicroBatch:
    # group by group, trajectory by trajectory: pack_trajectories then keeps this order (ResponseTokens)
    pairs = sorted((item.group, position) for item in items for position in item.responses)
    members = [members_of[g][position] for g, position in pairs]
    tokens, cost = forest.tokens_and_cost(members)
    source_groups = tuple(sorted({g for g, _ in pairs}))
    return PlannedMicroBatch(
        groups=(),
        source_groups=source_groups,
        source_responses=tuple(tuple(p for g, p in pairs if g == group) for group in source_groups),
        response_index=torch.tensor([offsets[g] + position for g, position in pairs], dtype=torch.long),
        num_tokens=tokens,
        cost=cost,
        trajectories=tuple(trajectories[i] for i in members),
    )
