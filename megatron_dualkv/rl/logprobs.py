"""Per-token log-probs and entropy of trained tokens, vocab-parallel under tensor parallelism.

The model's last pipeline stage returns its final hidden states (``skip_output_layer``); only the
rows that predict a trained token go through the vocabulary projection, fused with the
log-softmax and the gather and chunked over the vocabulary (``ops.linear_logprobs``), so neither
the logits of prompt positions nor the ``[tokens, V/tp]`` logits of the predicting rows are ever
held. Prediction rows (``ResponseTokens``): on a ``PackedBatch`` the last prompt position of each
group and every response token but the last; on a ``TrajectoryBatch`` the position before each
trained token along its path, once per packed token however many trajectories train it (the
result is then handed to each of them); and the same rows of each replicated sequence.

Tensor parallelism: Megatron's output layer leaves the logits split along the vocabulary. The
full-vocabulary softmax is never formed on one rank: each rank reduces its shard to per-row
statistics that all-reduces over the tensor-parallel group combine; the loss is replicated on every
TP rank, so each rank's shard receives exactly its own gradient. The hidden states reach the
projection as they reach Megatron's ``ColumnParallelLinear``: all-gathered from the sequence split
under sequence parallelism (reduce-scatter backward), else copied (all-reduce backward), which
sums their gradient over the TP ranks. Context parallelism (each rank holds a slice of the packed
tokens) gathers the per-token results over the context-parallel group.

``vocab_parallel_logprobs`` does the same from logits a caller already has.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor

from ..mcore.context_parallel import context_parallel_size, context_parallel_slice
from ..mcore.packed_seq_params import DualKVPackedSeqParams
from ..mcore.parallel import current_parallel_sizes, micro_batch_token_multiple
from ..ops.linear_logprobs import linear_logprobs_func
from ..packing import PackedBatch
from ..trajectories import TrajectoryBatch
from .responses import ResponseTokens

LAYOUTS = ("packed", "replicated")


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    with_entropy: bool = False,
    vocab_size: Optional[int] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """log p(target) and (optionally) the entropy of each row, from this rank's vocabulary shard.

    logits: (N, V/tp), the shard of rank r covers token ids ``[r*V/tp, (r+1)*V/tp)`` (Megatron's
    ``VocabUtility``); targets: (N,) global token ids. vocab_size: the real vocabulary when V is
    padded for tensor parallelism (the model's ``unpadded_vocab_size``): columns from it on are
    no token, count in no softmax (max, sum of exponentials, entropy) and get zero gradient.
    Returns (N,) tensors in float32 (float64 for float64 logits): half-precision logits are
    upcast before the softmax.
    """
    world = 1 if tp_group is None else tp_group.size()
    shard = logits.shape[-1]
    offset = 0 if world == 1 else tp_group.rank() * shard
    if vocab_size is not None:
        # a slice, so the padded columns' gradient is zero; a shard of padding only keeps an empty
        # one, so that every rank's backward still reaches the output layer's collectives
        logits = logits[..., : max(0, min(shard, vocab_size - offset))]
    sum_type = torch.promote_types(logits.dtype, torch.float32)
    if logits.shape[-1]:
        row_max = logits.detach().max(dim=-1).values.to(sum_type)  # a shift only
    else:
        row_max = torch.full(logits.shape[:-1], -torch.inf, dtype=sum_type, device=logits.device)
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    sums = _shard_sums_fused if logits.is_cuda and logits.shape[-1] else _shard_sums
    sum_exp, target_logit, exp_dot_shifted = sums(logits, row_max, targets - offset, with_entropy)
    sum_exp = _sum_over_shards(sum_exp, tp_group)
    log_sum_exp = sum_exp.log()
    logprobs = _sum_over_shards(target_logit, tp_group) - log_sum_exp
    if not with_entropy:
        return logprobs, None
    # H = -sum p log p = log S - sum(exp * shifted) / S
    entropy = log_sum_exp - _sum_over_shards(exp_dot_shifted, tp_group) / sum_exp
    return logprobs, entropy


def _shard_sums(logits: Tensor, row_max: Tensor, local_target: Tensor, with_entropy: bool):
    """Per row of this rank's shard: sum(exp), the target's shifted logit (0 when the target is in
    another shard) and, with entropy, sum(exp * shifted); shifted = logit - row_max, upcast."""
    shifted = logits.to(row_max.dtype) - row_max.unsqueeze(-1)
    exp = shifted.exp()
    shard = logits.shape[-1]
    in_shard = (local_target >= 0) & (local_target < shard)
    if shard:
        target = shifted.gather(-1, local_target.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * in_shard
    else:  # a shard of padding only holds no target; its (empty) sums keep it in the graph
        target = exp.new_zeros(exp.shape[:-1])
    return exp.sum(dim=-1), target, (exp * shifted).sum(dim=-1) if with_entropy else None


# On CUDA: one pass over the half-precision logits each way instead of float32 copies of
# (rows, vocab) for the upcast, the shift and the exponentials, forward and backward (H200,
# Qwen3-8B vocabulary: about 50 ms of a 0.8 s policy-update step).
_shard_sums_fused = torch.compile(_shard_sums, dynamic=True)


def _sum_over_shards(x: Tensor, tp_group) -> Tensor:
    if tp_group is None or tp_group.size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def response_logprobs(model, batch, layout: str = "packed", with_entropy: bool = False
                      ) -> Tuple[Tensor, Optional[Tensor]]:
    """Flat (N,) log-probs (and entropies) of the trained tokens of ``batch``, a ``PackedBatch`` or a
    ``TrajectoryBatch`` (order: ``ResponseTokens``).

    ``layout="packed"`` runs the packed micro-batch with DualKV attention; ``"replicated"`` runs the
    standard layout (each response after its own prompt copy, each trajectory whole, as a
    right-padded ``[b, s]`` batch, plain causal attention by Megatron's ``DotProductAttention``):
    the baseline and equivalence oracle. One direct call of ``model``: the whole model on this rank
    (no pipeline parallelism).
    """
    return logprobs_from_output(model, batch, model_output(model, batch, layout), layout, with_entropy)


def model_output(model, batch, layout: str) -> Tensor:
    """Run ``model`` (one pipeline chunk) on ``batch``: on the last pipeline stage its final hidden
    states ``[s, b, h]`` (after the final norm, before the output layer: ``logprobs_from_output``
    projects the rows it needs), on the others the hidden states for the next stage. Under
    context parallelism the model runs on this rank's slice of the packed tokens."""
    _check_batch(model, batch, layout)
    if layout == "packed":
        return packed_output(model, batch)
    return _replicated_output(model, batch)


def logprobs_from_output(
    model, batch, hidden: Tensor, layout: str, with_entropy: bool, all_tokens: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """Flat (N,) trained-token log-probs (and entropies) from the last stage's ``model_output``.

    The output layer's weight (the shared embedding when tied), the model's final logit softcap and
    its real (unpadded) vocabulary go to ``linear_logprobs_func`` with the predicting rows only.
    Under context parallelism every rank has the hidden states of its own token slice: it computes
    the trained tokens whose predicting position lies there, and a sum over the CP ranks (forward;
    identity backward, as the loss that follows is the same on every rank) gives each rank all of
    them. ``all_tokens``: ``hidden`` already holds every token's row with a backward that sums the
    TP and CP ranks' gradients (``all_rows``), as prefix reuse hands it over; a CP rank then
    computes an equal share of the trained tokens.
    """
    gpt = get_attr_wrapped_model(model, "vocab_size", return_model_obj=True)
    tp_group = gpt.pg_collection.tp
    split = tp_group.size() > 1 and gpt.config.sequence_parallel
    if split and not all_tokens:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    tokens = ResponseTokens.of(batch)
    index = None
    if layout == "packed":
        rows, targets, index = _packed_predictions(gpt, batch, tokens, hidden.device, all_tokens)
    else:
        rows, targets = _replicated_predictions(batch, tokens, hidden.device)
    predicting = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [s, b, h]: row = position * b + sequence
    if tp_group.size() > 1 and not split and not all_tokens:
        predicting = copy_to_tensor_model_parallel_region(predicting, group=tp_group)
    tied = gpt.share_embeddings_and_output_weights
    weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
    logprobs, entropy = linear_logprobs_func(
        predicting.to(weight.dtype),  # Float16Module hands the last stage's output back in float32
        weight,
        targets,
        tp_group=tp_group,
        vocab_size=gpt.unpadded_vocab_size,
        softcap=getattr(gpt, "final_logit_softcapping", None),
        with_entropy=with_entropy,
    )
    if layout != "packed":
        return logprobs, entropy
    if index is not None:
        logprobs, entropy = (None if x is None else _gather_over_context_parallel(x, index, tokens.num_predictions,
                                                                                  gpt.context_parallel_group)
                             for x in (logprobs, entropy))
    here = ResponseTokens.of(batch, hidden.device)  # its copy index already on the device: no copy per call
    return tuple(None if x is None else here.expand(x) for x in (logprobs, entropy))


def tensor_parallel_rows(model, hidden: Tensor) -> Tensor:
    """The last stage's ``hidden``, every row of this CP rank's tokens, as ``logprobs_from_output``
    hands its rows to the vocabulary projection: all-gathered from the sequence split under sequence
    parallelism (reduce-scatter backward), else copied (all-reduce backward); either way the backward
    sums the gradients of the TP ranks' vocabulary shards."""
    gpt = get_attr_wrapped_model(model, "vocab_size", return_model_obj=True)
    tp_group = gpt.pg_collection.tp
    if tp_group.size() == 1:
        return hidden
    if gpt.config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    return copy_to_tensor_model_parallel_region(hidden, group=tp_group)


def all_rows(model, hidden: Tensor) -> Tensor:
    """``tensor_parallel_rows``, then all-gathered over context parallelism: every packed token's
    row, for callers that add rows of their own before the projection (prefix reuse: the prompt's
    last hidden state), with ``logprobs_from_output(..., all_tokens=True)``. There each CP rank
    projects its own share of the rows, so the backward sums the ranks' gradients (reduce-scatter)."""
    hidden = tensor_parallel_rows(model, hidden)
    cp_group = get_attr_wrapped_model(model, "context_parallel_group")
    if context_parallel_size(cp_group) == 1:
        return hidden
    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=cp_group)


def _check_batch(model, batch, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(batch, (PackedBatch, TrajectoryBatch)):
        raise ValueError(f"expected a PackedBatch (megatron_dualkv.pack_groups) or a TrajectoryBatch "
                         f"(megatron_dualkv.pack_trajectories), got {type(batch).__name__}")
    _check_vocabulary(batch, get_attr_wrapped_model(model, "unpadded_vocab_size"))
    config = get_attr_wrapped_model(model, "config")
    sizes = current_parallel_sizes(config)
    multiple = micro_batch_token_multiple(sizes, config.fp8)
    if layout == "replicated" and sizes.cp > 1:
        raise NotImplementedError(
            "the replicated layout runs Megatron's DotProductAttention, which has no context parallelism; "
            "run the baseline with cp=1"
        )
    if layout == "packed" and batch.num_tokens % multiple:
        pack = "pack_groups" if isinstance(batch, PackedBatch) else "pack_trajectories"
        raise ValueError(
            f"the micro-batch has {batch.num_tokens} packed tokens, not a multiple of {multiple} "
            f"(context parallelism x sequence parallelism of {sizes}, x 16 with FP8 linears); pack it with "
            f"{pack}(..., pad_to_multiple_of={multiple})"
        )


def _check_vocabulary(batch, vocab_size: int) -> None:
    """ValueError naming the largest token id outside the model's vocabulary (and for a
    TrajectoryBatch the first trajectory that holds it)."""
    largest = int(batch.tokens.max())
    if largest < vocab_size:
        return
    where = ""
    if isinstance(batch, TrajectoryBatch):
        holder = next(i for i, index in enumerate(batch.trajectory_index) if int(batch.tokens[index].max()) == largest)
        where = f"trajectory {holder}: "
    raise ValueError(f"{where}token id {largest} is outside the model's vocabulary of {vocab_size}")


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def packed_output(model, batch, held_prompt=None) -> Tensor:
    """``model_output`` on the packed layout of ``batch`` (anything with tokens, a layout and
    num_tokens); ``held_prompt``: the prefix-reuse state its attention holds or reads
    (``rl.prefix_reuse``)."""
    # the tokens and the layout (whose .to is cached) only: not the batch's per-trajectory tensors
    device = _model_device(model)
    layout = batch.layout.to(device)
    padding = torch.zeros(batch.num_tokens, dtype=torch.bool, device=device)
    padding[batch.num_tokens - layout.pad_len :] = True
    return model(
        input_ids=batch.tokens.to(device).unsqueeze(0),
        position_ids=layout.position_ids.unsqueeze(0),
        attention_mask=None,
        packed_seq_params=DualKVPackedSeqParams.from_layout(layout, held_prompt),
        padding_mask=padding.unsqueeze(0),
        skip_output_layer=True,
    )


def _packed_predictions(model, batch, tokens: ResponseTokens, device,
                        all_tokens: bool = False) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(positions in this rank's rows of the packed tokens whose hidden states predict the distinct
    trained tokens, on ``device``; their targets; under context parallelism the number of each
    among those distinct tokens, else None). A CP rank's rows are its slice of the packed tokens,
    or with ``all_tokens`` every row, of which it takes an equal contiguous share of the trained
    tokens (each rank's output layer must see distinct rows: DDP sums its gradient over CP)."""
    targets = batch.tokens[tokens.distinct(tokens.token_index)]
    cp_group = model.context_parallel_group
    if context_parallel_size(cp_group) == 1:
        here = ResponseTokens.of(batch, device)
        return here.distinct(here.predictor_index), targets, None
    predictors = tokens.distinct(tokens.predictor_index)
    if all_tokens:
        index = torch.tensor_split(torch.arange(len(predictors)), cp_group.size())[cp_group.rank()]
        return predictors[index].to(device), targets[index], index.to(device)
    local = context_parallel_slice(batch.num_tokens, cp_group)
    index = torch.nonzero((predictors >= local.start) & (predictors < local.stop)).squeeze(1)
    rows = predictors[index] - local.start
    return rows.to(device), targets[index], index.to(device)


def _gather_over_context_parallel(values: Tensor, index: Tensor, num_values: int, cp_group) -> Tensor:
    """This rank's ``values`` at positions ``index`` -> all ``num_values`` values, on every CP rank."""
    mine = values.new_zeros(num_values).index_add(0, index, values)
    return reduce_from_tensor_model_parallel_region(mine, group=cp_group)


def _replicated_sequences(batch, tokens: ResponseTokens) -> List[Tensor]:
    """Per response (flat order), the packed index of its replicated sequence: a response after
    its prompt, a trajectory whole."""
    if isinstance(batch, PackedBatch):
        rep = batch.replicated()
        return rep.split(rep.index)
    return [batch.trajectory_index[i] for i in tokens.trajectory_of.tolist()]


def _replicated_output(model, batch) -> Tensor:
    """Each response after its own prompt copy, each trajectory whole, right-padded to ``[b, s]``
    (s a multiple of the sequence-parallel split)."""
    device = _model_device(model)
    sequences = _replicated_sequences(batch, ResponseTokens.of(batch))
    config = get_attr_wrapped_model(model, "config")
    multiple = micro_batch_token_multiple(current_parallel_sizes(config), config.fp8)
    longest = -(-max(len(seq) for seq in sequences) // multiple) * multiple
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    padding = torch.ones(len(sequences), longest, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = batch.tokens[seq]
        padding[row, : len(seq)] = False
    input_ids, padding = input_ids.to(device), padding.to(device)
    return model(
        input_ids=input_ids,
        position_ids=torch.arange(longest, device=device).expand(len(sequences), longest),
        attention_mask=None,
        padding_mask=padding,
        skip_output_layer=True,
    )


def _replicated_predictions(batch, tokens: ResponseTokens, device) -> Tuple[Tensor, Tensor]:
    """(rows of the replicated ``[s, b, h]`` output, flattened to ``[s*b, h]``, that predict the
    trained tokens, on ``device``; their targets). Sequence b is response b; a token at logical
    position p is at position p of its sequence and is predicted by position p - 1 (no sharing:
    every trained token has its own row)."""
    positions = batch.position_ids[tokens.token_index]
    rows = (positions - 1) * tokens.num_responses + tokens.response_id
    return rows.to(device), batch.tokens[tokens.token_index]
