"""Real layer counts and vocabularies in one process: the uneven pipeline split
(``pipeline_stage_fields``) as Megatron's own ``get_num_layers_to_build`` and
``get_transformer_layer_offset`` place it, the splits Megatron cannot run refused by field, the
vocabulary padded for tensor parallelism, and a padded model against transformers. The same on
two gloo ranks: test_parallel (gradients at pp=2 over 3 layers, at tp=2 with a padded vocabulary),
test_export_hf_weights and test_convert_checkpoint (transformers' log-probs at pp=2 over 3 Qwen3
and 5 Gemma 3 layers, and at tp=2 with 300 tokens)."""
import json

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.mcore.parallel import padded_vocab_size
from megatron_dualkv.models import (
    FAMILIES, ModelCard, build_model, build_transformer_config, load_card, load_megatron_state_dict,
)
from megatron_dualkv.rl import forward_logprobs
from rollouts import device_of, make_batch, max_abs_diff
from test_hf_state_dicts import SHAPES, hf_model, hf_response_logprobs

FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"


def config_at(card, pp, vpp=None, **overrides):
    card = load_card(card)
    sizes = ParallelSizes(pp=pp, vpp=vpp)
    return build_transformer_config(card, FAMILIES[card.model_type], sizes, torch.float32, False, overrides)


def megatron_placement(config):
    """Per pipeline rank, the (0-based) layers Megatron builds there, over all its model chunks."""
    vpp = config.virtual_pipeline_model_parallel_size
    vp_stages = range(vpp) if vpp else [None]
    placement = []
    for rank in range(config.pipeline_model_parallel_size):
        layers = []
        for vp_stage in vp_stages:
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            layers += range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank))
        placement.append(layers)
    return placement


@pytest.mark.parametrize("card, num_layers, pp, vpp, want", [
    ("gemma3-27b", 62, 4, None, (15, 16, 16, 15)),
    ("gemma3-27b", 62, 8, None, (7, 8, 8, 8, 8, 8, 8, 7)),
    ("gemma4-31b", 60, 8, None, (6, 8, 8, 8, 8, 8, 8, 6)),
    ("gemma4-31b", 60, 4, None, (15, 15, 15, 15)),  # divides: Megatron's own even split
    ("qwen3-4b", 36, 5, None, (6, 8, 8, 8, 6)),
    ("qwen3-4b", 61, 4, None, (15, 16, 16, 14)),  # the last stage, with the output layer, the lightest
    ("qwen3-tiny", 5, 4, None, (2, 1, 1, 1)),
    ("qwen3-tiny", 3, 2, None, (2, 1)),
    ("qwen3-tiny", 6, 2, 2, (4, 2)),  # interleaved: two chunks of 2 layers, two of 1
])
def test_uneven_stages_as_megatron_builds_them(card, num_layers, pp, vpp, want):
    config = config_at(card, pp, vpp, num_layers=num_layers)
    placement = megatron_placement(config)
    assert tuple(map(len, placement)) == want
    assert sorted(layer for layers in placement for layer in layers) == list(range(num_layers)), "every layer once"
    if vpp is None:
        assert [layers[0] for layers in placement] == [sum(want[:rank]) for rank in range(pp)], "stages in layer order"
    even = num_layers % (pp * (vpp or 1)) == 0
    assert (config.num_layers_in_first_pipeline_stage is None) == even


def test_explicit_stage_layers_and_layout_are_kept():
    config = config_at("gemma3-27b", 4, **{FIRST: 14, LAST: 16})
    assert tuple(map(len, megatron_placement(config))) == (14, 16, 16, 16)
    config = config_at("gemma3-27b", 4, **{LAST: 14})  # the first three share the rest
    assert tuple(map(len, megatron_placement(config))) == (16, 16, 16, 14)
    config = config_at("qwen3-tiny", 2, num_layers=3, pipeline_model_parallel_layout="Et|ttL")
    assert config.num_layers_in_first_pipeline_stage is None and config.num_layers_in_last_pipeline_stage is None


@pytest.mark.parametrize("card, pp, vpp, overrides, message", [
    ("gemma3-27b", 4, None, {FIRST: 0}, "num_layers_in_first_pipeline_stage must be a positive int"),
    ("gemma3-27b", 1, None, {LAST: 2}, r"num_layers_in_last_pipeline_stage=2 .* needs pp > 1"),
    ("gemma3-27b", 4, None, {FIRST: 15, LAST: 16},
     r"num_layers_in_first_pipeline_stage \(15\) \+ num_layers_in_last_pipeline_stage \(16\) leave 31 of "
     r"num_layers \(62\) for the other 2 pipeline stage\(s\)"),
    ("qwen3-tiny", 2, None, {"num_layers": 5, FIRST: 3, LAST: 3}, r"must add up to num_layers \(5\)"),
    ("qwen3-tiny", 2, 2, dict(num_layers=5), r"num_layers \(5\) does not split over pp=2 stages of vpp=2 model chunks"),
    ("qwen3-tiny", 2, 2, {"num_layers": 6, FIRST: 3}, r"pipeline_stage \(3\) must be a multiple of vpp \(2\)"),
    ("qwen3-tiny", 3, 2, {"num_layers": 7, FIRST: 2, LAST: 2}, r"leave 3 layers on each other pipeline"),
    ("qwen3-tiny", 2, 2, {"num_layers": 6, FIRST: 4, LAST: 2},
     r"with vpp=2 leave no middle pipeline stage, .* set num_layers_in_first_pipeline_stage only"),
    ("qwen3-tiny", 4, None, dict(num_layers=3), r"num_layers \(3\) is fewer than pp \(4\)"),
    ("qwen3-tiny", 2, None, dict(num_layers=4, pipeline_model_parallel_layout="Et|t|t|tL"),
     r"pipeline_model_parallel_layout has 2 model chunk\(s\) per pipeline stage, but build_model was given vpp=None"),
])
def test_splits_megatron_cannot_run_are_refused(card, pp, vpp, overrides, message):
    with pytest.raises(ValueError, match=message):
        config_at(card, pp, vpp, **overrides)


@pytest.mark.parametrize("vocab_size, tp, divisor, padded", [
    (262208, 1, 128, 262272), (262208, 2, 128, 262400), (262208, 8, 128, 263168),  # Gemma 3
    (151936, 1, 128, 151936), (151936, 2, 128, 152064), (151936, 8, 128, 152576),  # Qwen3
    (262144, 8, 128, 262144),  # Gemma 4: a power of two
    (255, 1, 1, 255), (255, 2, 1, 256), (300, 1, 128, 384), (300, 2, 128, 512),
])
def test_padded_vocab_size(vocab_size, tp, divisor, padded):
    assert padded_vocab_size(vocab_size, tp, divisor) == padded


def test_padded_model_keeps_the_real_vocabulary(tmp_path):
    path = tmp_path / "odd-vocab.json"
    path.write_text(json.dumps({**load_card("qwen3-tiny").config, "vocab_size": 255}))
    model = build_model(path)
    assert (model.vocab_size, model.unpadded_vocab_size) == (256, 255)
    assert model.embedding.word_embeddings.weight.shape[0] == model.output_layer.weight.shape[0] == 256
    assert build_model(path, make_vocab_size_divisible_by=1).vocab_size == 255
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be a positive int, got 0"):
        build_model(path, make_vocab_size_divisible_by=0)
    batch = make_batch()
    batch.tokens[0] = 255
    with pytest.raises(ValueError, match=r"token id 255 is outside the model's vocabulary of 255"):
        forward_logprobs(model, batch)


@pytest.mark.parametrize("name", ["qwen3-tiny", "gemma4-tiny"])  # untied; tied with Gemma 4's final logit softcap
def test_padded_model_gives_the_hugging_face_log_probs(name):
    """300 tokens, 384 rows: the padded rows are zeros after loading, count in no softmax (even made
    the largest logits) and are left out on the way back to Hugging Face."""
    config = load_card(name).config
    vocab_fields = [key for key in ("vocab_size", "vocab_size_per_layer_input") if key in config]
    card = ModelCard(name, {**config, **dict.fromkeys(vocab_fields, 300)})
    family = FAMILIES[card.model_type]
    ours = build_model(card).eval()
    hf = hf_model(card).to(device_of(ours))
    load_megatron_state_dict(ours, family.hf_to_megatron(card, ours.config, hf.state_dict()))
    assert ours.vocab_size == 384 and not ours.embedding.word_embeddings.weight[300:].any()
    output = ours.output_layer.weight if ours.output_layer.weight is not None else ours.embedding.word_embeddings.weight
    with torch.no_grad():
        output[300:] = 50 * output[:300].abs().max() * torch.sign(torch.randn_like(output[300:]))
    batch = make_batch(SHAPES).to(device_of(ours))
    want = hf_response_logprobs(hf, batch)
    with torch.no_grad():
        assert max_abs_diff(forward_logprobs(ours, batch), want) < 1e-5
        assert max_abs_diff(forward_logprobs(ours, batch, "replicated"), want) < 1e-5
    back = family.megatron_to_hf(card, ours.config, ours.state_dict())
    for hf_name, tensor in hf.state_dict().items():
        assert torch.equal(back[hf_name], tensor), hf_name
