"""Per-token log-probs and entropy of response tokens, vocab-parallel under tensor parallelism.

Megatron's output layer leaves the logits split along the vocabulary (``[.., V/tp]`` per rank).
The full-vocabulary softmax is never formed on one rank: each rank reduces its shard to a max,
a sum of exponentials and (for entropy) a sum of ``exp * logit``, plus the target logit when the
target falls in its shard; all-reduces over the tensor-parallel group combine them. The sums go
through ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward): the
loss is replicated on every TP rank, so each rank's shard receives exactly its own gradient.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor

from ..mcore.packed_seq_params import DualKVPackedSeqParams
from ..packing import PackedBatch
from .responses import ResponseTokens

LAYOUTS = ("packed", "replicated")


def vocab_parallel_logprobs(
    logits: Tensor, targets: Tensor, tp_group: Optional[dist.ProcessGroup] = None, with_entropy: bool = False
) -> Tuple[Tensor, Optional[Tensor]]:
    """log p(target) and (optionally) the entropy of each row, from this rank's vocabulary shard.

    logits: (N, V/tp), the shard of rank r covers token ids ``[r*V/tp, (r+1)*V/tp)`` (Megatron's
    ``VocabUtility``); targets: (N,) global token ids. Returns (N,) tensors in float32 (float64
    for float64 logits): half-precision logits are upcast before the softmax.
    """
    world = 1 if tp_group is None else tp_group.size()
    shard = logits.shape[-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    row_max = logits.detach().max(dim=-1).values  # a shift only: no gradient needed
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _sum_over_shards(exp.sum(dim=-1), tp_group)
    local_target = targets - (0 if world == 1 else tp_group.rank() * shard)
    in_shard = (local_target >= 0) & (local_target < shard)
    target_logit = shifted.gather(-1, local_target.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over_shards(target_logit * in_shard, tp_group)
    log_sum_exp = sum_exp.log()
    logprobs = target_logit - log_sum_exp
    if not with_entropy:
        return logprobs, None
    # H = -sum p log p = log S - sum(exp * shifted) / S
    entropy = log_sum_exp - _sum_over_shards((exp * shifted).sum(dim=-1), tp_group) / sum_exp
    return logprobs, entropy


def _sum_over_shards(x: Tensor, tp_group) -> Tensor:
    if tp_group is None or tp_group.size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def response_logprobs(model, batch: PackedBatch, layout: str = "packed", with_entropy: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Flat (N,) log-probs (and entropies) of the response tokens of ``batch`` (order: ``ResponseTokens``).

    ``layout="packed"`` runs the packed micro-batch with DualKV attention; ``"replicated"`` runs the
    standard layout (each response after its own prompt copy, right-padded ``[b, s]`` batch, plain
    causal attention by Megatron's ``DotProductAttention``): the baseline and equivalence oracle.
    """
    logits, targets = model_logits_and_targets(model, batch, layout)
    return logprobs_from_logits(model, logits, targets, with_entropy)


def model_logits_and_targets(model, batch: PackedBatch, layout: str) -> Tuple[Tensor, Tensor]:
    """Run ``model`` on ``batch``; the (N, V/tp) predicting logits and (N,) targets of the response tokens."""
    _check_batch(model, batch, layout)
    if layout == "packed":
        return _packed_logits_and_targets(model, batch)
    return _replicated_logits_and_targets(model, batch)


def logprobs_from_logits(model, logits: Tensor, targets: Tensor, with_entropy: bool) -> Tuple[Tensor, Optional[Tensor]]:
    tp_group = get_attr_wrapped_model(model, "pg_collection").tp
    return vocab_parallel_logprobs(logits, targets.to(logits.device), tp_group, with_entropy)


def forward_logprobs(model, batch: PackedBatch, layout: str = "packed") -> List[List[Tensor]]:
    """Per group, per response, the (R_i,) float32 log-probs of the response tokens under ``model``.

    Differentiable (runs under the caller's grad mode). ``layout``: "packed" (DualKV attention) or
    "replicated" (the standard layout: the baseline and equivalence oracle).
    """
    logprobs, _ = response_logprobs(model, batch, layout)
    return ResponseTokens.from_layout(batch.layout).split(logprobs)


def _check_batch(model, batch, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"expected a PackedBatch (megatron_dualkv.pack_groups), got {type(batch).__name__}")
    vocab_size = get_attr_wrapped_model(model, "vocab_size")
    largest = int(batch.tokens.max())
    if largest >= vocab_size:
        raise ValueError(f"token id {largest} is outside the model's vocabulary of {vocab_size}")


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _packed_logits_and_targets(model, batch: PackedBatch) -> Tuple[Tensor, Tensor]:
    device = _model_device(model)
    batch = batch.to(device)
    tokens = ResponseTokens.from_layout(batch.layout)
    padding = torch.zeros(batch.num_tokens, dtype=torch.bool, device=device)
    padding[batch.num_tokens - batch.layout.pad_len :] = True
    logits = model(
        input_ids=batch.tokens.unsqueeze(0),
        position_ids=batch.position_ids.unsqueeze(0),
        attention_mask=None,
        packed_seq_params=DualKVPackedSeqParams.from_layout(batch.layout),
        padding_mask=padding.unsqueeze(0),
    )[0]
    return logits[tokens.predictor_index.to(device)], batch.tokens[tokens.token_index.to(device)]


def _replicated_logits_and_targets(model, batch: PackedBatch) -> Tuple[Tensor, Tensor]:
    """Each response after its own prompt copy, right-padded to ``[b, s]``; standard next-token shift."""
    device = _model_device(model)
    sequences = [(p, r) for p, rs in zip(batch.layout.prompt_lens, batch.layout.response_lens) for r in rs]
    rep = batch.replicated()
    longest = max(p + r for p, r in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    padding = torch.ones(len(sequences), longest, dtype=torch.bool)
    for row, seq in enumerate(rep.split(rep.tokens)):
        input_ids[row, : len(seq)] = seq
        padding[row, : len(seq)] = False
    input_ids, padding = input_ids.to(device), padding.to(device)
    logits = model(
        input_ids=input_ids,
        position_ids=torch.arange(longest, device=device).expand(len(sequences), longest),
        attention_mask=None,
        padding_mask=padding,
    )
    # logits[:, j] predict input_ids[:, j + 1]; a response occupies columns p .. p+r-1.
    rows = [logits[row, p - 1 : p - 1 + r] for row, (p, r) in enumerate(sequences)]
    targets = [input_ids[row, p : p + r] for row, (p, r) in enumerate(sequences)]
    return torch.cat(rows), torch.cat(targets)
