"""DualKVGPTModel: RoPE at the packed logical positions (responses continue from P)."""
import math

import pytest
import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_dualkv.mcore import DualKVGPTModel, DualKVPackedSeqParams, ParallelSizes, dualkv_local_block_spec
from megatron_dualkv.models import FAMILIES, ModelCard, build_model, build_transformer_config, load_card
from rollouts import device_of, make_batch


@pytest.fixture(scope="module")
def model():
    return build_model("qwen3-tiny")


def test_megatron_gpt_model_ignores_position_ids_for_rope(model):
    """The fact this model exists for: GPTModel's thd RoPE table has max_seqlen rows, so Megatron's
    thd RoPE restarts every cu_seqlens segment at position 0."""
    batch = make_batch().to(device_of(model))
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    tokens, positions = batch.tokens[None], batch.position_ids[None]
    theirs = GPTModel._preprocess(model, tokens, positions, packed_seq_params=params)[1]
    assert theirs.shape[0] == batch.layout.max_seqlen != batch.num_tokens


def test_rope_rows_are_megatrons_table_at_the_logical_positions(model):
    batch = make_batch().to(device_of(model))
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    emb = model._preprocess(batch.tokens[None], batch.position_ids[None], packed_seq_params=params)[1]
    table = model.rotary_pos_emb(model.max_sequence_length)
    assert emb.shape == (batch.num_tokens, 1, 1, 16)
    for t, p in enumerate(batch.position_ids.tolist()):
        assert torch.equal(emb[t], table[p])
    # the first token of the first group's second response (P=5, R1=3) sits at packed index 8, position 5
    assert batch.position_ids[8] == 5 and torch.equal(emb[8], table[5])
    # later pipeline stages get no position_ids: the layout's are used
    emb_from_layout = model.rotary_pos_emb_at(params, None)
    assert torch.equal(emb_from_layout, emb)


YARN = ModelCard("qwen3-yarn", {**load_card("qwen3-tiny").config,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}})


def test_yarn_rope_rows_are_megatrons_yarn_table_at_the_logical_positions():
    model = build_model(YARN)
    batch = make_batch().to(device_of(model))
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    emb = model._preprocess(batch.tokens[None], batch.position_ids[None], packed_seq_params=params)[1]
    table, attention_factor = model.rotary_pos_emb(model.max_sequence_length)
    assert attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    for t, p in enumerate(batch.position_ids.tolist()):
        assert torch.equal(emb[t], table[p])
    assert torch.equal(model.rotary_pos_emb_at(params, None), emb)


def test_packed_logits_equal_each_sequence_run_alone(model):
    """Every packed token's logits equal those of its own replicated sequence run as a plain batch."""
    batch = make_batch().to(device_of(model))
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    with torch.no_grad():
        packed = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
        rep = batch.replicated()
        for sequence, index in zip(rep.split(rep.tokens), rep.split(rep.index)):
            alone = model(sequence[None], torch.arange(len(sequence), device=sequence.device)[None], None)[0]
            torch.testing.assert_close(packed[index], alone, rtol=1e-5, atol=1e-5)


def test_bad_input(model):
    batch = make_batch()
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    other = make_batch(shapes=[(4, [2, 2])])
    with pytest.raises(ValueError, match="input_ids has 8 tokens but the DualKVLayout describes 40"):
        model(other.tokens[None], other.position_ids[None], None, packed_seq_params=params)
    with pytest.raises(ValueError, match="position_ids has 8 entries but the DualKVLayout describes 40 tokens"):
        model(batch.tokens[None], other.position_ids[None], None, packed_seq_params=params)
    with pytest.raises(ValueError, match="without a layout"):
        model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=DualKVPackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="position_ids has 39 entries"):
        model.rotary_pos_emb_at(params, batch.position_ids[None, :-1])
    long = make_batch(shapes=[(500, [20])])
    with pytest.raises(ValueError, match="beyond the model's max_sequence_length 512"):
        model.rotary_pos_emb_at(DualKVPackedSeqParams.from_layout(long.layout), None)


def test_fused_rope_is_refused(model):
    """TE's fused thd RoPE restarts positions per segment (TransformerConfig only allows it with TE,
    so the flag is set after validation here)."""
    card = load_card("qwen3-tiny")
    family = FAMILIES[card.model_type]
    config = build_transformer_config(card, family, ParallelSizes(), torch.float32, False, {})
    config.apply_rope_fusion = True
    with pytest.raises(ValueError, match="apply_rope_fusion=False"):
        DualKVGPTModel(config, dualkv_local_block_spec(config), **family.gpt_model_kwargs(card))


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_packed_step_reads_nothing_back_per_segment(recompute, monkeypatch):
    """Megatron's thd RoPE reads each cu_seqlens segment's offset back from the device: a host sync
    per segment, layer and pass, which leaves the GPU idle. A packed forward and backward read as
    many values with 3 segments as with 12."""
    from megatron_dualkv.rl import GRPOLoss, forward_backward
    from rollouts import rl_micro_batches

    model = build_model("qwen3-tiny", recompute=recompute)
    reads = []
    for name in ("item", "tolist"):
        read = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _read=read, **k: reads.append(1) or _read(self, *a, **k))

    def reads_of(shapes):
        (batch,) = rl_micro_batches(model, [shapes])
        reads.clear()
        forward_backward(model, [batch], GRPOLoss(), layout="packed", with_entropy=True)
        return len(reads)

    shapes = [(5, [3, 1])], [(5, [3, 1, 4, 2, 2]), (3, [1, 2, 2]), (2, [4])]
    for warm_up in shapes:  # on a GPU the first calls compile the fused norms
        reads_of(warm_up)
    few, many = map(reads_of, shapes)
    assert few == many


def test_yarn_over_part_of_the_head_is_refused():
    family = FAMILIES[YARN.model_type]
    config = build_transformer_config(YARN, family, ParallelSizes(), torch.float32, False, {})
    with pytest.raises(ValueError, match="YaRN RoPE needs rotary_percent=1.0, got 0.5"):
        DualKVGPTModel(config, dualkv_local_block_spec(config), **family.gpt_model_kwargs(YARN), rotary_percent=0.5)
