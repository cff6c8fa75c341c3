"""Real layer counts in one process: the uneven pipeline split (``pipeline_stage_fields``) as
Megatron's own ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` place it, and the
splits Megatron cannot run refused by field. On two gloo ranks: test_parallel (gradients at pp=2
over 3 layers)."""
import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.models import FAMILIES, build_transformer_config, load_card

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
    ("qwen3-8b", 36, 5, None, (6, 8, 8, 8, 6)),
    ("qwen3-8b", 61, 4, None, (15, 16, 16, 14)),  # the last stage, with the output layer, the lightest
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
