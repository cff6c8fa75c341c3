"""ResponseTokens: which packed positions hold response tokens and which logits predict them."""
import pytest
import torch

from megatron_dualkv import DualKVLayout
from megatron_dualkv.rl import ResponseTokens


def test_first_response_token_is_predicted_by_the_last_prompt_position():
    # [P P P | A A | B | P | C C C | pad pad]: packed positions 0..12
    layout = DualKVLayout((3, 1), ((2, 1), (3,)), pad_len=2)
    tokens = ResponseTokens.from_layout(layout)
    assert tokens.token_index.tolist() == [3, 4, 5, 7, 8, 9]
    # A0 <- P2, A1 <- A0, B0 <- P2 (not A1, its packed neighbour), C0 <- P(1-token prompt), C1 <- C0, ...
    assert tokens.predictor_index.tolist() == [2, 3, 2, 6, 7, 8]
    assert tokens.response_id.tolist() == [0, 0, 1, 2, 2, 2]
    assert (tokens.num_tokens, tokens.num_responses, tokens.group_sizes) == (6, 3, [2, 1])
    assert torch.equal(tokens.token_index, layout.loss_mask.nonzero().squeeze(1))
    assert ResponseTokens.from_layout(layout) is tokens, "built once per layout"


def test_split_flatten_and_means():
    tokens = ResponseTokens.from_layout(DualKVLayout((3, 1), ((2, 1), (3,))))
    flat = torch.arange(6.0)
    nested = tokens.split(flat)
    assert [[x.tolist() for x in g] for g in nested] == [[[0.0, 1.0], [2.0]], [[3.0, 4.0, 5.0]]]
    assert torch.equal(tokens.flatten(nested), flat)
    assert tokens.response_mean(flat).tolist() == [0.5, 2.0, 4.0]
    assert [g.tolist() for g in tokens.split_groups(torch.tensor([1.0, 2.0, 3.0]))] == [[1.0, 2.0], [3.0]]


@pytest.mark.parametrize(
    "nested, message",
    [
        ([[torch.zeros(2), torch.zeros(1)]], "1 groups given, the batch has 2"),
        ([[torch.zeros(2)], [torch.zeros(3)]], "group 0 has 1 responses, the batch has 2"),
        ([[torch.zeros(2), torch.zeros(2)], [torch.zeros(3)]], r"group 0 response 1 has shape \(2,\), expected \(1,\)"),
    ],
)
def test_flatten_rejects_values_of_another_batch(nested, message):
    tokens = ResponseTokens.from_layout(DualKVLayout((3, 1), ((2, 1), (3,))))
    with pytest.raises(ValueError, match=message):
        tokens.flatten(nested, "old_logprobs")
    with pytest.raises(ValueError, match="expected 6 response-token values, got 5"):
        tokens.split(torch.zeros(5))
