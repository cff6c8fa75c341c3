"""Padded rollout batches, as verl, OpenRLHF and NeMo-RL hold them, in and out of the packed layout.

    batch = pack_padded(prompts, prompt_mask, responses, response_mask, group_ids, pad_to_multiple_of=1)
    values = unpack_to_padded(batch, flat_values)   # -> (B, response_len), 0 where response_mask is 0, input row order

``prompts`` ``[B, Lp]`` (left padding, as verl's, or right padding), ``responses`` ``[B, Lr]`` with
right padding, the masks 1 (or True) on real tokens; ``group_ids``: one id per row, of any hashable
type (verl's ``uid`` strings): the rows sampled from one prompt share it. ``pack_padded`` packs one
group per id, in the order the ids first appear: its prompt once, then its rows' responses in row
order (the ``RolloutGroup`` form, ``pack_groups``). The result is a ``PackedBatch`` (run it with
``forward_backward`` and ``RLMicroBatch`` like any other) that also knows the row of every packed
response: ``unpack_to_padded`` puts values per response token in packed order (log-probs,
entropies: ``ResponseTokens.flatten`` of ``forward_backward``'s nested outputs) back into the
padded ``[B, Lr]`` layout, and ``responses_from_padded`` takes padded values (old log-probs of a
``compute_log_prob`` pass) to the nested per-group, per-response form ``RLMicroBatch`` takes;
``batch.response_rows`` indexes per-row values (advantages) in packed response order.
"""
from __future__ import annotations

from typing import Hashable, List, Sequence

import torch
from torch import Tensor

from .packing import PackedBatch, RolloutGroup, pack_groups
from .rl.responses import ResponseTokens


class PaddedPackedBatch(PackedBatch):
    """The ``PackedBatch`` of a padded batch (``pack_padded``) and where its responses came from.

    response_rows: (num_responses,) int64, the input row of each packed response (packed order)
    batch_size, response_len: ``B`` and ``Lr`` of the padded ``responses``
    """

    def __init__(self, packed: PackedBatch, response_rows: Tensor, response_len: int):
        super().__init__(packed.tokens, packed.layout, packed.rewards)
        self.response_rows = response_rows
        self.batch_size = int(response_rows.numel())
        self.response_len = response_len
        lens = ResponseTokens.from_layout(packed.layout).lens
        # (row, column) in the padded layout of every response token, in packed order
        self._token_rows = torch.repeat_interleave(response_rows, lens)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        self._token_cols = torch.arange(int(lens.sum())) - starts

    def padded_index(self, device) -> tuple:
        """(rows, columns) of the response tokens in the padded ``[B, Lr]`` layout, on ``device``."""
        return self._token_rows.to(device), self._token_cols.to(device)


def pack_padded(
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    group_ids: Sequence[Hashable],
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> PaddedPackedBatch:
    """Pack a padded batch of ``B`` rows (module docstring) as one group per id.

    prompts, prompt_mask: ``[B, Lp]``; responses, response_mask: ``[B, Lr]``; group_ids: ``B`` ids.
    ValueError, naming the argument and row, for other shapes, a mask that is not one run of real
    tokens (prompts) or not right padding (responses), an empty prompt or response, and rows with
    one id but different prompts.
    """
    rows = _check_shapes(prompts, prompt_mask, responses, response_mask)
    ids = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)  # tensors, numpy arrays -> Python values
    if len(ids) != rows:
        raise ValueError(f"group_ids has {len(ids)} ids for {rows} rows")
    prompt_rows = _real_tokens(prompts, prompt_mask, "prompt", right_padded=False)
    response_rows = _real_tokens(responses, response_mask, "response", right_padded=True)
    group_of_id, prompt_row_of_group, members = {}, [], []
    for row, group_id in enumerate(ids):
        try:
            group = group_of_id.setdefault(group_id, len(prompt_row_of_group))
        except TypeError:
            raise ValueError(f"group_ids: row {row} has an id of unhashable type {type(group_id).__name__}") from None
        if group == len(prompt_row_of_group):
            prompt_row_of_group.append(row)
            members.append([])
        elif prompt_rows[row] != prompt_rows[prompt_row_of_group[group]]:
            raise ValueError(f"group_ids: row {row} has the id {group_id!r} of row {prompt_row_of_group[group]}, "
                             "but a different prompt (after removing its padding)")
        members[group].append(row)
    groups = [RolloutGroup(prompt_rows[first], [response_rows[row] for row in rows_of_group])
              for first, rows_of_group in zip(prompt_row_of_group, members)]
    packed = pack_groups(groups, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
    order = torch.tensor([row for rows_of_group in members for row in rows_of_group], dtype=torch.long)
    return PaddedPackedBatch(packed, order, responses.shape[1])


def unpack_to_padded(batch: PaddedPackedBatch, flat_values: Tensor) -> Tensor:
    """(N, ...) values per response token in packed order -> ``(B, Lr, ...)`` in the input's row
    order, 0 where ``response_mask`` was 0 (on ``flat_values``' device and in its dtype)."""
    _check_batch(batch)
    tokens = ResponseTokens.from_layout(batch.layout)
    if flat_values.shape[:1] != (tokens.num_tokens,):
        raise ValueError(f"flat_values must have one row per response token ({tokens.num_tokens}), "
                         f"got shape {tuple(flat_values.shape)}")
    out = flat_values.new_zeros((batch.batch_size, batch.response_len, *flat_values.shape[1:]))
    out[batch.padded_index(flat_values.device)] = flat_values
    return out


def responses_from_padded(batch: PaddedPackedBatch, padded_values: Tensor) -> List[List[Tensor]]:
    """``(B, Lr, ...)`` values in the input's layout -> per group, per response, an ``(R_i, ...)``
    tensor (the form of ``RLMicroBatch.old_logprobs``); the padding columns are dropped."""
    _check_batch(batch)
    if tuple(padded_values.shape[:2]) != (batch.batch_size, batch.response_len):
        raise ValueError(f"padded_values must be [B, Lr] = [{batch.batch_size}, {batch.response_len}] like the "
                         f"responses, got shape {tuple(padded_values.shape)}")
    flat = padded_values[batch.padded_index(padded_values.device)]
    return ResponseTokens.from_layout(batch.layout).split(flat)


def _check_batch(batch) -> None:
    if not isinstance(batch, PaddedPackedBatch):
        raise ValueError(f"expected the PaddedPackedBatch of pack_padded, got {type(batch).__name__}")


def _check_shapes(prompts, prompt_mask, responses, response_mask) -> int:
    for name, value in (("prompts", prompts), ("prompt_mask", prompt_mask), ("responses", responses),
                        ("response_mask", response_mask)):
        if not isinstance(value, Tensor) or value.dim() != 2:
            raise ValueError(f"{name} must be a 2-D [B, L] tensor, got {_shape(value)}")
        if value.dtype.is_floating_point or value.is_complex():
            raise ValueError(f"{name} must hold integers (masks: 0/1 or bool), got {value.dtype}")
    if prompt_mask.shape != prompts.shape or response_mask.shape != responses.shape:
        raise ValueError(f"each mask must have its tokens' shape: prompts {tuple(prompts.shape)}, prompt_mask "
                         f"{tuple(prompt_mask.shape)}, responses {tuple(responses.shape)}, "
                         f"response_mask {tuple(response_mask.shape)}")
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(f"prompts has {prompts.shape[0]} rows, responses {responses.shape[0]}")
    return prompts.shape[0]


def _shape(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _real_tokens(tokens: Tensor, mask: Tensor, what: str, right_padded: bool) -> List[tuple]:
    """Per row, the token ids where ``mask`` is set; ValueError unless they are one non-empty run
    (starting at column 0 when ``right_padded``)."""
    out = []
    for row, (ids, flags) in enumerate(zip(tokens.tolist(), mask.bool().tolist())):
        real = [column for column, flag in enumerate(flags) if flag]
        if not real:
            raise ValueError(f"{what}_mask: row {row} has no {what} tokens")
        first, last = real[0], real[-1]
        if last - first + 1 != len(real) or (right_padded and first != 0):
            padding = ("right padding (real tokens first)" if right_padded
                       else "one run of real tokens (left or right padding)")
            raise ValueError(f"{what}_mask: row {row} is not {padding}")
        out.append(tuple(ids[first : last + 1]))
    return out
