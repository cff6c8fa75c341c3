"""The example scripts end to end (subprocesses, world size 1 unless noted): the GRPO/DAPO launch
script on the packed and replicated layouts, save then resume, token-id rollouts, and on two GPUs
the one-GPU steps at tp, pp, cp, dp or ep 2; the attention demo; the bundled tokenizer's
reproducibility; the launch script's input errors."""
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron_dualkv.models import build_model
from megatron_dualkv.rl import forward_logprobs
from rollouts import make_batch, max_abs_diff

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "grpo_policy_update.py"
STEP = re.compile(
    r"step\s+(?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>\S+) \| reward (?P<reward>\S+) \| margin (?P<margin>\S+) \| "
    r"clip (?P<clip>\S+) \| (?P<tokens_per_s>[\d,]+) tok/s \| rho (?P<rho>\S+) \| mb (?P<mb>\d+)x(?P<dp>\d+) \| "
    r"mem (?P<mem>\S+) GiB \| (?P<tflops>\S+) TFLOP/s \| MFU (?P<mfu>\S+) \| (?P<seconds>\S+) s"
)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(*args, expect_rc=0):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == expect_rc, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run_script(*args, ranks=1):
    """The script's stdout and its parsed step lines {step: fields}; ranks > 1 under torchrun."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks) if ranks > 1 else ()
    out = run(*launcher, SCRIPT, *args).stdout
    steps = {}
    for match in STEP.finditer(out):
        fields = {k: v for k, v in match.groupdict().items()}
        steps[int(fields.pop("step"))] = fields
    return out, steps


def save_weights(card: str, folder: Path, **build_kwargs) -> None:
    """A Megatron checkpoint folder of ``card`` with the random weights of ``build_model(card, **build_kwargs)``."""
    run("-c", "from megatron_dualkv.models import build_model, save_model; "
              f"save_model(build_model({card!r}, **{build_kwargs!r}), {card!r}, {str(folder)!r})")


def number(fields, key):
    return float(fields[key].replace(",", "").rstrip("%"))


@pytest.fixture(scope="module")
def dapo_runs(tmp_path_factory):
    """The same DAPO steps from the same weights (qwen3-tiny at seed 77) three ways: 3 packed steps
    from a converted Megatron checkpoint of those weights (``--model <folder>``, run at the default
    seed, so only loaded weights can match); 2 replicated steps from the card, saved; step 3 resumed."""
    converted = tmp_path_factory.mktemp("converted") / "qwen3-tiny-77"
    save_weights("qwen3-tiny", converted, seed=77)
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    straight = run_script("--model", converted, "--loss", "dapo", "--steps", 3)
    card = ("--model", "qwen3-tiny", "--seed", 77, "--loss", "dapo")
    replicated = run_script(*card, "--steps", 2, "--layout", "replicated", "--save", checkpoints)
    resumed = run_script(*card, "--steps", 3, "--load", checkpoints)
    return straight, replicated, resumed, checkpoints


def test_packed_run_logs_sane_numbers(dapo_runs):
    (out, steps), *_ = dapo_runs
    assert "model " in out and "qwen3-tiny-77" in out and "layout packed | loss dapo" in out and sorted(steps) == [1, 2, 3]
    for fields in steps.values():
        assert math.isfinite(number(fields, "loss")) and number(fields, "loss") != 0
        assert 0 <= number(fields, "reward") <= 1 and 0 <= number(fields, "clip") <= 1
        assert number(fields, "tokens_per_s") > 0 and number(fields, "tflops") > 0 and number(fields, "mem") > 0
        assert number(fields, "rho") > 2  # 4 to 16 responses share a prompt of ~135 tokens
        # MFU needs a GPU's measured matmul rate
        assert (fields["mfu"] != "n/a") == torch.cuda.is_available() and fields["dp"] == "1" and int(fields["mb"]) >= 1
    # the policy learns the rewards: rewarded responses gain log-probability over the others
    assert number(steps[3], "margin") > number(steps[1], "margin")


def test_replicated_layout_and_the_converted_checkpoint_give_the_same_steps(dapo_runs):
    (_, packed), (out, replicated), *_ = dapo_runs
    assert "layout replicated" in out and sorted(replicated) == [1, 2]
    for step in (1, 2):
        for key in ("loss", "margin", "reward", "rho"):
            assert number(replicated[step], key) == pytest.approx(number(packed[step], key), rel=1e-3, abs=1e-6), (step, key)


def test_resume_continues_from_the_checkpoint(dapo_runs):
    """Saved after step 2 (on the replicated layout: model and optimizer do not depend on it),
    resumed for step 3: the same step 3 as the run that never stopped."""
    (_, straight), (saved_out, _), (out, resumed), checkpoints = dapo_runs
    assert f"saved {checkpoints / 'iter_0000002'}" in saved_out
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "resumed at step 2" in out and sorted(resumed) == [3]
    for key in ("loss", "margin"):
        assert number(resumed[3], key) == pytest.approx(number(straight[3], key), rel=1e-4, abs=1e-7), key


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs")
def test_resume_into_another_expert_layout_is_refused(tmp_path):
    """Megatron's optimizer state is a different chain once experts are split: a clear error, not a KeyError."""
    run_script("--model", "qwen3-moe-tiny", "--steps", 1, "--save", tmp_path)
    result = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, SCRIPT,
                 "--model", "qwen3-moe-tiny", "--ep", 2, "--steps", 2, "--load", tmp_path, expect_rc=1)
    assert "saved with expert parallelism {'ep': 1, 'etp': 1}" in result.stdout + result.stderr


TWO_GPU_RUNS = {
    "tp2": ("qwen3-tiny", "--tp", 2),
    "pp2": ("qwen3-tiny", "--pp", 2),
    "cp2": ("qwen3-tiny", "--cp", 2),
    "dp2": ("qwen3-tiny", "--use-distributed-optimizer"),
    "ep2": ("qwen3-moe-tiny", "--ep", 2),
}


@pytest.fixture(scope="module")
def one_gpu_runs(tmp_path_factory):
    """Per card: a weights folder, and the script's 3 steps from it on one rank."""
    runs = {}
    for card in {card for card, *_ in TWO_GPU_RUNS.values()}:
        weights = tmp_path_factory.mktemp("weights") / card
        save_weights(card, weights)
        runs[card] = weights, run_script("--model", weights, "--steps", 3)[1]
    return runs


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL on two GPUs (tests/test_parallel.py checks these layouts exactly on gloo ranks)")
@pytest.mark.parametrize("name", TWO_GPU_RUNS)
def test_two_gpus_take_the_one_gpu_steps(one_gpu_runs, name):
    """The launch script under torchrun on two GPUs, from the same weights: the one-GPU run's steps
    (margins to bf16 rounding: the ranks reduce in another order)."""
    card, *flags = TWO_GPU_RUNS[name]
    weights, want = one_gpu_runs[card]
    out, got = run_script("--model", weights, "--steps", 3, *flags, ranks=2)
    assert "world 2" in out and sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert got[step]["reward"] == want[step]["reward"] and got[step]["rho"] == want[step]["rho"], step
        assert number(got[step], "margin") == pytest.approx(number(want[step], "margin"), abs=1e-3), step


def test_grpo_on_token_id_rollouts_splits_a_group_over_the_budget(tmp_path):
    rollouts = tmp_path / "ids.jsonl"
    groups = [  # 20 + 102 tokens: over a 64-token budget, so split into sub-groups carrying the prompt
        {"prompt": list(range(1, 21)), "responses": [[50 + i] * (3 + i) for i in range(12)], "rewards": [i % 2 for i in range(12)]},
        {"prompt": [7, 8, 9], "responses": [[10, 11], [12]], "rewards": [1.0, 0.0]},
    ]
    rollouts.write_text("".join(json.dumps(g) + "\n" for g in groups))
    out, steps = run_script("--rollouts", rollouts, "--global-batch-size", 2, "--max-tokens", 64, "--steps", 2, "--loss", "grpo")
    assert "2 rollout groups" in out and sorted(steps) == [1, 2]
    rollout_tokens, unsplit_tokens = 12 * 20 + 102 + 2 * 3 + 3, 20 + 102 + 3 + 3
    for fields in steps.values():
        # on-policy GRPO: ratio 1 and group-normalised advantages summing to 0 -> loss ~0
        assert abs(number(fields, "loss")) < 1e-5
        assert int(fields["mb"]) >= 3
        assert 1 < number(fields, "rho") < rollout_tokens / unsplit_tokens - 0.1  # the prompt is computed again per sub-group


def test_attention_demo_runs():
    out = run(ROOT / "examples" / "dualkv_attention_demo.py").stdout
    assert "token reduction rho" in out and "max |packed - replicated|" in out


def test_bundled_tokenizer_is_reproducible(tmp_path):
    """tools/make_sample_tokenizer.py retrains examples/data/tokenizer.model byte for byte (same SentencePiece)."""
    tool = load(ROOT / "tools" / "make_sample_tokenizer.py", "make_sample_tokenizer")
    model = tmp_path / "tokenizer.model"
    tool.train(tool.DATA / "corpus.txt", model)
    assert model.read_bytes() == (tool.DATA / "tokenizer.model").read_bytes()


@pytest.fixture(scope="module")
def script():
    return load(SCRIPT, "grpo_policy_update")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": [1], "responses": [[2]], "rewards": [1.0]}\n{"prompt": [1], oops}', r"ids.jsonl:2: not valid JSON"),
        ('{"prompt": [1], "responses": [[2]]}', r":1: expected an object with 'prompt', 'responses' and 'rewards'"),
        ('{"prompt": [1], "responses": [], "rewards": []}', r":1: 'responses' must be a non-empty list"),
        ('{"prompt": [1], "responses": [[2], [3]], "rewards": [1.0]}', r":1: 'rewards' must be a list of 2 numbers"),
        ('{"prompt": [1], "responses": [[2], [300]], "rewards": [1, 0]}', r":1: response 1: token id 300 is outside the model's vocabulary \(vocab_size 256\)"),
        ('{"prompt": [-1], "responses": [[2]], "rewards": [1]}', r":1: prompt: token id -1 is outside"),
        ('{"prompt": [1.5], "responses": [[2]], "rewards": [1]}', r":1: prompt: token ids must be integers"),
        ('{"prompt": [], "responses": [[2]], "rewards": [1]}', r":1: prompt: expected a non-empty list"),
        ('{"prompt": "text", "responses": [[2]], "rewards": [1]}', r":1: a text prompt needs text responses"),
        ("\n\n", r"no rollout groups"),
    ],
)
def test_malformed_rollouts_are_reported_with_their_line(script, tmp_path, line, message):
    path = tmp_path / "ids.jsonl"
    path.write_text(line)
    with pytest.raises(script.InputError, match=message):
        script.read_rollouts(path, 256, tokenizer_path=None)


def test_text_rollouts_need_a_tokenizer_that_fits_the_vocabulary(script, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text('{"prompt": "What is 2 + 2?", "responses": ["4", "5"], "rewards": [1, 0]}\n')
    with pytest.raises(script.InputError, match=r"text.jsonl:1: text rollouts need a SentencePiece model"):
        script.read_rollouts(path, 256, tokenizer_path=None)
    with pytest.raises(script.InputError, match=r"tokenizer not found"):
        script.read_rollouts(path, 256, tokenizer_path=tmp_path / "missing.model")
    with pytest.raises(script.InputError, match=r"has 256 pieces, more than the model's vocab_size 100"):
        script.read_rollouts(path, 100, tokenizer_path=script.DATA / "tokenizer.model")
    (group,) = script.read_rollouts(path, 256, tokenizer_path=script.DATA / "tokenizer.model")
    assert group.prompt[0] == 1 and all(r[-1] == 2 for r in group.responses)  # <s> prompt, response </s>
    assert group.rewards == [1.0, 0.0]


def test_bad_flags(script, tmp_path):
    with pytest.raises(SystemExit):
        script.parse_args(["--max-tokens", "0"])
    with pytest.raises(SystemExit):
        script.parse_args(["--rollouts", str(tmp_path / "missing.jsonl")])


@pytest.fixture(scope="module")
def bench(script):
    return load(ROOT / "tools" / "bench_policy_update.py", "bench_policy_update")


def test_bench_sdpa_baseline_equals_megatron_attention(bench, monkeypatch):
    """The GPU benchmark's replicated baseline (PyTorch SDPA core attention) computes what Megatron's
    DotProductAttention computes, and the packed path is untouched."""
    # the benchmark's cuDNN backend has no float32 kernel, and this check runs in float32
    monkeypatch.setitem(bench.SDPA_BACKENDS, "cuda", [SDPBackend.MATH])
    model = build_model("qwen3-tiny", seed=3)
    batch = make_batch()
    with torch.no_grad():
        megatron_attention = forward_logprobs(model, batch, layout="replicated")
        bench.use_sdpa_for_replicated(model)
        sdpa = forward_logprobs(model, batch, layout="replicated")
        packed = forward_logprobs(model, batch)
    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    assert cores and all(type(core) is bench.SDPAReplicatedAttention for core in cores)
    assert max_abs_diff(sdpa, megatron_attention) < 2e-6 and max_abs_diff(sdpa, packed) < 2e-6


def test_bench_halves_the_micro_batch_until_it_fits(bench, monkeypatch):
    """The GPU-only search for the largest micro-batch, with a step that runs out of memory above 4 responses."""
    calls = []

    def step(policy, groups, loss_fn, max_tokens, layout):
        calls.append(max_tokens)
        if max_tokens > 100 + 4 * 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return bench.policy_update.StepStats(
            loss=0.0, reward=0.5, margin=0.0, clip_fraction=0.0, rollout_tokens=16 * 110, rho=1.0, micro_batches=4,
            dp_size=1, flops=2e12, seconds=len(calls) / 10, peak_memory_gib=1.0,
        )

    monkeypatch.setattr(bench.policy_update, "policy_update_step", step)
    result = bench.bench_layout(None, None, "replicated", repeats=3, peak_tflops=10.0,
                                result=bench.Result("m", 1, n=16, p=100, r=10, layout="replicated"))
    assert calls == [260, 180, 140, 140, 140, 140]
    assert (result.micro_batch_responses, result.micro_batch_tokens, result.micro_batches) == (4, 4 * 110, 4)
    assert result.step_s == pytest.approx(0.5) and result.tflops == pytest.approx(4.0) and result.mfu == pytest.approx(0.4)


def test_bench_update_replaces_only_the_rows_of_the_models_measured(bench, tmp_path, capsys):
    """``--update``: the re-measured model's rows replace its old ones where they stood, a new
    model's rows go last, the others stay with the matmul rate of their own run; the CSV reads back."""
    def rows(model, step_s, peak):
        return [bench.Result(model, 4, 16, 8192, 1024, layout, 16, 24576, 1, step_s, 1e5, 300.0, 0.4, 80.0,
                             2.0 if layout == "packed" else float("nan"), peak) for layout in ("packed", "replicated")]

    old = rows("dense", 0.6, 781.5) + rows("moe", 0.5, 783.5)
    table = tmp_path / "policy_update_h200.csv"
    bench.write_csv(old, table)
    merged = bench.updated(bench.read_results(table), rows("moe", 0.4, 795.2) + rows("gemma", 0.9, 795.2))
    assert [(r.model, r.layout, r.step_s, r.matmul_peak_tflops) for r in merged] == [
        ("dense", "packed", 0.6, 781.5), ("dense", "replicated", 0.6, 781.5), ("moe", "packed", 0.4, 795.2),
        ("moe", "replicated", 0.4, 795.2), ("gemma", "packed", 0.9, 795.2), ("gemma", "replicated", 0.9, 795.2)]
    assert bench.read_results(table)[0] == old[0]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--update", str(tmp_path / "missing.csv")])
    assert "--update: " in capsys.readouterr().err


def test_bench_ops_times_the_same_math_in_each_method():
    """tools/bench_ops.py: each op's kernel and the PyTorch ops it is timed against give the same
    output and gradients (float32, a few rows; the interpreter on CPU)."""
    ops = load(ROOT / "tools" / "bench_ops.py", "bench_ops")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, op in ops.OPS.items():
        inputs = [x.float() for x in op.make(3, device)]
        dy = None
        results = []
        for method in ("ours", "torch"):
            leaves = [x.clone().requires_grad_() for x in inputs]
            out = ops.implementation(op, method)(*leaves)
            dy = torch.randn_like(out) if dy is None else dy
            results.append((out, *torch.autograd.grad(out, leaves, dy)))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


def test_bench_measures_each_model_in_a_process_of_its_own(bench, tmp_path, monkeypatch):
    """Two models: one run of the script per model with the same flags and ``--models`` of one,
    then one table of both models' rows."""
    runs = []

    def run(cmd, check):
        runs.append(cmd)
        flags = cmd[2:]
        out = Path(flags[flags.index("--out") + 1])
        name = flags[flags.index("--models") + 1]
        bench.write_csv([bench.Result(name, 2, 4, 32, 8, layout, step_s=0.1) for layout in ("packed", "replicated")],
                        out / "policy_update.csv")

    monkeypatch.setattr(bench.subprocess, "run", run)
    plotted = []
    monkeypatch.setattr(bench, "plot", lambda results, path, baseline: plotted.append(path))  # needs matplotlib
    bench.main(["--device", "cpu", "--tiny", "--repeats", "2", "--models", "moe,dense", "--out", str(tmp_path)])
    assert plotted == [tmp_path / "policy_update.png"]
    assert [cmd[1] for cmd in runs] == [bench.__file__] * 2
    assert [cmd[cmd.index("--models") + 1] for cmd in runs] == ["moe", "dense"]
    assert all({"--tiny", "--device", "cpu", "--repeats", "2"} <= set(cmd) for cmd in runs)
    assert [r.model for r in bench.read_results(tmp_path / "policy_update.csv")] == ["moe", "moe", "dense", "dense"]


@pytest.mark.parametrize("window", [None, 5])
def test_attention_bench_baselines_use_the_layouts_mask(window):
    """tools/bench_attention.py: FlexAttention's mask_mod is the layout's rule (depth 1 and trees),
    and SDPA's replicated sequences are the trajectories (each [P][R_i] at depth 1); small versions
    of the workloads, on the CPU. The issue's workloads have the shapes it asks for."""
    attention = load(ROOT / "tools" / "bench_attention.py", "bench_attention")
    for w in (attention.Workload("small", 3, 11, 7, 4, 2, 16, window),
              attention.TreeWorkload("small-tree", 9, ((3, 4), (2, 6), (2, 1)), 4, 2, 16, window)):
        layout = w.layout("cpu")
        T = layout.total_tokens
        i = torch.arange(T)
        assert torch.equal(attention.flex_mask_mod(layout, w.window)(0, 0, i[:, None], i[None, :]),
                           layout.dense_mask(w.window))
        index = w.replicated_index("cpu")
        assert torch.equal(layout.position_ids[index], torch.arange(index.shape[1]).expand_as(index))
        covered = torch.zeros(T, T, dtype=torch.bool)
        for row in index:
            covered[row[:, None], row[None, :]] = True
        assert torch.equal(covered & (i[None, :] <= i[:, None]), layout.dense_mask())  # each sequence causal
    trees = {w.name: attention.describe(w) for w in attention.WORKLOADS if isinstance(w, attention.TreeWorkload)}
    assert trees["d128-tree-agent"]["tokens"] == 4096 + 4 * 1024 + 8 * 3 * 1024
    assert trees["d128-tree-agent"]["replicated_tokens"] == 8 * (4096 + 4 * 1024)
    assert trees["d128-tree-search"]["segments"] == 1 + 84
    assert trees["d128-tree-16x8192x1024"]["tokens"] == 8192 + 16 * 1024
