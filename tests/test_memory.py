"""The memory model (megatron_dualkv.memory) against the models it describes: parameter counts of
built models, the pipeline split, the splits of tensor and context parallelism, and the choice of
recompute and micro-batch. What a layer keeps is measured on the GPU (tests/test_memory_gpu.py:
the CPU's attention and norms keep other tensors), and the peaks of whole steps by
tools/bench_policy_update.py --full-depth (docs/performance.md)."""
import json
from dataclasses import replace

import pytest
import torch

from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.memory import (
    GIB, MemoryModel, layer_activation_bytes, layer_modes, rank_parameters, stage_layers,
)
from megatron_dualkv.models import build_model

TINY_CARDS = ["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma4-tiny", "qwen3_5-tiny", "qwen3-next-tiny"]


@pytest.mark.parametrize("card", TINY_CARDS)
def test_parameter_counts_are_those_of_the_built_model(card):
    """Every family: attention with QK norms, MoE experts and router, Gemma's extra norms and its
    full-attention layers' own heads, keys as values, tied embeddings, the padded vocabulary, the
    hybrids' GDN layers, output gates and gated shared experts."""
    model = build_model(card, make_vocab_size_divisible_by=48)
    memory = MemoryModel.for_card(card, dtype=torch.float32, make_vocab_size_divisible_by=48)
    assert memory.vocab_size == model.vocab_size
    counts = rank_parameters(memory.config, memory.vocab_size, memory.tied, ParallelSizes())
    assert counts.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts.expert == experts


@pytest.mark.parametrize("card", ["qwen3-4b", "gemma3-4b"])
def test_full_size_cards_count_their_published_parameters(card):
    """4,022,468,096 (Qwen3-4B, tied) and 3,880,263,168 (Gemma 3 4B's text decoder, whose
    vocabulary of 262,208 is padded to 262,272 for Megatron)."""
    memory = MemoryModel.for_card(card, make_vocab_size_divisible_by=1)
    total = rank_parameters(memory.config, memory.vocab_size, memory.tied, ParallelSizes()).total
    assert total == {"qwen3-4b": 4_022_468_096, "gemma3-4b": 3_880_263_168}[card]


def test_a_gated_delta_net_card_counts_its_shapes():
    """Qwen3.5-4B's text model, from its card's shapes: 24 GDN layers (in_proj: q, k, v, z of 16 key
    heads and 32 value heads of 128, and b, a; the conv over q, k, v; A_log, dt_bias; the gated
    norm), 8 attention layers with an output gate (q_proj twice 16 x 256 rows), SwiGLU MLPs, a tied
    embedding."""
    h, f, vocab = 2560, 9216, 248320
    conv, values = 2 * 16 * 128 + 32 * 128, 32 * 128
    gdn = h * (conv + values + 2 * 32) + values * h + 4 * conv + 2 * 32 + 128
    attention = h * (2 * 16 * 256 + 2 * 4 * 256) + 16 * 256 * h + 2 * 256
    layer = 2 * h + 3 * h * f
    memory = MemoryModel.for_card("qwen3_5-4b", make_vocab_size_divisible_by=1)
    total = rank_parameters(memory.config, memory.vocab_size, memory.tied, ParallelSizes()).total
    assert total == 24 * gdn + 8 * attention + 32 * layer + vocab * h + h == 4_205_751_296


def test_a_gated_delta_net_layer_keeps_what_its_gpu_path_saves():
    """Bytes per token of qwen3_5-tiny's GDN layer (hidden 64, ffn 128; 2 key heads of 8, 4 value
    heads of 12, so 80 conv channels and 48 values), in bf16, summed tensor by tensor; and the
    MoE with a gated shared expert of qwen3-next-tiny's (4 experts of 32, top 2, shared 48)."""
    h, conv, values, value_heads, key_heads = 64, 80, 48, 4, 2
    mixer = (2 * conv  # the conv's input, all its kernels keep
             + 4 * 2 * value_heads  # beta and g, fp32
             + 2 * conv + 4 * (2 * key_heads + value_heads)  # the kernel's q, k, v; rstd of q and k, g's cumsum
             + 2 * 64 * value_heads  # A: a 64-entry row per token and value head, bf16
             + 2 * values + 2 * values  # o and z, the gated norm's inputs (its fp32 chain is recomputed)
             + 2 * values  # out_proj's input
             + 4 * 2)  # the input and pre-MLP norms' statistics
    norms = 2 * (4 * h)  # the input and pre-MLP norms' inputs and outputs
    mlp = 2 * (2 * 128) + 2 * 128  # fc1's output, the activation
    memory = MemoryModel.for_card("qwen3_5-tiny")
    assert memory.config.is_linear_attention(1)
    one = ParallelSizes()
    assert layer_activation_bytes(memory.config, 1, one, "none") == mixer + norms + mlp == 2632 - 2 * conv
    # selective frees the norm outputs and the activation, and of the mixer the gated norm's output
    assert layer_activation_bytes(memory.config, 1, one, "selective") == (
        mixer + norms + mlp - 2 * h - 2 * h - 2 * 128 - 2 * values)
    assert layer_activation_bytes(memory.config, 1, one, "full") == 2 * h
    moe = (4 * (4 + 10 * 2) + 2 * 2 * h + 2 * 2 * 2 * 32 + 2 * 3 * 2 * 32  # router, routed tokens, fc1, SwiGLU
           + 2 * 2 * 48 + 2 * 48 + 2 * (h + 1))  # the shared expert's fc1 and activation, its gate's factors
    next_tiny = MemoryModel.for_card("qwen3-next-tiny")
    assert layer_activation_bytes(next_tiny.config, 1, one, "none") == mixer + norms + moe


@pytest.mark.parametrize("num_layers, pp, vpp", [(62, 4, None), (60, 8, None), (36, 5, None), (8, 2, 2)])
def test_pipeline_stages_hold_every_layer_once(num_layers, pp, vpp):
    """Megatron's split, uneven stages included; a tied embedding has its copy on the last stage."""
    sizes = ParallelSizes(pp=pp, vpp=vpp)
    memory = MemoryModel.for_card("gemma3-27b", sizes, num_layers=num_layers)
    layers = [n for rank in range(pp) for vp in ([None] if vpp is None else range(vpp))
              for n in stage_layers(memory.config, rank, vp)]
    assert sorted(layers) == list(range(1, num_layers + 1))
    single = MemoryModel.for_card("gemma3-27b", num_layers=num_layers)
    one_rank = rank_parameters(single.config, single.vocab_size, single.tied, ParallelSizes()).total
    per_stage = sum(rank_parameters(memory.config, memory.vocab_size, memory.tied, sizes, r).total for r in range(pp))
    assert per_stage == one_rank + memory.vocab_size * memory.config.hidden_size


def test_recompute_modes_order_the_memory():
    memory = MemoryModel.for_card("qwen3-4b")

    def peaks(ladder):
        return [memory.predict(24576, 16384, mode, layers).total for mode, layers in ladder]

    assert peaks(memory.recompute_ladder(offload=False)) == sorted(peaks(memory.recompute_ladder(offload=False)),
                                                                   reverse=True)
    offloaded = [setting for setting in memory.recompute_ladder() if setting[0] == "offload"]
    assert [n for _, n in offloaded] == list(range(1, 36 // 3 + 1))
    assert peaks([("selective", None)] + offloaded) == sorted(peaks([("selective", None)] + offloaded), reverse=True)
    assert layer_modes("selective", 2, [5, 6, 7]) == ["full", "full", "selective"]
    assert layer_modes("full", 1, [5, 6]) == ["full", "none"]
    assert layer_modes("offload", 2, [5, 6, 7]) == ["host", "host", "selective"]


def test_fit_picks_the_least_recompute_and_the_most_tokens():
    memory = MemoryModel.for_card("qwen3-4b")
    tokens = 24576
    none, selective = (memory.predict(tokens, tokens, mode).total for mode in ("none", "selective"))
    fit = memory.fit((none + selective) / 2, tokens)
    assert (fit.recompute, fit.recompute_layers) == ("selective", None)
    assert fit.tokens >= tokens and memory.predict(fit.tokens, fit.tokens, "selective").total <= (none + selective) / 2
    assert memory.predict(fit.tokens + 64, fit.tokens + 64, "selective").total > (none + selective) / 2
    roomy = memory.fit(2 * none, tokens, multiple=64)
    assert (roomy.recompute, roomy.tokens % 64) == ("none", 0)
    pinned = memory.fit(2 * none, 1024, recompute="full")
    assert pinned.recompute == "full" and pinned.tokens > 10 * tokens
    with pytest.raises(ValueError, match=r"needs more than the memory budget of 50\.0 GiB"):
        memory.fit(50 * GIB, tokens)  # the weights and Adam alone take 67.5 GiB


def test_offloaded_layers_move_their_selective_activations_to_the_host():
    memory = MemoryModel.for_card("qwen3_5-4b")  # layers 1-3 of every 4 are GDN, the 4th attention
    tokens, layers = 24576, memory.config.num_layers
    selective, offloaded = (memory.predict(tokens, 16384, *setting) for setting in (("selective", None), ("offload", 8)))
    per_layer = [layer_activation_bytes(memory.config, n, ParallelSizes(), "selective") * tokens
                 for n in range(1, layers + 1)]
    assert offloaded.host == pytest.approx(sum(per_layer[:8]))
    assert offloaded.parts["activations"] == pytest.approx(selective.parts["activations"] - sum(per_layer[:8]))
    assert offloaded.parts["transient"] == selective.parts["transient"] and selective.host == 0
    assert [layer_activation_bytes(memory.config, n, ParallelSizes(), "host") for n in (1, 4)] == [0, 0]


def test_fit_offloads_before_it_recomputes_layers_whole_where_the_host_has_room():
    memory = MemoryModel.for_card("qwen3_5-4b")
    tokens, budget = 24576, 128 * GIB
    kept = replace(memory, offload=False).fit(budget, tokens, 16384 / tokens, host_budget_bytes=64 * GIB)
    fit = memory.fit(budget, tokens, 16384 / tokens, host_budget_bytes=64 * GIB)
    assert fit.recompute == "offload" and 1 <= fit.recompute_layers <= 32 // 3
    assert memory.predict(tokens, 16384, "offload", fit.recompute_layers - 1).total > budget
    assert (fit.layers_recomputed_whole(32, 1), "offloaded layer(s)" in fit.describe()) == (0, True)
    small_host = memory.fit(budget, tokens, 16384 / tokens, host_budget_bytes=GIB)
    assert small_host.recompute == "selective" and small_host.recompute_layers > fit.recompute_layers
    assert small_host.layers_recomputed_whole(32, 2) == 2 * small_host.recompute_layers
    assert (kept.recompute, kept.recompute_layers) == (small_host.recompute, small_host.recompute_layers)


def test_prefix_reuse_does_not_offload():
    memory = MemoryModel.for_card("qwen3_5-4b")
    fit = memory.fit(128 * GIB, 8192 + 8 * 1024, held_prompt_tokens=8192, host_budget_bytes=64 * GIB)
    assert fit.recompute != "offload"
    with pytest.raises(ValueError, match="prefix reuse does not run with offloaded layers"):
        memory.predict(8192 + 8 * 1024, recompute="offload", recompute_layers=2, held_prompt_tokens=8192)


def test_fit_searches_a_budget_whose_micro_batches_it_sizes_apart():
    """``micro_batch``: the budget fit searches (packed tokens) gives micro-batches of other sizes on
    the layout (here 4 replicated tokens and 1 predicting row per packed token): the peaks, the most
    budget and the error are those of the micro-batches."""
    memory = MemoryModel.for_card("qwen3-4b")
    as_replicated = dict(layout="replicated", micro_batch=lambda n: (4 * n, n))
    budget = memory.predict(4 * 6000, 6000, "selective", layout="replicated").total
    fit = memory.fit(budget, 2048, recompute="selective", **as_replicated)
    assert 6000 <= fit.tokens < 6016 and fit.micro_batch_tokens == 4 * fit.tokens
    assert fit.estimate.total == memory.predict(4 * fit.tokens, fit.tokens, "selective", layout="replicated").total
    assert memory.predict(4 * fit.tokens + 4, fit.tokens + 1, "selective", layout="replicated").total > budget
    assert "micro-batches planned with" in fit.describe() and "the largest" in fit.describe()
    with pytest.raises(ValueError, match=r"a micro-batch of 400,000 tokens on the replicated layout \(planned with 100,000\)"):
        memory.fit(budget, 100_000, recompute="selective", **as_replicated)


def test_pipeline_ranks_hold_the_micro_batches_in_flight():
    """1F1B: the first of 4 stages runs 4 forwards before its first backward; the last one 1."""
    memory = MemoryModel.for_card("qwen3-4b", ParallelSizes(pp=4))
    assert [memory.in_flight_micro_batches(8, r) for r in range(4)] == [4, 3, 2, 1]
    assert memory.in_flight_micro_batches(2, 0) == 2
    first, last = (memory.predict(8192, 4096, num_micro_batches=8, pp_rank=r) for r in (0, 3))
    assert first.parts["activations"] > 3 * last.parts["activations"]
    assert memory.peak(8192, 4096, num_micro_batches=8).total == max(
        memory.predict(8192, 4096, num_micro_batches=8, pp_rank=r).total for r in range(4))


def test_tensor_and_context_parallelism_split_the_activations():
    one = MemoryModel.for_card("qwen3-4b")
    split = MemoryModel.for_card("qwen3-4b", ParallelSizes(tp=2, cp=2))
    tokens = 32768
    ratio = split.predict(tokens, tokens).parts["activations"] / one.predict(tokens, tokens).parts["activations"]
    assert ratio == pytest.approx(0.25, rel=0.02)  # the RoPE table is not split by tp


def test_bad_settings_name_the_field():
    memory = MemoryModel.for_card("qwen3-tiny")
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory.predict(64, recompute="some")
    with pytest.raises(ValueError, match="recompute_layers"):
        memory.predict(64, recompute="none", recompute_layers=1)
    with pytest.raises(ValueError, match="more than the 2 layers of a pipeline stage"):
        memory.predict(64, recompute="selective", recompute_layers=3)


def test_the_planning_table_fits_every_layout(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "plan_memory.py"
    spec = importlib.util.spec_from_file_location("plan_memory", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    budget = 100 * GIB
    row = tool.plan("qwen3-30b-a3b", "1x2x4x1", 8, (16, 8192, 1024), budget, 8, host_budget=64 * GIB)
    assert row["layout"] == "tp1 pp2 ep4 cp1 dp4" and row["tokens"] >= 8192 + 16 * 1024
    assert row["peak"] * GIB <= budget
    # the host budget is the table's (--host-gib), not this machine's: offloaded layers where it has room
    offloaded, kept = (tool.plan("qwen3-30b-a3b", "2x1x4x1", 8, (16, 8192, 1024), 0.92 * tool.H200_GIB * GIB, 8,
                                 host_budget=host * GIB) for host in (64, 0))
    assert offloaded["recompute"].startswith("offload+") and kept["recompute"].startswith("selective+")
    tool.main(["--card", "qwen3-4b", "--layouts", "1x1x1x1", "--gpus", "1"])
    assert "qwen3-4b" in capsys.readouterr().out

    # --prefix-reuse on a tiny card: a budget under which the whole group needs full recompute
    group, budget = (4, 96, 24), 2.8e6
    row = tool.plan_prefix_reuse("qwen3-tiny", "1x1x1x1", 1, group, budget, 1, host_budget=0.0)
    assert row["whole"].startswith("full, ")
    # the least recompute first: parts of one response need none, with the prompt held or not
    memory = MemoryModel.for_card("qwen3-tiny")
    assert memory.peak(96 + 2 * 24, 2 * 24, "none", held_prompt_tokens=96).total > budget
    assert memory.peak(96 + 24, 24, "none", held_prompt_tokens=96).total <= budget
    assert row["sub_groups"].startswith("none, 1 resp, ") and row["reuse"].startswith("none, 1 resp, ")
    assert tool.plan_prefix_reuse("qwen3-tiny", "1x2x1x1", 2, group, 1e-3 * GIB, 1, host_budget=0.0) == dict(
        card="qwen3-tiny", layout="tp1 pp2 ep1 cp1 dp1", whole="does not fit", sub_groups="does not fit",
        reuse="does not fit")

def test_the_launch_script_fits_a_gated_delta_net_model(tmp_path, monkeypatch, capsys):
    """--recompute auto --max-tokens auto on Qwen3.5 (GDN layers), one step on the CPU: the device's
    memory is stood in for by a budget between the peaks of selective and no recompute at the
    largest group, so the script picks selective and the most tokens that fit it."""
    from test_examples import SCRIPT, load

    script = load(SCRIPT, "grpo_policy_update")
    rollouts = tmp_path / "ids.jsonl"
    groups = [{"prompt": list(range(1, 13)), "responses": [[20 + i] * (2 + i) for i in range(4)], "rewards": [0, 1, 0, 1]},
              {"prompt": [7, 8, 9], "responses": [[10, 11], [12]], "rewards": [1.0, 0.0]}]
    rollouts.write_text("".join(json.dumps(g) + "\n" for g in groups))
    whole = 12 + 2 + 3 + 4 + 5
    memory = MemoryModel.for_card("qwen3_5-tiny", dtype=torch.float32)
    budget = sum(memory.predict(whole, whole, mode).total for mode in ("none", "selective")) / 2

    def fit_to_memory(args, groups):
        args.memory_margin = 0.08
        return script.fit_within(args, groups, budget)

    monkeypatch.setattr(script, "fit_to_memory", fit_to_memory)
    monkeypatch.setattr(script, "device_budget", lambda margin: budget)
    args = script.parse_args(["--model", "qwen3_5-tiny", "--rollouts", str(rollouts), "--global-batch-size", "2",
                              "--recompute", "auto", "--max-tokens", "auto", "--steps", "1"])
    script.train(args)
    out = capsys.readouterr().out
    assert "memory: layout packed, recompute selective, micro-batch" in out and "step    1/1" in out
    assert (args.recompute, args.recompute_layers) == ("selective", None) and args.max_tokens >= whole
