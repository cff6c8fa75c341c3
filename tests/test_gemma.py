"""Gemma 3 / Gemma 4 (models/gemma*.json): the real architectures, refused features, and the
packed layout against the replicated oracle with sliding windows smaller than the prompts."""
import json

import pytest
import torch
from transformers import Gemma3TextConfig, Gemma4TextConfig

from megatron_dualkv.mcore import DualKVAttention
from megatron_dualkv.mcore.gemma import GemmaRMSNorm, GemmaTransformerLayer, PostNormRowParallelLinear, RopeSpec
from megatron_dualkv.models import ModelCard, build_model, load_card
from megatron_dualkv.rl import GRPOLoss, forward_backward, forward_logprobs
from rollouts import config_of, make_batch, max_abs_diff, model_kwargs_of, parameter_count, rl_micro_batches

HF_CONFIGS = {"gemma3_text": Gemma3TextConfig, "gemma4_text": Gemma4TextConfig}
NOT_HF_ATTRIBUTES = {"name", "source", "model_type", "torch_dtype", "dtype", "rope_theta", "rope_local_base_freq",
                     "rope_scaling", "sliding_window_pattern", "global_head_dim", "num_global_key_value_heads"}
# prompts longer than the tiny cards' sliding window of 6: responses see only the end of their prompt
SHAPES = [[(9, [3, 1, 7]), (2, [5, 2]), (13, [6, 1])], [(11, [2, 8, 4, 1]), (7, [9])]]




def comparable(config):
    """TransformerConfig fields, init methods (fresh functools.partial objects) by their std."""
    return {k: getattr(v, "keywords", v) for k, v in vars(config).items()}


def hf_config(card):
    card = load_card(card)
    return HF_CONFIGS[card.model_type](**{k: v for k, v in card.config.items() if k not in ("name", "source", "model_type")})


def test_gemma3_27b_architecture():
    c = config_of("gemma3-27b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (
        62, 5376, 32, 16, 128, 21504)
    assert c.softmax_scale == 168**-0.5 and c.layernorm_zero_centered_gamma and c.window_size == (1023, 0)
    assert c.window_attn_skip_freq == ([1] * 5 + [0]) * 10 + [1, 1]
    assert c.full_attention_head_dim == 128 and not c.full_attention_keys_are_values
    assert not (c.value_norm or c.layer_scalar or c.add_bias_linear)
    kwargs = model_kwargs_of("gemma3-27b")
    assert (kwargs["vocab_size"], kwargs["max_sequence_length"], kwargs["share_embeddings_and_output_weights"]) == (
        262208, 131072, True)
    assert kwargs["sliding_rope"] == RopeSpec(10000.0)
    assert kwargs["full_rope"] == RopeSpec(1e6, "linear", 8.0)
    assert kwargs["final_logit_softcapping"] is None
    # the published config.json (transformers 4.50) names the scaling type "type"
    published = {**load_card("gemma3-27b").config, "rope_scaling": {"factor": 8.0, "type": "linear"}}
    assert model_kwargs_of(ModelCard("published", published))["full_rope"] == RopeSpec(1e6, "linear", 8.0)


def test_gemma3_4b_architecture():
    c = config_of("gemma3-4b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (
        34, 2560, 8, 4, 256, 10240)
    assert c.softmax_scale == 256**-0.5 and c.layernorm_zero_centered_gamma and c.window_size == (1023, 0)
    assert c.window_attn_skip_freq == ([1] * 5 + [0]) * 5 + [1] * 4
    kwargs = model_kwargs_of("gemma3-4b")
    assert (kwargs["vocab_size"], kwargs["max_sequence_length"], kwargs["share_embeddings_and_output_weights"]) == (
        262208, 131072, True)
    assert kwargs["sliding_rope"] == RopeSpec(10000.0) and kwargs["full_rope"] == RopeSpec(1e6, "linear", 8.0)
    # per layer: q/k/v/o projections, GeGLU MLP, four norms and the q/k norms; tied embedding, final norm
    layer = 2560 * 256 * (8 + 2 * 4) + 8 * 256 * 2560 + 3 * 2560 * 10240 + 4 * 2560 + 2 * 256
    count = parameter_count("gemma3-4b")
    assert count == 34 * layer + 262208 * 2560 + 2560
    assert round(count / 1e9, 2) == 3.88  # the text decoder of Gemma 3 4B (the vision tower is not in it)


def test_gemma4_31b_architecture():
    c = config_of("gemma4-31b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size) == (60, 5376, 32, 21504)
    assert c.window_attn_skip_freq == ([1] * 5 + [0]) * 10 and c.window_size == (1023, 0)
    sliding, full = c.for_layer(1), c.for_layer(6)
    assert (sliding.kv_channels, sliding.num_query_groups) == (256, 16)
    assert (full.kv_channels, full.num_query_groups) == (512, 4) and c.full_attention_keys_are_values
    assert c.softmax_scale == 1.0 and not c.layernorm_zero_centered_gamma and c.value_norm and c.layer_scalar
    assert (c.rope_columns(1), c.rope_columns(6)) == (slice(0, 256), slice(256, 768))
    kwargs = model_kwargs_of("gemma4-31b")
    assert (kwargs["vocab_size"], kwargs["max_sequence_length"], kwargs["final_logit_softcapping"]) == (262144, 262144, 30.0)
    assert kwargs["full_rope"] == RopeSpec(1e6, "proportional", 1.0, 0.25)
    inv_freq = kwargs["full_rope"].inv_freq(512)
    assert inv_freq.shape == (256,) and inv_freq[:64].min() > 0 and not inv_freq[64:].any()


@pytest.mark.parametrize("name", ["gemma3-4b", "gemma3-27b", "gemma3-tiny", "gemma4-31b", "gemma4-tiny"])
def test_cards_are_hugging_face_configs(name):
    """transformers' config class reads every card field back unchanged, resolves the same layer
    shapes, and a config.json it writes (rope_parameters, per_layer_config) builds the same model."""
    card, hf = load_card(name), hf_config(name)
    hf.allow_global_per_layer_attribute_access = True  # Gemma 4: the sliding layers' values
    for key, value in card.config.items():
        if key not in NOT_HF_ATTRIBUTES:
            assert getattr(hf, key) == value, key
    config = config_of(card)
    for i, kind in enumerate(hf.layer_types):
        assert config.is_full_attention(i + 1) == (kind == "full_attention")
        if card.model_type == "gemma4_text":
            layer = hf.per_layer_config[i]
            assert (config.for_layer(i + 1).kv_channels, config.for_layer(i + 1).num_query_groups) == (
                layer.head_dim, layer.num_key_value_heads)
    saved = ModelCard(name, json.loads(hf.to_json_string()))
    assert comparable(config_of(saved)) == comparable(config)
    assert model_kwargs_of(saved) == model_kwargs_of(card)


@pytest.mark.parametrize(
    "base, fields, message",
    [
        ("gemma4-tiny", dict(hidden_size_per_layer_input=None), None),
        ("gemma4-tiny", dict(hidden_size_per_layer_input=64), "hidden_size_per_layer_input=64 is not supported"),
        ("gemma4-tiny", dict(num_kv_shared_layers=2), "num_kv_shared_layers=2 is not supported"),
        ("gemma4-tiny", dict(enable_moe_block=True), "enable_moe_block=True is not supported"),
        ("gemma4-tiny", dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
        ("gemma4-tiny", dict(attention_bias=True), "attention_bias=True is not supported"),
        ("gemma4-tiny", dict(per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}}),
         "per_layer_config is supported only"),
        ("gemma4-tiny", dict(num_global_key_value_heads=3), "not a multiple of the global layers' 3"),
        ("gemma3-tiny", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
        ("gemma3-tiny", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        ("gemma3-tiny", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
        ("gemma3-tiny", dict(layer_types=["sliding_attention"] * 3), "layer_types must list 4 entries"),
        ("gemma3-tiny", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
        ("gemma3-tiny", dict(sliding_window=None), "sliding_window"),
    ],
)
def test_unsupported_cards_are_refused(base, fields, message):
    card = load_card(base)
    config = {**card.config, **fields}
    if fields.get("hidden_size_per_layer_input", 0) is None:
        del config["hidden_size_per_layer_input"]  # transformers' default, 256, means per-layer inputs
        message = "hidden_size_per_layer_input=256 is not supported"
    with pytest.raises(ValueError, match=message):
        custom = ModelCard("custom", config)
        config_of(custom)
        model_kwargs_of(custom)


@pytest.fixture(scope="module", params=["gemma3-tiny", "gemma4-tiny"])
def model(request):
    return build_model(request.param)


def test_layers_follow_the_layer_types(model):
    gemma4 = model.config.layer_scalar
    for number, layer in enumerate(model.decoder.layers, start=1):
        attention = layer.self_attention
        core = attention.core_attention
        assert type(core) is DualKVAttention
        assert core.dualkv_window == (None if model.config.is_full_attention(number) else 6)
        assert attention.hidden_size_per_attention_head == (32 if gemma4 and number % 2 == 0 else 16)
        assert isinstance(attention.linear_proj, PostNormRowParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, PostNormRowParallelLinear)
        assert isinstance(layer.input_layernorm, GemmaRMSNorm) and isinstance(attention.q_layernorm, GemmaRMSNorm)
        assert isinstance(layer, GemmaTransformerLayer) == gemma4
        assert (attention.v_layernorm is not None) == gemma4
    assert model.output_layer.weight is None, "tied to the embedding"




def run(model, batches, layout):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, GRPOLoss(clip_eps=0.2, kl_coef=0.05), layout=layout)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


def test_packed_equals_replicated(model):
    """Log-probs and GRPO gradients of every parameter: DualKV attention with the left window in
    logical positions on the packed layout == Megatron's sliding-window attention replicated."""
    batches = rl_micro_batches(model, SHAPES)
    packed, packed_grads = run(model, batches, "packed")
    replicated, replicated_grads = run(model, batches, "replicated")
    for p, r in zip(packed, replicated):
        # float32 log-probs near -6, summed in another order on a GPU: a few ulps (~5e-7) of them apart
        scale = max(x.abs().max().item() for g in r.logprobs for x in g if x.numel())
        assert max_abs_diff(p.logprobs, r.logprobs) < 1e-6 * (1 + scale)
        torch.testing.assert_close(p.loss, r.loss, rtol=1e-5, atol=1e-6)
    assert packed_grads.keys() == replicated_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in packed_grads.items():
        # float32 sums in another order: on a GPU, a few small elements differ by ~5e-6 of the
        # tensor's largest (PERF_NOTES.md, session 10), hence an absolute term scaled by it
        reference = replicated_grads[name]
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6 + 2e-5 * reference.abs().max().item(), msg=name)


def test_the_sliding_window_matters_for_these_rollouts(model):
    """Without the window the same weights give other log-probs: the equivalence above covers it."""
    batch = make_batch(SHAPES[0])
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    sliding = [core for core in cores if core.dualkv_window]
    with torch.no_grad():
        windowed = forward_logprobs(model, batch)
        for core in sliding:
            core.dualkv_window = None
        try:
            unbounded = forward_logprobs(model, batch)
        finally:
            for core in sliding:
                core.dualkv_window = 6
    assert max_abs_diff(windowed, unbounded) > 1e-3
