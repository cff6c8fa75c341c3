"""Model cards (models/) and build_model (megatron_dualkv.models)."""
import json
import math

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from megatron_dualkv.mcore import DualKVAttention, dualkv_te_block_spec
from megatron_dualkv.mcore.layer_specs import transformer_engine_available
from megatron_dualkv.models import ModelCard, architecture_differences, available_cards, build_model, load_card
from rollouts import config_of, model_kwargs_of, parameter_count

NOT_ARCHITECTURE = {"name", "source", "model_type", "torch_dtype", "rope_theta", "rope_scaling"}




def test_every_model_has_a_card():
    assert {"qwen3-4b", "qwen3-4b-131k", "qwen3-8b", "qwen3-tiny", "qwen3-30b-a3b", "qwen3-moe-tiny"} <= set(available_cards())


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-4b-131k", "qwen3-8b", "qwen3-tiny", "qwen3-30b-a3b", "qwen3-moe-tiny"])
def test_cards_are_hugging_face_configs(name):
    """Every architecture field is read back unchanged by transformers' own config class (so the
    names are the real ones), and the RoPE base survives transformers 5's rope_parameters."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    card = load_card(name)
    cls = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[card.model_type]
    hf = cls(**{k: v for k, v in card.config.items() if k not in ("name", "source", "model_type")})
    for key, value in card.config.items():
        if key not in NOT_ARCHITECTURE:
            assert getattr(hf, key) == value, key
    assert hf.rope_parameters["rope_theta"] == card.config["rope_theta"]
    # a config.json written by transformers 5 (rope_parameters, num_local_experts) builds the same model
    saved = ModelCard(name, json.loads(hf.to_json_string()))
    assert comparable(config_of(saved)) == comparable(config_of(card))
    assert model_kwargs_of(saved) == model_kwargs_of(card)


def comparable(config):
    """TransformerConfig fields, init methods (fresh functools.partial objects) by their std."""
    return {k: getattr(v, "keywords", v) for k, v in vars(config).items()}


def test_qwen3_8b_architecture():
    c = config_of("qwen3-8b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (
        36, 4096, 32, 8, 128, 12288)
    assert (c.normalization, c.layernorm_epsilon, c.qk_layernorm, c.gated_linear_unit) == ("RMSNorm", 1e-6, True, True)
    assert c.activation_func is torch.nn.functional.silu and not c.add_bias_linear and not c.add_qkv_bias
    assert c.num_moe_experts is None and c.window_size is None
    assert model_kwargs_of("qwen3-8b") == dict(
        vocab_size=151936, max_sequence_length=40960, position_embedding_type="rope", rotary_base=1e6,
        share_embeddings_and_output_weights=False)


def test_qwen3_4b_architecture():
    c = config_of("qwen3-4b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (
        36, 2560, 32, 8, 128, 9728)
    assert model_kwargs_of("qwen3-4b") == dict(
        vocab_size=151936, max_sequence_length=40960, position_embedding_type="rope", rotary_base=1e6,
        share_embeddings_and_output_weights=True)
    # per layer: q/k/v/o projections, gated MLP, input and pre-MLP norms, q/k norms; tied embedding, final norm
    layer = 2560 * 128 * (32 + 2 * 8) + 32 * 128 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128
    count = parameter_count("qwen3-4b")
    assert count == 36 * layer + 151936 * 2560 + 2560
    # the model card's totals: 4.0B parameters, 3.6B without the embedding
    assert round(count / 1e9, 2) == 4.02 and round((count - 151936 * 2560) / 1e9, 1) == 3.6


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_qwen3_4b_131k_is_qwen3_4b_with_yarn():
    assert architecture_differences("qwen3-4b-131k", "qwen3-4b") == {
        "max_sequence_length": (131072, 40960),
        "position_embedding_type": ("yarn", "rope"),
        "yarn_rotary_scaling_factor": (4.0, None),
        "yarn_original_max_position_embeddings": (32768, None),
        "yarn_beta_fast": (32.0, None),
        "yarn_beta_slow": (1.0, None),
        "yarn_correction_range_round_to_int": (True, None),
    }


def test_qwen3_4b_131k_rope_equals_transformers():
    """The real card's YaRN frequencies and attention factor (transformers' attention_scaling on
    cos and sin) against transformers' own, on a model of its head size with few parameters."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config

    card = load_card("qwen3-4b-131k")
    hf = Qwen3Config(**{k: v for k, v in card.config.items() if k not in ("name", "source", "model_type")})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    small = card_with("qwen3-4b-131k", vocab_size=256, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, num_hidden_layers=1)
    model = build_model(small)
    table, _ = model.rotary_pos_emb(1024)
    positions = torch.arange(1024, dtype=torch.float32)
    torch.testing.assert_close(table[:, 0, 0].cpu(), torch.outer(positions, inv_freq).repeat(1, 2), rtol=1e-6, atol=0)
    assert _yarn_get_concentration_factor_from_config(model.config) == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize("base", ["qwen3-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_yarn_cards(base, field):
    """Either name of the field (transformers 4, 5), dense and MoE; transformers' defaults for what
    is left out, and its mscale / mscale_all_dim only as a pair."""
    fields = dict(rope_scaling=YARN) if field == "rope_scaling" else dict(rope_scaling=None, rope_parameters={**YARN, "rope_theta": 1e6})
    card = card_with(base, **fields)
    c = config_of(card)
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings, c.yarn_beta_fast, c.yarn_beta_slow,
            c.yarn_mscale, c.yarn_mscale_all_dim, c.yarn_correction_range_round_to_int) == (4.0, 32768, 32, 1, None, None, True)
    kwargs = model_kwargs_of(card)
    assert kwargs["position_embedding_type"] == "yarn" and kwargs["rotary_base"] == 1e6
    tuned = card_with(base, rope_scaling={"type": "yarn", "factor": None, "original_max_position_embeddings": 128,
                                          "beta_fast": 16, "mscale": 0.5, "mscale_all_dim": 0, "truncate": False})
    c = config_of(tuned)
    assert c.yarn_rotary_scaling_factor == tuned.config["max_position_embeddings"] / 128 and c.yarn_beta_fast == 16
    assert c.yarn_mscale is None and c.yarn_mscale_all_dim is None and c.yarn_correction_range_round_to_int is False


def test_qwen3_30b_a3b_architecture():
    c = config_of("qwen3-30b-a3b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (48, 2048, 32, 4, 128)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (128, 8, 768)
    assert c.moe_layer_freq == [1] * 48 and c.moe_shared_expert_intermediate_size is None
    # norm_topk_prob=True: softmax over the top-k logits == renormalised top-k of the full softmax
    assert c.moe_router_score_function == "softmax" and c.moe_router_pre_softmax is False
    assert c.moe_token_dispatcher_type == "alltoall" and c.moe_aux_loss_coeff == 0.001
    assert not c.moe_grouped_gemm, "no grouped_gemm package here: SequentialMLP experts"
    assert model_kwargs_of("qwen3-30b-a3b")["vocab_size"] == 151936
    assert model_kwargs_of("qwen3-30b-a3b")["rotary_base"] == 1e6


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_matches_qwen3_moe_routing(norm_topk_prob):
    """Qwen3MoeTopKRouter: softmax over all experts, top-k, renormalise when norm_topk_prob."""
    logits = torch.randn(11, 8, generator=torch.Generator().manual_seed(0))
    probs, routing_map = topk_routing_with_score_function(logits, 3, use_pre_softmax=not norm_topk_prob)
    top, index = torch.softmax(logits, -1).topk(3, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    want = torch.zeros_like(logits).scatter(1, index, top)
    torch.testing.assert_close(probs, want)
    assert torch.equal(routing_map, want > 0)


def card_with(base, **fields):
    card = load_card(base)
    return ModelCard("custom", {**card.config, **fields})


def test_moe_layer_pattern_follows_mlp_only_layers_and_sparse_step():
    card = card_with("qwen3-moe-tiny", num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    assert config_of(card).moe_layer_freq == [0, 1, 0, 1, 0, 1]


def test_sliding_window_layers():
    card = card_with("qwen3-tiny", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    c = config_of(card)
    assert c.window_size == (7, 0) and c.window_attn_skip_freq == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "fields, error, message",
    [
        *[(dict(rope_scaling={"rope_type": kind, "factor": 4.0}), NotImplementedError,
            f"RoPE scaling '{kind}' is not supported; Qwen3 cards take plain RoPE or rope_type 'yarn'")
          for kind in ("linear", "dynamic", "llama3", "longrope")],
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), NotImplementedError,
         "RoPE scaling 'linear'"),
        (dict(rope_scaling={**YARN, "attention_factor": 1.2}), NotImplementedError,
         r"YaRN parameters \['attention_factor'\] are not supported"),
        (dict(hidden_act="gelu"), ValueError, "SwiGLU"),
        (dict(hidden_size=None), ValueError, "lacks the required field 'hidden_size'"),
    ],
)
def test_bad_cards(fields, error, message):
    card = card_with("qwen3-tiny", **fields)
    if fields.get("hidden_size", 0) is None:
        del card.config["hidden_size"]
    with pytest.raises(error, match=message):
        config_of(card)
        model_kwargs_of(card)


def test_hf_config_json_path(tmp_path):
    folder = tmp_path / "Qwen3-Tiny-Instruct"
    folder.mkdir()
    config = {k: v for k, v in load_card("qwen3-tiny").config.items() if k not in ("name", "source")}
    (folder / "config.json").write_text(json.dumps(config))
    card = load_card(folder / "config.json")
    assert card.name == "Qwen3-Tiny-Instruct" and card.config == config
    assert same_weights(build_model(str(folder / "config.json")), build_model("qwen3-tiny"))


def test_built_models_use_dualkv_attention_and_the_card_architecture():
    dense, moe = (build_model(card, use_transformer_engine=False) for card in ("qwen3-tiny", "qwen3-moe-tiny"))
    for model in (dense, moe):
        layers = model.decoder.layers
        assert len(layers) == 2
        assert all(type(layer.self_attention.core_attention) is DualKVAttention for layer in layers)
        assert isinstance(layers[0].input_layernorm, torch.nn.RMSNorm)
        assert isinstance(layers[0].self_attention.q_layernorm, torch.nn.RMSNorm)
        assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)
        assert model.output_layer.weight is not model.embedding.word_embeddings.weight
        assert all(p.dtype == torch.float32 for p in model.parameters())
    experts = moe.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "GroupedMMExperts" and len(experts.local_experts) == 8  # SequentialMLP's parameters
    assert moe.decoder.layers[0].mlp.router.topk == 2


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_same_seed_same_weights():
    a, b, c = build_model("qwen3-tiny", seed=3), build_model("qwen3-tiny", seed=3), build_model("qwen3-tiny", seed=4)
    assert same_weights(a, b) and not same_weights(a, c)


def test_overrides_and_dtype():
    model = build_model("qwen3-tiny", dtype=torch.bfloat16, num_layers=1, moe_aux_loss_coeff=0.0)
    assert len(model.decoder.layers) == 1 and model.output_layer.weight.dtype == torch.bfloat16
    assert model.config.bf16


def test_mixed_dense_and_moe_spec():
    # the built modules, not the spec: Megatron versions spell submodule specs differently
    model = build_model(card_with("qwen3-moe-tiny", num_hidden_layers=3, mlp_only_layers=[1]))
    layers = model.decoder.layers
    assert [isinstance(layer.mlp, MoELayer) for layer in layers] == [True, False, True]
    assert type(layers[1].mlp).__name__ == "MLP"
    assert all(type(layer.self_attention.core_attention) is DualKVAttention for layer in layers)


@pytest.mark.skipif(transformer_engine_available(), reason="checks the error without Transformer Engine")
def test_te_spec_needs_transformer_engine():
    with pytest.raises(ImportError, match="transformer_engine"):
        dualkv_te_block_spec(config_of("qwen3-tiny"))


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("no-such-model",), {}, ValueError, "unknown model card 'no-such-model'"),
        (("qwen3-tiny",), dict(num_layer=1), ValueError, "did you mean num_layers"),
        (("qwen3-tiny",), dict(tp=3), ValueError, r"num_attention_heads \(4\) must be a multiple of tensor_model_parallel_size \(3\)"),
        (("qwen3-tiny",), dict(tp=2), ValueError, "already initialised with ParallelSizes.tp=1"),
        (("qwen3-tiny",), dict(pp=2), ValueError, "already initialised with"),
        (("qwen3-tiny",), dict(cp=2), ValueError, "already initialised with"),
        (("qwen3-tiny",), dict(tp=0), ValueError, "tp must be a positive int"),
        (("qwen3-tiny",), dict(dtype=torch.int8), ValueError, "dtype must be one of"),
    ],
)
def test_bad_build_arguments(args, kwargs, error, message):
    build_model("qwen3-tiny")  # parallel state of this process: tp=1
    with pytest.raises(error, match=message):
        build_model(*args, **kwargs)


def test_dense_models_fuse_their_swiglu_on_gpu(monkeypatch):
    """The GPU config asks Megatron for its fused SwiGLU (where only the config can show it here);
    not for experts, nor for Gemma's GeGLU (GemmaMLP fuses that), nor on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not config_of("qwen3-tiny").bias_activation_fusion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert config_of("qwen3-tiny").bias_activation_fusion
    assert not config_of("qwen3-moe-tiny").bias_activation_fusion
    assert not config_of("gemma3-tiny").bias_activation_fusion
