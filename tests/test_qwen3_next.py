"""The Qwen3.5 hybrid family (``models.qwen3_next``, ``mcore.hybrid``, ``mcore.gated_delta_net``)
beyond what the shared tests check for every family (test_hf_state_dicts: transformers' log-probs
on the packed layout and the bitwise round trip; test_rl_trees: trees against each trajectory
alone; test_recompute; test_parallel: tp and pp on gloo): the replicated layout against the
packed one, the cost model's GDN count against the module's own weights, the launch script, and
the clear errors."""

import json

import pytest
import torch

from megatron_dualkv.models import ModelCard, build_model, load_card
from megatron_dualkv.models.builder import FAMILIES, uses_transformer_engine
from megatron_dualkv.planner import CostModel, gated_delta_net_token_flops
from megatron_dualkv.rl import GRPOLoss, forward_backward
from rollouts import rl_micro_batches
from test_examples import AGENT_EPISODES, ROOT, SCRIPT, load, long_group, number, train_in_process

CARD = "qwen3_5-tiny"
SHAPES = [[(6, [4, 1, 5]), (2, [3])]]


@pytest.fixture(scope="module")
def model():
    return build_model(CARD)


def _step(model, batches, layout):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, GRPOLoss(clip_eps=0.2, kl_coef=0.05), layout=layout)
    logprobs = torch.cat([lp for out in outputs for group in out.logprobs for lp in group])
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logprobs, grads


def test_the_replicated_layout_gives_the_packed_step(model):
    """Replicated: each [P][R_i] a batch row from zero state (no packed params); packed: each
    response from its prompt's conv tail and recurrent state. Log-probs and every gradient agree."""
    batches = rl_micro_batches(model, SHAPES)
    (packed_lp, packed), (replicated_lp, replicated) = _step(model, batches, "packed"), _step(model, batches, "replicated")
    torch.testing.assert_close(replicated_lp, packed_lp, rtol=0, atol=2e-6)
    assert packed.keys() == replicated.keys()
    for name, grad in packed.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(replicated[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_cost_model_counts_a_gdn_layer_per_token(model):
    """2 FLOPs a token per weight of every linear and of the conv (the modules' own tensors), the
    recurrence's 8 Dk Dv per value head; attention pairs in the full-attention layer only."""
    config, layers = model.config, model.decoder.layers
    gdn = layers[0].self_attention

    def matmul_flops(*modules):
        return 2 * sum(p.numel() for m in modules for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2)

    recurrence = 8 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    assert gated_delta_net_token_flops(config) == matmul_flops(gdn) + recurrence  # in_proj, out_proj, the conv
    kinds = config.layer_types
    attention = matmul_flops(layers[kinds.index("full_attention")].self_attention)
    expected = (kinds.count("linear_attention") * gated_delta_net_token_flops(config) + kinds.count("full_attention")
                * attention + sum(matmul_flops(layer.mlp) for layer in layers) + matmul_flops(model.output_layer))
    cost = CostModel.from_config(config, model.vocab_size)
    assert cost.token_flops == expected
    assert cost.pair_flops == kinds.count("full_attention") * 4 * config.num_attention_heads * config.kv_channels


def test_the_launch_script_trains_the_tiny_card(capsys):
    """On agent episodes: prefix trees, every GDN segment from its parent's state (rollout groups
    run in test_memory's test_the_launch_script_fits_a_gated_delta_net_model)."""
    script = load(SCRIPT, "grpo_policy_update")
    out, steps = train_in_process(script, capsys, "--model", CARD, "--steps", 1, "--rollouts",
                                  ROOT / "examples" / "data" / "agent_episodes.jsonl")
    assert f"model {CARD}" in out and "| spec local |" in out and list(steps) == [1]


def test_the_launch_script_holds_a_long_group_s_prompt_state(tmp_path, capsys):
    """A group over --max-tokens: prefix reuse (the default) runs its prompt once and hands each part
    the GDN layers' state and conv tail; the same step as sub-groups that each carry the prompt."""
    script = load(SCRIPT, "grpo_policy_update")
    rollouts = tmp_path / "ids.jsonl"
    rollouts.write_text(json.dumps(long_group(8)) + "\n")
    steps = {}
    for reuse, how in (("auto", "prefix reuse (its prompt runs once)"), ("off", "sub-groups (each carries its prompt)")):
        out, steps[reuse] = train_in_process(script, capsys, "--model", CARD, "--rollouts", rollouts, "--max-tokens", 48,
                                             "--global-batch-size", 1, "--steps", 1, "--loss", "grpo",
                                             "--prefix-reuse", reuse)
        assert f"in 2 micro-batches, as {how}" in out and list(steps[reuse]) == [1]
    assert number(steps["auto"][1], "margin") == pytest.approx(number(steps["off"][1], "margin"), abs=1e-5)


def test_the_launch_script_holds_the_shared_paths_of_split_trees(capsys):
    """Agent episodes over --max-tokens: each tree's shared path runs once and hands its parts the
    GDN layers' state and conv tail (--prefix-reuse on), or each part carries its path (off)."""
    script = load(SCRIPT, "grpo_policy_update")
    runs = {}
    for reuse, how in (("on", "prefix reuse (its shared path runs once)"), ("off", "parts (each carries its path)")):
        out, steps = train_in_process(script, capsys, "--model", CARD, "--rollouts", AGENT_EPISODES, "--loss", "dapo",
                                      "--global-batch-size", 2, "--steps", 1, "--max-tokens", 300, "--prefix-reuse", reuse)
        assert f"plan: 2 groups over --max-tokens 300 in 4 micro-batches, as {how}" in out
        runs[reuse] = steps[1]
    for key in ("loss", "margin", "ratio"):
        assert number(runs["on"], key) == pytest.approx(number(runs["off"], key), rel=1e-4, abs=1e-6), key


def test_bad_settings_name_what_is_wrong():
    card = load_card(CARD)
    family = FAMILIES[card.model_type]
    mamba = ModelCard("mamba-layer", {**card.config, "layer_types": ["linear_attention", "mamba", "linear_attention",
                                                                      "full_attention"]})
    with pytest.raises(ValueError, match=r"model card 'mamba-layer': unknown layer_types \['mamba'\]"):
        build_model(mamba)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) is not divisible by tp\*cp \(4\)"):
        build_model(CARD, cp=4)  # the attention layers' 4 heads would split
    with pytest.raises(ValueError, match="model_type 'qwen3_5_text' has no Transformer Engine spec yet"):
        uses_transformer_engine(True, family)
    assert uses_transformer_engine(None, family) is False  # the local spec, with or without TE installed
    uneven = ModelCard("uneven-gdn-heads", {**card.config, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"):
        build_model(uneven)
    yarn = ModelCard("yarn", {**card.config, "rope_parameters": {**card.config["rope_parameters"], "rope_type": "yarn",
                                                                 "factor": 4.0, "original_max_position_embeddings": 8}})
    for kwargs in (family.transformer_config_kwargs, family.gpt_model_kwargs):
        with pytest.raises(NotImplementedError, match="YaRN RoPE is supported for qwen3 and qwen3_moe cards, not for qwen3_5_text"):
            kwargs(yarn)


@pytest.mark.parametrize("released", [False, True], ids=["kept", "released"])
def test_the_gated_norm_keeps_only_its_inputs(model, released):
    """Its float32 chain (five value-sized float32 tensors a token) is recomputed in the backward,
    not kept: the forward saves the output o and the gate z alone, and the gradients are the plain
    chain's, bitwise; its output released after its consumer (selective recompute) too."""
    mixer = next(layer.self_attention for layer in model.decoder.layers if model.config.is_linear_attention(
        layer.layer_number))
    out, gate = (torch.randn(7, 4, mixer.value_dim, requires_grad=True) for _ in range(2))
    consumer = torch.nn.Linear(mixer.value_dim, 3)
    dy = torch.randn(7, 4, 3)

    def grads(lean: bool):
        for t in (out, gate, mixer.norm_weight, consumer.weight):
            t.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            normed, release = (mixer._gated_norm_kept_lean(out, gate, torch.float32) if lean
                               else (mixer._gated_norm(out, gate, torch.float32), None))
        y = consumer(normed)
        if lean and released:
            release(y)
            assert normed.untyped_storage().nbytes() == 0
        y.backward(dy)
        return saved, [t.grad.clone() for t in (out, gate, mixer.norm_weight, consumer.weight)]

    saved, got = grads(lean=True)
    parameters = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    kept = {t.untyped_storage().data_ptr() for t in saved} - parameters
    assert kept == {out.untyped_storage().data_ptr(), gate.untyped_storage().data_ptr()}
    for a, b in zip(got, grads(lean=False)[1]):
        assert torch.equal(a, b)


def test_fewer_layers_build_the_cards_first_layers():
    """num_layers=N (a probe's or a one-layer benchmark's model) keeps the card's first N layer types."""
    two = build_model(CARD, num_layers=2)
    assert two.config.layer_types == ("linear_attention", "linear_attention")
    last = build_model(CARD, num_layers=4, layer_types=("full_attention",) * 4)
    assert not last.config.is_linear_attention(1)
