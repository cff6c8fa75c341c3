"""``ResponseTokens``: the response tokens of a packed micro-batch and the logits that predict them.

RL losses only train response tokens. Their flat order, used by every tensor in ``megatron_dualkv.rl``
(log-probs, entropies, per-token losses), is group by group, response by response, token by
token: the order of the packed layout ``[P1][R1_1][R1_2]..[P2]..``, and of ``torch.cat`` over the
nested per-group, per-response lists that the public functions return.

Prediction: the logits at packed position ``t`` predict the next token *of the same sequence*.
In the packed layout the token before response ``i`` is not its prompt's last token, so:
the first token of every response is predicted by the logits at its group's LAST PROMPT position
(shared by all responses of the group); a later token by the previous token of the same response.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from ..layout import DualKVLayout


@dataclass(frozen=True, eq=False)
class ResponseTokens:
    """Index of the response tokens of a layout (flat order: see the module docstring).

    token_index:     (N,) packed position of each response token
    predictor_index: (N,) packed position whose logits predict it
    response_id:     (N,) flat response number (0..num_responses-1) of each token
    lens:            (num_responses,) token count of each response
    response_lens:   per group, the response lengths
    """

    token_index: Tensor
    predictor_index: Tensor
    response_id: Tensor
    lens: Tensor
    response_lens: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_layout(cls, layout: DualKVLayout, device=None) -> "ResponseTokens":
        """The index of ``layout`` with its tensors on ``device`` (default: the layout's), built
        once per layout object and device, then reused: losses index device tensors with it every
        micro-batch, and a host-to-device copy per use would wait for the GPU each time."""
        device = layout.device if device is None else torch.device(device)
        if device == torch.device("cpu"):
            return layout.derived((cls, device), lambda: cls._build(layout))
        return layout.derived((cls, device), lambda: cls.from_layout(layout, "cpu")._to(device))

    @classmethod
    def _build(cls, layout: DualKVLayout) -> "ResponseTokens":
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

    def _to(self, device) -> "ResponseTokens":
        return replace(self, token_index=self.token_index.to(device), predictor_index=self.predictor_index.to(device),
                       response_id=self.response_id.to(device), lens=self.lens.to(device))

    @property
    def num_tokens(self) -> int:
        return self.token_index.numel()

    @property
    def num_responses(self) -> int:
        return sum(len(rs) for rs in self.response_lens)

    @property
    def group_sizes(self) -> List[int]:
        return [len(rs) for rs in self.response_lens]

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
        """(N,) per-token values -> (num_responses,) mean over each response's tokens."""
        response_id = self.response_id.to(values.device)
        sums = torch.zeros(self.num_responses, dtype=values.dtype, device=values.device).index_add(0, response_id, values)
        return sums / self.lens.to(values.device, values.dtype)

    def split_groups(self, per_response: Tensor) -> List[Tensor]:
        """(num_responses,) -> per group an (N_g,) tensor (the layout of ``PackedBatch.rewards``)."""
        return list(torch.split(per_response, self.group_sizes))
