"""The padded-batch adapter (megatron_dualkv.interop) against groups built by hand, per-row log-probs
of the replicated layout, and the verl-style actor of docs/embedding.md."""
import numpy as np
import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_dualkv import RolloutGroup, pack_groups
from megatron_dualkv.interop import PaddedPackedBatch, pack_padded, responses_from_padded, unpack_to_padded
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import GRPOLoss, RLMicroBatch, ResponseTokens, forward_backward, forward_logprobs
from rollouts import device_of

PAD = 0
LOSS = GRPOLoss(clip_eps=0.2)
# (group id, prompt, response) per row: two ids interleaved, prompts of different lengths
ROWS = [
    ("q-a", [5, 6, 7], [11, 12, 13, 14]),
    ("q-b", [8, 9], [21]),
    ("q-a", [5, 6, 7], [15, 16]),
    ("q-a", [5, 6, 7], [17]),
    ("q-b", [8, 9], [22, 23, 24]),
]


def padded(rows=ROWS):
    """verl's layout of ``rows``: prompts left-padded, responses right-padded, 0/1 masks."""
    lp, lr = max(len(p) for _, p, _ in rows), max(len(r) for _, _, r in rows)
    prompts, prompt_mask = torch.full((len(rows), lp), PAD), torch.zeros(len(rows), lp, dtype=torch.long)
    responses, response_mask = torch.full((len(rows), lr), PAD), torch.zeros(len(rows), lr, dtype=torch.long)
    for b, (_, p, r) in enumerate(rows):
        prompts[b, lp - len(p):], prompt_mask[b, lp - len(p):] = torch.tensor(p), 1
        responses[b, : len(r)], response_mask[b, : len(r)] = torch.tensor(r), 1
    return prompts, prompt_mask, responses, response_mask, [group_id for group_id, _, _ in rows]


def test_packs_one_group_per_id_in_first_appearance_order():
    batch = pack_padded(*padded(), pad_to_multiple_of=8)
    want = pack_groups([RolloutGroup([5, 6, 7], [[11, 12, 13, 14], [15, 16], [17]]), RolloutGroup([8, 9], [[21], [22, 23, 24]])],
                       pad_to_multiple_of=8)
    assert isinstance(batch, PaddedPackedBatch) and torch.equal(batch.tokens, want.tokens)
    assert (batch.layout.prompt_lens, batch.layout.response_lens, batch.layout.pad_len) == (
        want.layout.prompt_lens, want.layout.response_lens, want.layout.pad_len)
    assert batch.response_rows.tolist() == [0, 2, 3, 1, 4] and (batch.batch_size, batch.response_len) == (5, 4)
    assert batch.rewards is None


def test_unpack_puts_values_back_in_row_order():
    prompts, prompt_mask, responses, response_mask, ids = padded()
    batch = pack_padded(prompts, prompt_mask, responses, response_mask, ids)
    flat = torch.arange(1.0, ResponseTokens.from_layout(batch.layout).num_tokens + 1)
    out = unpack_to_padded(batch, flat)
    # packed order: row 0, 2, 3 (group q-a), then 1, 4; each response's tokens in order
    want = torch.zeros(5, 4)
    values = iter(flat.tolist())
    for row in (0, 2, 3, 1, 4):
        for col in range(int(response_mask[row].sum())):
            want[row, col] = next(values)
    assert torch.equal(out, want)
    pairs = torch.stack([flat, -flat], dim=1)  # trailing dimensions come along
    assert torch.equal(unpack_to_padded(batch, pairs)[..., 1], -want)
    nested = responses_from_padded(batch, out)
    assert torch.equal(ResponseTokens.from_layout(batch.layout).flatten(nested), flat)


@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3_5-tiny"])
def test_logprobs_match_each_row_on_its_own(card):
    """forward_logprobs of the packed batch, unpacked, against each row's prompt and response alone
    on the replicated layout (plain causal attention; for Qwen3.5's GDN layers, each row's
    recurrence from zero state), in the padded layout."""
    model = build_model(card, seed=2)
    prompts, prompt_mask, responses, response_mask, ids = padded()
    ids = np.array(ids, dtype=object)  # verl's uid column
    batch = pack_padded(prompts, prompt_mask, responses, response_mask, ids, pad_to_multiple_of=8)
    with torch.no_grad():
        got = unpack_to_padded(batch, ResponseTokens.from_layout(batch.layout).flatten(forward_logprobs(model, batch)))
        want = torch.zeros_like(got)
        for b, (_, p, r) in enumerate(ROWS):
            (row,), = forward_logprobs(model, pack_groups([RolloutGroup(p, [r])]), layout="replicated")
            want[b, : len(r)] = row
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_group_ids_of_any_hashable_type():
    prompts, prompt_mask, responses, response_mask, _ = padded()
    for ids in (torch.tensor([7, 3, 7, 7, 3]), (("a", 1), ("b", 2), ("a", 1), ("a", 1), ("b", 2))):
        batch = pack_padded(prompts, prompt_mask, responses, response_mask, ids)
        assert batch.response_rows.tolist() == [0, 2, 3, 1, 4]


def bad_row(rows, row, **change):
    rows = [list(r) for r in rows]
    for key, value in change.items():
        rows[row][("group", "prompt", "response").index(key)] = value
    return rows


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda a: a.__setitem__(0, padded(bad_row(ROWS, 3, prompt=[5, 6, 8]))[0]),
         r"group_ids: row 3 has the id 'q-a' of row 0, but a different prompt"),
        (lambda a: a.__setitem__(4, ["q-a", "q-b"]), "group_ids has 2 ids for 5 rows"),
        (lambda a: a.__setitem__(4, [["x"], 1, 2, 3, 4]), "group_ids: row 0 has an id of unhashable type list"),
        (lambda a: a[3].__setitem__((1, slice(None)), torch.tensor([0, 1, 1, 0])), "response_mask: row 1 is not right padding"),
        (lambda a: a[3].__setitem__((2, slice(None)), 0), "response_mask: row 2 has no response tokens"),
        (lambda a: a[1].__setitem__((0, slice(None)), torch.tensor([1, 0, 1])), "prompt_mask: row 0 is not one run of real tokens"),
        (lambda a: a.__setitem__(1, a[1][:, :2]), "each mask must have its tokens' shape"),
        (lambda a: [a.__setitem__(i, a[i][:4]) for i in (2, 3)], "prompts has 5 rows, responses 4"),
        (lambda a: a.__setitem__(0, a[0].float()), "prompts must hold integers"),
        (lambda a: a.__setitem__(2, a[2][0]), r"responses must be a 2-D \[B, L\] tensor, got shape \(4,\)"),
    ],
)
def test_bad_input_names_the_argument_and_row(edit, message):
    args = list(padded())
    edit(args)
    with pytest.raises(ValueError, match=message):
        pack_padded(*args)


def test_bad_values_to_unpack():
    batch = pack_padded(*padded())
    with pytest.raises(ValueError, match=r"one row per response token \(11\)"):
        unpack_to_padded(batch, torch.zeros(10))
    with pytest.raises(ValueError, match=r"padded_values must be \[B, Lr\] = \[5, 4\]"):
        responses_from_padded(batch, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="expected the PaddedPackedBatch of pack_padded"):
        unpack_to_padded(pack_groups([RolloutGroup([1], [[2]])]), torch.zeros(1))


class PackedActor:
    """docs/embedding.md's verl-style actor, as written there."""

    def __init__(self, model, optimizer, loss_fn=LOSS, pad_to_multiple_of=1):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.pad_to_multiple_of = pad_to_multiple_of

    def pack(self, data):
        prompt_len = data["prompts"].shape[1]
        mask = data["attention_mask"]
        return pack_padded(data["prompts"], mask[:, :prompt_len], data["responses"], mask[:, prompt_len:],
                           data["uid"], pad_to_multiple_of=self.pad_to_multiple_of)

    def compute_log_prob(self, data):
        batch = self.pack(data)
        (out,) = forward_backward(self.model, [RLMicroBatch(batch)], with_entropy=True)
        tokens = ResponseTokens.from_layout(batch.layout)
        return unpack_to_padded(batch, tokens.flatten(out.logprobs)), unpack_to_padded(batch, tokens.flatten(out.entropy))

    def update_policy(self, data):
        batch = self.pack(data)
        micro_batch = RLMicroBatch(
            batch,
            old_logprobs=responses_from_padded(batch, data["old_log_probs"]),
            advantages=data["advantages"][batch.response_rows, 0],
        )
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        (out,) = forward_backward(self.model, [micro_batch], self.loss_fn)
        self.optimizer.step()
        clip = torch.cat(out.metrics["clip_fraction"]).mean().item()
        return {"actor/pg_loss": out.loss.item(), "actor/pg_clipfrac": clip}


def test_the_verl_style_actor_of_the_docs_learns_the_advantages():
    """compute_log_prob then update_policy on a padded batch: the log-probs of the rows with positive
    advantage rise, the others' fall, and the log-probs it computes are those of forward_logprobs."""
    model = build_model("qwen3-tiny", seed=4)
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
    *tensors, uid = padded()
    prompts, prompt_mask, responses, response_mask = (x.to(device_of(model)) for x in tensors)  # verl's are on the GPU
    data = {"prompts": prompts, "responses": responses, "attention_mask": torch.cat([prompt_mask, response_mask], 1), "uid": uid}
    advantage = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], device=prompts.device)
    data["advantages"] = advantage[:, None] * response_mask
    actor = PackedActor(ddp, optimizer, pad_to_multiple_of=8)
    before, entropy = actor.compute_log_prob(data)
    assert before.shape == entropy.shape == (5, 4) and (before[response_mask == 0] == 0).all()
    assert (entropy[response_mask == 1] > 0).all()
    data["old_log_probs"] = before
    metrics = actor.update_policy(data)
    assert set(metrics) == {"actor/pg_loss", "actor/pg_clipfrac"} and metrics["actor/pg_clipfrac"] == 0.0
    after, _ = actor.compute_log_prob(data)
    change = (after - before).sum(1) / response_mask.sum(1)
    assert (change[advantage > 0] > 0).all() and (change[advantage < 0] < 0).all(), change
