"""What the Transformer Engine path decides without running TE (it needs CUDA): which layer spec
``build_model`` and the launch script choose, the clear errors for settings that cannot run, the
local-spec names of TE's tensors (HF conversion, ``export_hf_weights``, checkpoints), and what the
memory model counts for the TE spec and FP8. The TE layers themselves are tested against the
local spec on the GPU (``test_transformer_engine_gpu.py``)."""
from __future__ import annotations

import pytest
import torch

from megatron_dualkv.mcore import transformer_engine_available
from megatron_dualkv.mcore.parallel import ParallelSizes
from megatron_dualkv.memory import MemoryModel, layer_activation_bytes, layer_tensors
from megatron_dualkv.models import build_model
from megatron_dualkv.cli import FP8_CHOICES
from megatron_dualkv.models.builder import (
    FP8_FORMATS, fp8_config_kwargs, refuse_recompute_modules_the_spec_lacks, uses_transformer_engine,
)
from megatron_dualkv.models.family import local_spec_name, load_megatron_state_dict, local_spec_state_dict
from test_examples import SCRIPT, load, run

no_te = pytest.mark.skipif(transformer_engine_available() and torch.cuda.is_available(),
                           reason="Transformer Engine is there: the GPU module tests it")


@no_te
@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma4-tiny"])
def test_the_default_spec_is_the_local_one_without_transformer_engine(card):
    model = build_model(card)
    te_modules = [name for name, module in model.named_modules() if type(module).__module__.startswith("transformer_engine")
                  or "extensions.transformer_engine" in type(module).__module__]
    assert not te_modules
    assert uses_transformer_engine(None) is False


@no_te
@pytest.mark.parametrize("card", ["qwen3-tiny", "gemma3-tiny"])
def test_asking_for_transformer_engine_without_it_names_the_fix(card):
    with pytest.raises((ImportError, ValueError), match="Transformer Engine|transformer_engine"):
        build_model(card, use_transformer_engine=True)


@pytest.mark.parametrize("fp8, te, dtype, match", [
    ("e5m2", True, torch.bfloat16, r"fp8 must be one of \('e4m3', 'hybrid'\)"),
    ("e4m3", False, torch.bfloat16, "it needs the TE spec"),
])
def test_fp8_settings_that_cannot_run_name_the_field(fp8, te, dtype, match):
    with pytest.raises(ValueError, match=match):
        fp8_config_kwargs(fp8, te, dtype)


def test_a_recompute_module_the_te_spec_lacks_is_refused():
    layernorm = {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}
    with pytest.raises(ValueError, match=r"recompute_modules \['layernorm'\]: the Transformer Engine spec fuses"):
        refuse_recompute_modules_the_spec_lacks(layernorm, use_transformer_engine=True)
    refuse_recompute_modules_the_spec_lacks(layernorm, use_transformer_engine=False)  # the local spec's norms
    refuse_recompute_modules_the_spec_lacks({**layernorm, "recompute_norms": True}, use_transformer_engine=True)


def test_fp8_off_adds_nothing():
    assert fp8_config_kwargs(None, False, torch.float32) == {}


def test_the_flags_offer_the_builders_fp8_formats():
    assert FP8_CHOICES == FP8_FORMATS


@pytest.mark.parametrize("te_name, local_name", [
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.3.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_bias", "decoder.layers.0.pre_mlp_layernorm.bias"),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight12", "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight"),
    ("decoder.layers.1.mlp.experts.linear_fc2.weight0", "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"),
    # names both specs share stay as they are
    ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.weight"),
    ("decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.q_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.weight"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
])
def test_transformer_engine_names_map_to_the_local_spec(te_name, local_name):
    assert local_spec_name(te_name) == local_name
    assert local_spec_name(local_name) == local_name


class _FusedNormLinear(torch.nn.Module):
    """A module named as TE's LayerNormLinear names its parameters."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 2))
        self.layer_norm_weight = torch.nn.Parameter(torch.zeros(2))


def test_a_local_state_dict_loads_into_the_names_of_fused_norms():
    model = torch.nn.Module()
    model.linear_qkv = _FusedNormLinear()
    attention = torch.nn.Module()
    attention.self_attention = model
    layers = torch.nn.ModuleList([attention])
    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.layers = layers
    state = {"decoder.layers.0.input_layernorm.weight": torch.tensor([1.0, 2.0]),
             "decoder.layers.0.self_attention.linear_qkv.weight": torch.ones(3, 2)}
    load_megatron_state_dict(root, state)
    assert torch.equal(root.decoder.layers[0].self_attention.linear_qkv.layer_norm_weight, torch.tensor([1.0, 2.0]))
    assert set(local_spec_state_dict(root)) == set(state)
    with pytest.raises(ValueError, match="missing decoder.layers.0.self_attention.linear_qkv.weight"):
        load_megatron_state_dict(root, {"decoder.layers.0.input_layernorm.weight": torch.ones(2)})


def _bytes(tensors):
    return sum(t.elements * t.bytes_per_element for t in tensors)


def test_the_memory_model_counts_the_te_spec_like_the_local_one_for_dense_layers():
    config = MemoryModel.for_card("qwen3-4b").config
    assert layer_tensors(config, 1, transformer_engine=True) == layer_tensors(config, 1)


def test_fp8_keeps_one_byte_copies_of_the_linear_inputs_and_the_swiglu_input_whatever_the_recompute():
    config = MemoryModel.for_card("qwen3-4b").config
    h, f, heads_d = config.hidden_size, config.ffn_hidden_size, config.num_attention_heads * config.kv_channels
    bf16, fp8 = layer_tensors(config, 1), layer_tensors(config, 1, transformer_engine=True, fp8=True)
    # the two norm outputs, fc1's output (the SwiGLU's input, 2f) and the activation: 2 bytes -> 1;
    # plus linear_proj's copy of the attention output
    assert _bytes(bf16) - _bytes(fp8) == (2 * h + 2 * f + f) - heads_d

    def selective(fp8):
        return layer_activation_bytes(config, 1, ParallelSizes(), "selective", transformer_engine=True, fp8=fp8)

    # bytes: in bf16 selective recompute frees the norm outputs and the activation; under FP8 it
    # recomputes only q and k, their 1-byte copies stay (2h + f), fc1's output drops from 2 bytes
    # to 1 (2f) and linear_proj keeps its copy
    assert selective(False) - selective(True) == 2 * f - (2 * h + f) - heads_d


def test_fp8_keeps_geglus_input_in_bf16():
    config = MemoryModel.for_card("gemma3-4b").config
    h, f, heads_d = config.hidden_size, config.ffn_hidden_size, config.num_attention_heads * config.kv_channels
    bf16, fp8 = layer_tensors(config, 1), layer_tensors(config, 1, transformer_engine=True, fp8=True)
    assert _bytes(bf16) - _bytes(fp8) == (2 * h + f) - heads_d


def test_te_experts_keep_one_activation_where_ours_keep_three():
    config = MemoryModel.for_card("qwen3-30b-a3b").config
    k, f = config.moe_router_topk, config.moe_ffn_hidden_size
    assert _bytes(layer_tensors(config, 1)) - _bytes(layer_tensors(config, 1, transformer_engine=True)) == 2 * k * f * 2


def test_fp8_weights_are_kept_by_the_layers_that_are_not_recomputed_whole():
    bf16 = MemoryModel.for_card("qwen3-4b", transformer_engine=True)
    fp8 = MemoryModel.for_card("qwen3-4b", transformer_engine=True, fp8=True)
    c = fp8.config
    h, q, kv, f = c.hidden_size, c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels, c.ffn_hidden_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * f  # qkv, proj, fc1 (gate and up), fc2
    assert fp8.fp8_weight_bytes("selective") == 2 * layer * c.num_layers
    assert fp8.fp8_weight_bytes("selective", 5) == 2 * layer * (c.num_layers - 5)
    assert fp8.fp8_weight_bytes("full") == bf16.fp8_weight_bytes("none") == 0
    tokens = 8192
    extra = fp8.predict(tokens, recompute="selective").parts["activations"] - tokens * fp8.activation_bytes_per_token(
        "selective")
    assert extra == fp8.fp8_weight_bytes("selective")


@pytest.fixture(scope="module")
def script():
    return load(SCRIPT, "grpo_policy_update")


@pytest.mark.parametrize("flags, message", [
    (["--fp8", "e4m3", "--transformer-engine", "off"], r"--fp8 e4m3 runs Transformer Engine's linears in FP8: pass "
                                                       r"--transformer-engine on"),
    (["--fp8", "hybrid", "--dtype", "float32"], "--fp8 hybrid trains bf16 parameters with FP8 matmuls: pass --dtype bfloat16"),
])
def test_bad_transformer_engine_flags(script, capsys, flags, message):
    with pytest.raises(SystemExit):
        script.parse_args(flags)
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


@no_te
def test_the_first_line_names_the_spec(script):
    assert script.spec_name(script.parse_args([])) == "local"
    assert script.spec_name(script.parse_args(["--transformer-engine", "off"])) == "local"


@no_te
@pytest.mark.slow
def test_the_launch_script_refuses_transformer_engine_without_it_in_one_line():
    result = run(SCRIPT, "--transformer-engine", "on", "--steps", "1", expect_rc=2)
    assert result.stderr.strip().splitlines()[-1].startswith("error: --transformer-engine on: ")
    assert "Traceback" not in result.stderr


FP8_TOOL = SCRIPT.parents[1] / "tools" / "fp8_logprob_error.py"


@no_te
def test_the_fp8_tool_says_what_it_needs_in_one_line():
    out = run(str(FP8_TOOL), "--rollouts", str(SCRIPT.parent / "data" / "rollouts.jsonl"), expect_rc=2)
    assert out.stderr.strip() == "error: FP8 runs in Transformer Engine's linears: this needs CUDA and transformer_engine"


def test_the_fp8_tool_reports_absolute_and_signed_differences():
    tool = load(FP8_TOOL, "fp8_logprob_error")
    row = tool._row("m", "fp8 e4m3", torch.tensor([-1.0, -2.5, -0.5]), torch.tensor([-1.5, -2.0, -0.5]))
    assert row["tokens"] == 3 and row["max_abs"] == 0.5 and row["mean_signed"] == 0.0
    assert row["mean_abs"] == pytest.approx(1 / 3)
