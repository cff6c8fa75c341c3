"""``ResponseTokens``: the trained tokens of a packed micro-batch and the logits that predict them.

RL losses only train response tokens: the responses of a ``PackedBatch`` (depth 1), or the
tokens of each trajectory of a ``TrajectoryBatch`` (prefix trees) where its loss mask is set. Their
flat order, used by every tensor in ``megatron_dualkv.rl`` (log-probs, entropies, per-token
losses), is group by group, response by response, token by token, and so is the nesting of the
per-group, per-response lists that the public functions return:

* ``PackedBatch``: the order of the packed layout ``[P1][R1_1][R1_2]..[P2]..``.
* ``TrajectoryBatch``: its groups in order of first occurrence (one group when the trajectories
  have no group ids), in each group its trajectories in input order (``trajectory_of`` maps back
  to the input), in each trajectory its trained tokens ``t = 1..L-1`` with ``loss_mask[t]`` set
  (the first token has no prediction). A token that several trajectories share is a trained token
  of each of them that trains it: it appears once per such trajectory, so that a loss on the flat
  tokens is the loss on the original trajectories. A trajectory may train no token at all.

Prediction: the logits at packed position ``t`` predict the next token *of the same sequence*.
In the packed layout the token before a segment is not the token before it in packed order: the
first token of every response is predicted by the logits at its group's LAST PROMPT position
(shared by all responses of the group), the first token of a tree segment by its parent segment's
last token; a later token by the previous token of the same segment. A shared token's log-prob is
computed once: ``distinct`` picks one copy of each packed token, ``expand`` hands its value to
every copy (so the gradient of a shared token sums over the trajectories that train it).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..layout import DualKVLayout
from ..packing import PackedBatch
from ..trajectories import TrajectoryBatch

# per TrajectoryBatch, its ResponseTokens by device (a batch's index depends on its loss masks,
# not on its layout alone, so it is not kept with the layout's derived tables)
_TRAJECTORY_TOKENS: "weakref.WeakKeyDictionary[TrajectoryBatch, dict]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class ResponseTokens:
    """Index of the trained tokens of a micro-batch (flat order: see the module docstring).

    token_index:     (N,) packed position of each trained token
    predictor_index: (N,) packed position whose logits predict it
    response_id:     (N,) flat response number (0..num_responses-1) of each token
    lens:            (num_responses,) trained-token count of each response
    response_lens:   per group, those counts
    trajectory_of:   (num_responses,) for a TrajectoryBatch, the input number of each response's
                     trajectory, on the host (it indexes Python lists); None for a PackedBatch
                     (its responses are in packed order)
    distinct_index:  (U,) flat position of one copy of each distinct packed token, by packed
                     position; None when no two trained tokens are the same packed token
    copy_index:      (N,) which of those each trained token is (None with ``distinct_index``)
    """

    token_index: Tensor
    predictor_index: Tensor
    response_id: Tensor
    lens: Tensor
    response_lens: Tuple[Tuple[int, ...], ...]
    trajectory_of: Optional[Tensor] = None
    distinct_index: Optional[Tensor] = None
    copy_index: Optional[Tensor] = None

    @classmethod
    def of(cls, batch, device=None) -> "ResponseTokens":
        """The index of a ``PackedBatch`` or ``TrajectoryBatch`` with its tensors on ``device``
        (default: the batch's layout's), built once per batch (layout) and device, then reused."""
        if isinstance(batch, PackedBatch):
            return cls.from_layout(batch.layout, device)
        if not isinstance(batch, TrajectoryBatch):
            raise ValueError(f"expected a PackedBatch or a TrajectoryBatch, got {type(batch).__name__}")
        device = batch.layout.device if device is None else torch.device(device)
        cache, host = _TRAJECTORY_TOKENS.setdefault(batch, {}), torch.device("cpu")
        if host not in cache:
            cache[host] = cls._from_trajectories(batch)
        if device not in cache:
            cache[device] = cache[host]._to(device)
        return cache[device]

    @classmethod
    def from_layout(cls, layout: DualKVLayout, device=None) -> "ResponseTokens":
        """The index of the responses of a depth-1 ``layout`` with its tensors on ``device``
        (default: the layout's), built once per layout object and device, then reused: losses
        index device tensors with it every micro-batch, and a host-to-device copy per use would
        wait for the GPU each time."""
        if not isinstance(layout, DualKVLayout):
            raise ValueError(f"ResponseTokens.from_layout takes a DualKVLayout (a TrajectoryBatch's index depends on "
                             f"its loss masks: ResponseTokens.of(batch)), got {type(layout).__name__}")
        device = layout.device if device is None else torch.device(device)
        if device == torch.device("cpu"):
            return layout.derived((cls, device), lambda: cls._from_depth1(layout))
        return layout.derived((cls, device), lambda: cls.from_layout(layout, "cpu")._to(device))

    @classmethod
    def _from_depth1(cls, layout: DualKVLayout) -> "ResponseTokens":
        token_index, predictor_index, response_id = [], [], []
        for number, (start, length, prompt_start, prompt_len) in enumerate(layout.response_segments):
            tokens = torch.arange(start, start + length)
            token_index.append(tokens)
            predictor_index += [torch.tensor([prompt_start + prompt_len - 1]), tokens[:-1]]
            response_id.append(torch.full((length,), number))
        return cls(
            token_index=torch.cat(token_index),
            predictor_index=torch.cat(predictor_index),
            response_id=torch.cat(response_id),
            lens=torch.tensor([r for rs in layout.response_lens for r in rs]),
            response_lens=layout.response_lens,
        )

    @classmethod
    def _from_trajectories(cls, batch: TrajectoryBatch) -> "ResponseTokens":
        order = torch.argsort(batch.group_index.cpu(), stable=True)
        group_sizes = torch.bincount(batch.group_index.cpu()).tolist()
        token_index, predictor_index, lens = [], [], []
        for i in order.tolist():
            path = batch.trajectory_index[i].cpu()
            trained = torch.nonzero(batch.loss_masks[i].cpu()[1:]).squeeze(1) + 1
            token_index.append(path[trained])
            predictor_index.append(path[trained - 1])
            lens.append(trained.numel())
        token_index = torch.cat(token_index)
        distinct, copy_index = torch.unique(token_index, return_inverse=True)
        distinct_index = None
        if distinct.numel() < token_index.numel():  # the first copy of each: any would do, this one is reproducible
            flat = torch.arange(token_index.numel())
            none_yet = flat.new_full(distinct.shape, token_index.numel())
            distinct_index = none_yet.scatter_reduce(0, copy_index, flat, "amin")
        bounds = [0, *torch.tensor(group_sizes).cumsum(0).tolist()]
        return cls(
            token_index=token_index,
            predictor_index=torch.cat(predictor_index),
            response_id=torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long)),
            lens=torch.tensor(lens, dtype=torch.long),
            response_lens=tuple(tuple(lens[a:b]) for a, b in zip(bounds, bounds[1:])),
            trajectory_of=order,
            distinct_index=distinct_index,
            copy_index=None if distinct_index is None else copy_index,
        )

    def _to(self, device) -> "ResponseTokens":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, token_index=move(self.token_index), predictor_index=move(self.predictor_index),
                       response_id=move(self.response_id), lens=move(self.lens),
                       distinct_index=move(self.distinct_index), copy_index=move(self.copy_index))

    @property
    def num_tokens(self) -> int:
        return self.token_index.numel()

    @property
    def num_responses(self) -> int:
        return sum(len(rs) for rs in self.response_lens)

    @property
    def num_trained_responses(self) -> int:
        """Responses with at least one trained token: what a sequence mean averages over."""
        return sum(n > 0 for rs in self.response_lens for n in rs)

    @property
    def num_predictions(self) -> int:
        """Distinct packed tokens among the trained ones: the rows the vocabulary projection computes."""
        return self.num_tokens if self.distinct_index is None else self.distinct_index.numel()

    @property
    def group_sizes(self) -> List[int]:
        return [len(rs) for rs in self.response_lens]

    def distinct(self, per_token: Tensor) -> Tensor:
        """(N, ...) values of the trained tokens -> (U, ...): those of one copy of each distinct packed token."""
        return per_token if self.distinct_index is None else per_token[self.distinct_index.to(per_token.device)]

    def expand(self, per_prediction: Tensor) -> Tensor:
        """(U, ...) values of the distinct packed tokens -> (N, ...): each trained token's (inverse of ``distinct``)."""
        return per_prediction if self.copy_index is None else per_prediction[self.copy_index.to(per_prediction.device)]

    def split(self, flat: Tensor) -> List[List[Tensor]]:
        """(N, ...) flat response-token values -> per group, per response, an (R_i, ...) tensor."""
        if flat.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} response-token values, got {flat.shape[0]}")
        pieces = torch.split(flat, [r for rs in self.response_lens for r in rs])
        out, start = [], 0
        for rs in self.response_lens:
            out.append(list(pieces[start : start + len(rs)]))
            start += len(rs)
        return out

    def flatten(self, nested: Sequence[Sequence[Tensor]], what: str = "values") -> Tensor:
        """Inverse of ``split``; ValueError when the nesting does not match the responses."""
        if len(nested) != len(self.response_lens):
            raise ValueError(f"{what}: {len(nested)} groups given, the batch has {len(self.response_lens)}")
        for g, (values, lens) in enumerate(zip(nested, self.response_lens)):
            if len(values) != len(lens):
                raise ValueError(f"{what}: group {g} has {len(values)} responses, the batch has {len(lens)}")
            for i, (v, r) in enumerate(zip(values, lens)):
                if v.shape[:1] != (r,):
                    raise ValueError(f"{what}: group {g} response {i} has shape {tuple(v.shape)}, expected ({r},)")
        return torch.cat([v for values in nested for v in values])

    def response_mean(self, values: Tensor) -> Tensor:
        """(N,) per-token values -> (num_responses,) mean over each response's tokens (0 for a
        response without trained tokens)."""
        response_id = self.response_id.to(values.device)
        sums = torch.zeros(self.num_responses, dtype=values.dtype, device=values.device).index_add(0, response_id, values)
        return sums / self.lens.to(values.device, values.dtype).clamp(min=1)

    def split_groups(self, per_response: Tensor) -> List[Tensor]:
        """(num_responses,) -> per group an (N_g,) tensor (the layout of ``PackedBatch.rewards``)."""
        return list(torch.split(per_response, self.group_sizes))

    def group_rewards(self, batch) -> Optional[List[Tensor]]:
        """Per group an (N_g,) float tensor of the batch's rewards (what ``PolicyLoss.advantages``
        takes), None when the batch has none."""
        if isinstance(batch, PackedBatch) or batch.rewards is None:
            return batch.rewards
        return self.split_groups(batch.rewards.cpu()[self.trajectory_of])
