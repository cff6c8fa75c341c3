"""The example scripts end to end (subprocesses, world size 1 unless noted): the GRPO/DAPO launch
script on the packed and replicated layouts with PPO mini-batches and an LR schedule, save then
resume, token-id rollouts, a run of the whole RL loop (chat rollouts through a Hugging Face
tokenizer, rollout log-probs with truncated importance sampling, a reference policy, dual clip,
TensorBoard and JSONL logs, tools/plot_run.py) against an independent forward of its models, and
on two GPUs the one-GPU steps at tp, pp, cp, dp or ep 2; the attention demo; the bundled
tokenizer's reproducibility; in-process, the steps' ratios and the launch script's input errors."""
import dataclasses
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_dualkv import (CostModel, RolloutGroup, dualkv_attn_func, held_path_len, pack_groups, pack_trajectories,
                             plan_micro_batches)
from megatron_dualkv.layout import causal_pairs
from megatron_dualkv.memory import GIB, MemoryModel
from megatron_dualkv.models import build_model, load_model
from megatron_dualkv.rl import ResponseTokens, RLMicroBatch, forward_backward, forward_logprobs, plan_mini_batches
from megatron_dualkv.rollout_io import read_rollouts
from rollouts import make_groups, make_hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "grpo_policy_update.py"
STEP = re.compile(
    r"step\s+(?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>\S+) \| reward (?P<reward>\S+) \| margin (?P<margin>\S+) \| "
    r"clip (?P<clip>\S+) \| (?P<tokens_per_s>[\d,]+) tok/s \| rho (?P<rho>\S+) \| mb (?P<mb>\d+)x(?P<dp>\d+) \| "
    r"mem (?P<mem>\S+) GiB \| (?P<tflops>\S+) TFLOP/s \| MFU (?P<mfu>\S+) \| (?P<seconds>\S+) s"
    r"(?: \| lr (?P<lr>\S+) \| ratio (?P<ratio>\S+))?(?: \| dual-clip (?P<dual_clip>\S+))?(?: \| kl (?P<kl>\S+))?"
    r"(?: \| entropy (?P<entropy>\S+))?(?: \| mismatch (?P<mismatch>\S+))?"
)
UPDATE = re.compile(
    r"update\s+(?P<step>\d+)\.(?P<update>\d+)/(?P<steps>\d+) \| epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| "
    r"mini-batch (?P<mini_batch>\d+)/(?P<mini_batches>\d+) \| loss (?P<loss>\S+) \| ratio (?P<ratio>\S+) \| "
    r"clip (?P<clip>\S+)(?: \| dual-clip (?P<dual_clip>\S+))?(?: \| kl (?P<kl>\S+))?(?: \| mismatch (?P<mismatch>\S+))? \| "
    r"(?P<seconds>\S+) s"
)
# the DAPO runs' schedule: several updates per step, a learning rate that changes every step
PPO_FLAGS = ("--mini-batches", 2, "--lr-decay-style", "cosine", "--lr-decay-steps", 4, "--min-lr", 1e-4)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run(*args, expect_rc=0):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == expect_rc, result.stdout[-3000:] + result.stderr[-3000:]
    if SCRIPT in args and "--verbose" not in args:  # Megatron-Core's expected notices stay hidden
        assert "Transformer Engine and Apex are not installed" not in result.stderr, result.stderr[-3000:]
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


def train_in_process(script, capsys, *args):
    """``run_script`` of one rank in this process (no interpreter start or imports: seconds saved per
    run): the script's stdout and its parsed step lines."""
    script.train(script.parse_args([str(a) for a in args]))
    out = capsys.readouterr().out
    return out, {int(m["step"]): {k: v for k, v in m.groupdict().items() if k != "step"} for m in STEP.finditer(out)}


def update_lines(out):
    """The script's update lines: {(step, update): fields}."""
    return {(int(m["step"]), int(m["update"])): m.groupdict() for m in UPDATE.finditer(out)}


def save_weights(card: str, folder: Path, **build_kwargs) -> None:
    """A Megatron checkpoint folder of ``card`` with the random weights of ``build_model(card, **build_kwargs)``."""
    run("-c", "from megatron_dualkv.models import build_model, save_model; "
              f"save_model(build_model({card!r}, **{build_kwargs!r}), {card!r}, {str(folder)!r})")


def number(fields, key):
    return float(fields[key].replace(",", "").rstrip("%"))


@pytest.fixture(scope="module")
def weights_77(tmp_path_factory):
    """A converted Megatron checkpoint of qwen3-tiny's random weights at seed 77."""
    converted = tmp_path_factory.mktemp("converted") / "qwen3-tiny-77"
    save_weights("qwen3-tiny", converted, seed=77)
    return converted


@pytest.fixture(scope="module")
def dapo_runs(tmp_path_factory, weights_77):
    """The same DAPO steps (2 mini-batches a step, cosine LR) from the same weights (qwen3-tiny at
    seed 77) three ways: 3 packed steps from a converted Megatron checkpoint of those weights
    (``--model <folder>``, run at the default seed, so only loaded weights can match); 2 replicated
    steps from the card, saved; step 3 resumed."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    straight = run_script("--model", weights_77, "--loss", "dapo", "--steps", 3, *PPO_FLAGS)
    card = ("--model", "qwen3-tiny", "--seed", 77, "--loss", "dapo", *PPO_FLAGS)
    replicated = run_script(*card, "--steps", 2, "--layout", "replicated", "--save", checkpoints)
    resumed = run_script(*card, "--steps", 3, "--load", checkpoints)
    return straight, replicated, resumed, checkpoints


def test_packed_run_logs_sane_numbers(dapo_runs):
    (out, steps), *_ = dapo_runs
    assert "model " in out and "qwen3-tiny-77" in out and "layout packed | loss dapo" in out and sorted(steps) == [1, 2, 3]
    assert "| 2 mini-batches x 1 epochs" in out
    for fields in steps.values():
        assert math.isfinite(number(fields, "loss")) and number(fields, "loss") != 0
        assert 0 <= number(fields, "reward") <= 1 and 0 <= number(fields, "clip") <= 1
        assert number(fields, "tokens_per_s") > 0 and number(fields, "tflops") > 0 and number(fields, "mem") > 0
        assert number(fields, "rho") > 2  # 4 to 16 responses share a prompt of ~135 tokens
        # MFU needs a GPU's measured matmul rate
        assert (fields["mfu"] != "n/a") == torch.cuda.is_available() and fields["dp"] == "1" and int(fields["mb"]) >= 2
        assert 5 < number(fields, "entropy") < math.log(256) and fields["kl"] is None and fields["dual_clip"] is None
    # the policy learns the rewards: rewarded responses gain log-probability over the others
    assert number(steps[3], "margin") > number(steps[1], "margin")
    updates = update_lines(out)
    assert sorted(updates) == [(step, k) for step in (1, 2, 3) for k in (1, 2)]
    for step in (1, 2, 3):  # the second mini-batch's behaviour log-probs are from before the first update
        assert number(updates[step, 1], "ratio") == pytest.approx(1.0, abs=1e-4) != number(updates[step, 2], "ratio")
        mean = (number(updates[step, 1], "loss") + number(updates[step, 2], "loss")) / 2
        assert number(steps[step], "loss") == pytest.approx(mean, rel=1e-3, abs=1e-7)


def test_learning_rate_follows_megatrons_cosine_schedule(dapo_runs):
    """lr(s) = min + (max - min) (1 + cos(pi (s - 1) / 4)) / 2 for the step s, by its own formula:
    the scheduler steps once per step, after the step's updates."""
    (_, straight), *_ = dapo_runs
    for step in (1, 2, 3):
        want = 1e-4 + (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 1) / 4)) / 2
        assert number(straight[step], "lr") == pytest.approx(want, rel=1e-3), step


def test_replicated_layout_and_the_converted_checkpoint_give_the_same_steps(dapo_runs):
    (_, packed), (out, replicated), *_ = dapo_runs
    assert "layout replicated" in out and sorted(replicated) == [1, 2]
    for step in (1, 2):
        for key in ("loss", "margin", "reward", "rho", "ratio", "lr"):
            assert number(replicated[step], key) == pytest.approx(number(packed[step], key), rel=1e-3, abs=1e-6), (step, key)


def test_resume_continues_from_the_checkpoint(dapo_runs):
    """Saved after step 2 (on the replicated layout: model and optimizer do not depend on it),
    resumed for step 3: the same step 3, learning rate included, as the run that never stopped."""
    (_, straight), (saved_out, _), (out, resumed), checkpoints = dapo_runs
    assert f"saved {checkpoints / 'iter_0000002'}" in saved_out
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "resumed at step 2" in out and sorted(resumed) == [3]
    for key in ("loss", "margin", "lr", "ratio"):
        assert number(resumed[3], key) == pytest.approx(number(straight[3], key), rel=1e-4, abs=1e-7), key


def test_resume_restores_the_schedule_and_refuses_another(script, dapo_runs):
    """In this process: the checkpoint after step 2 puts the scheduler at 2 steps (the learning rate
    of step 3 now, of step 4 after the next scheduler step); other schedule flags are refused."""
    *_, checkpoints = dapo_runs
    flags = ["--seed", "77", "--load", str(checkpoints), *map(str, PPO_FLAGS)]
    policy = script.build_policy(script.parse_args(flags))
    assert script.load_checkpoint(checkpoints, policy) == 2 and policy.scheduler.num_steps == 2
    policy.scheduler.step(1)
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 + (1e-3 - 1e-4) * (1 + math.cos(math.pi * 3 / 4)) / 2)
    other = ["--seed", "77", "--lr-decay-style", "linear", "--load", str(checkpoints), *map(str, PPO_FLAGS[:2])]
    policy = script.build_policy(script.parse_args(other))  # the decay length comes from the checkpoint: 4 steps
    assert policy.scheduler.lr_decay_steps == 4
    with pytest.raises(script.InputError, match=r"another learning-rate schedule: this run has --min-lr 0.0 \(checkpoint: "
                                                r"0.0001\), --lr-decay-style linear \(checkpoint: cosine\); resume with"):
        script.load_checkpoint(checkpoints, policy)


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
    "hybrid_cp2": ("qwen3_5-tiny", "--cp", 2),
}


def one_gpu_steps(tmp_path_factory, *flags):
    """Per card of ``TWO_GPU_RUNS``: a weights folder, and the script's 3 steps from it on one rank with ``flags``."""
    runs = {}
    for card in {card for card, *_ in TWO_GPU_RUNS.values()}:
        weights = tmp_path_factory.mktemp("weights") / card
        save_weights(card, weights)
        runs[card] = weights, run_script("--model", weights, "--steps", 3, *flags)[1]
    return runs


def assert_two_gpus_take_the_steps(name, one_gpu_runs, *flags):
    """The launch script under torchrun on two GPUs with ``flags`` and ``TWO_GPU_RUNS[name]``'s, from
    the same weights: the one-GPU run's steps (margins to rounding: the ranks reduce in another
    order). Returns the run's stdout."""
    card, *layout = TWO_GPU_RUNS[name]
    weights, want = one_gpu_runs[card]
    out, got = run_script("--model", weights, "--steps", 3, *flags, *layout, ranks=2)
    assert "world 2" in out and sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert got[step]["reward"] == want[step]["reward"] and got[step]["rho"] == want[step]["rho"], step
        assert number(got[step], "margin") == pytest.approx(number(want[step], "margin"), abs=1e-3), step
    return out


@pytest.fixture(scope="module")
def one_gpu_runs(tmp_path_factory):
    return one_gpu_steps(tmp_path_factory)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL on two GPUs (tests/test_parallel.py checks these layouts exactly on gloo ranks)")
@pytest.mark.parametrize("name", TWO_GPU_RUNS)
def test_two_gpus_take_the_one_gpu_steps(one_gpu_runs, name):
    assert_two_gpus_take_the_steps(name, one_gpu_runs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL on two GPUs (test_parallel checks PPO mini-batches at dp 2 on gloo)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_take_the_one_gpu_ppo_updates(one_gpu_runs, dtype):
    """Mini-batches, epochs, dual clip, a reference policy and a cosine schedule at dp 2 (NCCL),
    from the same weights: the one-GPU run's steps and updates (bf16: a reference in bf16 too)."""
    weights, _ = one_gpu_runs["qwen3-tiny"]
    flags = ("--model", weights, "--dtype", dtype, "--steps", 2, "--mini-batches", 2, "--ppo-epochs", 2, "--clip-ratio-c", 3,
             "--ref-load", weights, "--kl-coef", 0.05, "--lr-decay-style", "cosine", "--lr", 1e-2)
    one_out, want = run_script(*flags)
    out, got = run_script(*flags, ranks=2)
    tolerance = 1e-3 if dtype == "float32" else 2e-2
    assert "world 2" in out and sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        assert got[step]["reward"] == want[step]["reward"] and got[step]["lr"] == want[step]["lr"], step
        for key in ("margin", "ratio", "kl", "clip"):
            assert number(got[step], key) == pytest.approx(number(want[step], key), abs=tolerance), (step, key)
    got_updates, want_updates = update_lines(out), update_lines(one_out)
    assert sorted(got_updates) == sorted(want_updates) and len(got_updates) == 8
    for key, fields in want_updates.items():
        assert number(got_updates[key], "ratio") == pytest.approx(number(fields, "ratio"), abs=tolerance), key


def long_group(responses: int) -> dict:
    """A token-id rollout group: a 20-token prompt and ``responses`` responses of 3, 4, ... tokens."""
    return {"prompt": list(range(1, 21)), "responses": [[50 + i] * (3 + i) for i in range(responses)],
            "rewards": [i % 2 for i in range(responses)]}


def test_grpo_on_token_id_rollouts_splits_a_group_over_the_budget(tmp_path):
    """A group over --max-tokens: prefix reuse (the default where it runs) computes its prompt once,
    sub-groups (--prefix-reuse off) once each; the same steps either way, and at cp=2 and at pp=2."""
    rollouts = tmp_path / "ids.jsonl"
    groups = [  # 20 + 102 tokens: over a 64-token budget, so split
        long_group(12),
        {"prompt": [7, 8, 9], "responses": [[10, 11], [12]], "rewards": [1.0, 0.0]},
    ]
    rollouts.write_text("".join(json.dumps(g) + "\n" for g in groups))
    rollout_tokens, unsplit_tokens = 12 * 20 + 102 + 2 * 3 + 3, 20 + 102 + 3 + 3
    runs = {}
    for reuse in ("auto", "off"):
        out, steps = run_script("--rollouts", rollouts, "--global-batch-size", 2, "--max-tokens", 64, "--steps", 2,
                                "--loss", "grpo", "--prefix-reuse", reuse)
        assert "2 rollout groups" in out and sorted(steps) == [1, 2]
        how = "prefix reuse (its prompt runs once)" if reuse == "auto" else "sub-groups (each carries its prompt)"
        assert f"plan: 1 group over --max-tokens 64 in 3 micro-batches, as {how}" in out
        for fields in steps.values():
            # on-policy GRPO: ratio 1 and group-normalised advantages summing to 0 -> loss ~0
            assert abs(number(fields, "loss")) < 1e-5
            assert int(fields["mb"]) >= 3
            if reuse == "auto":
                assert number(fields, "rho") == pytest.approx(rollout_tokens / unsplit_tokens, abs=0.01)
            else:  # the prompt is computed again per sub-group
                assert 1 < number(fields, "rho") < rollout_tokens / unsplit_tokens - 0.1
        runs[reuse] = steps
    for step in (1, 2):
        assert number(runs["auto"][step], "margin") == pytest.approx(number(runs["off"][step], "margin"), abs=1e-4)
    # Ulysses CP: each rank holds its heads' prompt K/V, the same steps
    out, steps = run_script("--rollouts", rollouts, "--global-batch-size", 2, "--max-tokens", 64, "--steps", 2,
                            "--loss", "grpo", "--cp", 2, ranks=2)
    assert "as prefix reuse (its prompt runs once)" in out and sorted(steps) == [1, 2]
    for step in (1, 2):
        assert number(steps[step], "margin") == pytest.approx(number(runs["auto"][step], "margin"), abs=1e-4)
    # PP: each stage holds its layers' prompt K/V; the sub-groups' steps at pp=2 (its second stage
    # draws its random layers from another seed than one process)
    pipelined = {}
    for reuse in ("auto", "off"):
        out, pipelined[reuse] = run_script("--rollouts", rollouts, "--global-batch-size", 2, "--max-tokens", 64,
                                           "--steps", 2, "--loss", "grpo", "--prefix-reuse", reuse, "--pp", 2, ranks=2)
        assert sorted(pipelined[reuse]) == [1, 2] and ("prefix reuse (its prompt" in out) == (reuse == "auto")
    for step in (1, 2):
        assert number(pipelined["auto"][step], "margin") == pytest.approx(number(pipelined["off"][step], "margin"),
                                                                          abs=1e-4)


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
    "flags, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--rollouts", "missing.jsonl"], "--rollouts: file not found: missing.jsonl"),
        (["--mini-batches", "3"], "--global-batch-size 8 does not split into --mini-batches 3 of equal size"),
        (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1"),
        (["--tis-cap", "0"], r"--tis-cap must be > 0 \(the cap C of the importance weight min\(pi_old / pi_rollout, C\)\), got 0.0"),
        (["--tis-cap", "-2"], "--tis-cap must be > 0"),
        (["--clip-ratio-c", "1"], "--clip-ratio-c must be > 1"),
        (["--kl-coef", "0.1"], r"--kl-coef needs a reference policy \(--ref-load\)"),
        (["--ref-load", "missing"], "--ref-load: not a checkpoint folder: missing"),
        (["--min-lr", "0.1"], "--min-lr must be between 0 and --lr 0.001, got 0.1"),
        (["--lr-warmup-steps", "4", "--lr-decay-steps", "4"], r"--lr-decay-steps \(4\) must be larger than --lr-warmup-steps \(4\)"),
        (["--tp", "2"], r"^error: --tp 2: a model replica spans 2 processes, and this run has 1; launch a multiple of 2, "
                        r"e.g. torchrun --nproc-per-node 2 "),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--fp8", "e4m3", "--recompute", "offload", "--recompute-layers", "1"],
         r"--recompute offload does not run with --fp8 e4m3 \(each micro-batch's FP8 copies"),
        (["--no-offload"], r"--no-offload is for --recompute auto, which may otherwise offload layers \(--recompute none "
                           r"offloads none\)"),
        (["--model", "qwen3-huge"], r"--model qwen3-huge: not a card name \(.*qwen3-tiny.*\), card file or checkpoint folder"),
        (["--tokenizer", ""], r"--tokenizer: an empty path; pass a SentencePiece .model"),
        (["--loss", "ppo"], r"^error: argument --loss: invalid choice: 'ppo'"),
    ],
)
def test_bad_flags(script, capsys, flags, message):
    with pytest.raises(SystemExit):
        script.parse_args(flags)
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err  # one line, no usage block


def test_flags_are_checked_against_the_world_that_torchrun_started(script, capsys, monkeypatch):
    """--tp 2 --pp 2 on 8 processes (two replicas); on 6 an error, printed by rank 0 only."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert script.parse_args(["--tp", "2", "--pp", "2"]).tp == 2
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr("megatron_dualkv.cli.RANK0_GRACE_S", 0)
    for rank, printed in (("0", "error: --tp 2 --pp 2: a model replica spans 4 processes, and this run has 6;"),
                          ("3", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit:
            script.parse_args(["--tp", "2", "--pp", "2"])
        assert exit.value.code == 2 and capsys.readouterr().err.startswith(printed)


def test_text_rollouts_take_the_models_own_tokenizer(script, tmp_path):
    """--tokenizer; else --model's folder's (a converted checkpoint's, a config.json's); else the
    bundled sample tokenizer for the bundled rollouts only; else none."""
    ours = tmp_path / "rollouts.jsonl"
    ours.write_text("")
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text((ROOT / "models" / "qwen3-tiny.json").read_text())

    def chosen(*flags):
        return script.rollout_tokenizer(script.parse_args(list(map(str, flags))))

    assert chosen() == script.SAMPLE_TOKENIZER == ROOT / "examples" / "data" / "tokenizer.model"
    assert chosen("--rollouts", ROOT / "examples" / "data" / "agent_episodes.jsonl") == script.SAMPLE_TOKENIZER
    assert chosen("--rollouts", ours) is None
    assert chosen("--rollouts", ours, "--model", folder) is None  # the folder holds no tokenizer
    (folder / "tokenizer.json").write_text("{}")
    assert chosen("--rollouts", ours, "--model", folder) == folder
    assert chosen("--rollouts", ours, "--model", folder / "config.json") == folder
    assert chosen("--model", folder) == folder
    assert chosen("--model", folder, "--tokenizer", tmp_path / "t.model") == tmp_path / "t.model"


def test_a_real_model_refuses_the_sample_tokenizer(script):
    args = script.parse_args(["--model", "qwen3-4b"])
    with pytest.raises(script.RolloutFileError, match=r"tokenizer .*tokenizer.model has 256 tokens, the model's "
                                                      r"vocabulary 151,936: it is another model's tokenizer"):
        script.read_run_rollouts(args, 151_936)


def test_a_token_budget_below_the_longest_response_names_the_flag(script, tmp_path):
    """One line from the launch script, before any model is built (the planner's error ended a traceback)."""
    rollouts = script.read_run_rollouts(script.parse_args([]), 256)
    groups = script.file_groups(rollouts)
    longest = script.packed_sizes(groups)[1]
    script.check_token_budget(script.parse_args(["--max-tokens", str(longest)]), groups)
    with pytest.raises(script.InputError, match=rf"^--max-tokens {longest - 1} is less than the longest prompt with one "
                                                rf"of its responses \(or trajectory\) in rollouts.jsonl, {longest} tokens; "
                                                rf"raise --max-tokens to at least {longest}$"):
        script.check_token_budget(script.parse_args(["--max-tokens", str(longest - 1)]), groups)


def test_input_errors_name_what_is_wrong(script, tmp_path):
    """--tis-cap without rollout log-probs; a reference checkpoint of another architecture (the
    error names both, before any weights are read)."""
    with pytest.raises(script.InputError, match=r"--tis-cap needs the inference engine's log-probs: .*rollouts.jsonl has no 'logprobs'"):
        script.read_run_rollouts(script.parse_args(["--tis-cap", "2"]), 256)
    other = tmp_path / "moe-reference"
    other.mkdir()
    (other / "config.json").write_text((ROOT / "models" / "qwen3-moe-tiny.json").read_text())
    args = script.parse_args(["--ref-load", str(other)])
    with pytest.raises(script.InputError, match=rf"--ref-load {other} holds another architecture than --model qwen3-tiny: "
                                                r"model_type 'qwen3' vs 'qwen3_moe', moe_aux_loss_coeff None vs 0.001.*\(\+\d+ more\)"):
        script.build_reference(args)


@pytest.fixture(scope="module")
def bench(script):
    return load(ROOT / "tools" / "bench_policy_update.py", "bench_policy_update")


def test_bench_halves_the_micro_batch_until_it_fits(bench, monkeypatch):
    """The GPU-only search for the largest micro-batch, with a step that runs out of memory above 4 responses."""
    calls = []

    def step(policy, groups, loss_fn, max_tokens, layout, prefix_reuse):
        assert not prefix_reuse
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
    assert result.max_tokens == calls[-1] == 140  # what the launch script's --max-tokens plans the same way
    assert result.step_s == pytest.approx(0.5) and result.tflops == pytest.approx(4.0) and result.mfu == pytest.approx(0.4)


def test_bench_warms_a_split_group_up_on_its_first_micro_batch(bench):
    """The warm-up group: the responses of the first micro-batch the planner makes, with their rewards."""
    from types import SimpleNamespace

    group = bench.rollout_group(16, 100, 10, 1000, seed=1)
    policy = SimpleNamespace(cost=SimpleNamespace(attention_weight=1.0))
    (warm,) = bench.warm_up_group(group, 100 + 4 * 10, policy)
    first = bench.plan_micro_batches([group], 140, attention_weight=1.0).ranks[0][0]
    picked = first.source_responses[0]
    assert len(picked) == 4 and warm.prompt == group.prompt
    assert warm.responses == [group.responses[i] for i in picked]
    assert warm.rewards == [group.rewards[i] for i in picked]
    (whole,) = bench.warm_up_group(group, 100 + 16 * 10, policy)
    assert whole.responses == list(group.responses)


def test_replicated_auto_takes_the_benchmarks_setting_in_packed_tokens(script, bench):
    """--layout replicated --recompute auto --max-tokens auto, Qwen3-4B, one 16 x 8192 x 1024 group,
    an H200 less 8%: the benchmark's replicated setting (selective, 2 responses per micro-batch), as
    the most packed tokens whose planned micro-batches, replicated, the memory model fits. The
    benchmark's "mb tokens" of that row, 18,432, are replicated tokens: as --max-tokens they plan 8
    responses per micro-batch, 73,728 replicated tokens, which the launch script ran out of memory on."""
    n, p, r = 16, 8192, 1024
    group, budget = bench.rollout_group(n, p, r, 151_936, seed=n), 0.92 * 140.4 * GIB
    memory = MemoryModel.for_card("qwen3-4b")
    best = bench.candidate_settings(memory, CostModel.from_config(memory.config, memory.vocab_size), budget, (n, p, r),
                                    "replicated")[0]
    args = script.parse_args(["--model", "qwen3-4b", "--layout", "replicated", "--recompute", "auto", "--max-tokens", "auto",
                              "--global-batch-size", "1"])
    fit = script.fit_within(args, [group], budget)

    def responses_per_micro_batch(max_tokens):
        return max(len(mb.response_index) for mb in plan_micro_batches([group], max_tokens).ranks[0])

    assert (args.recompute, args.recompute_layers, best.recompute, best.recompute_layers) == ("selective", None, "selective", 0)
    assert responses_per_micro_batch(args.max_tokens) == best.responses == 2
    assert (fit.tokens, fit.micro_batch_tokens) == (args.max_tokens, 2 * (p + r))
    assert fit.estimate.total == memory.peak(2 * (p + r), 2 * r, "selective", layout="replicated").total <= budget
    assert responses_per_micro_batch(args.max_tokens + 1) == 3
    assert memory.peak(3 * (p + r), 3 * r, "selective", layout="replicated").total > budget
    assert fit.describe().startswith(f"layout replicated, recompute selective, micro-batches planned with "
                                     f"{args.max_tokens:,} packed tokens, the largest 18,432 replicated tokens")
    args = script.parse_args(["--model", "qwen3-4b", "--layout", "replicated", "--recompute", "selective",
                              "--max-tokens", "18432", "--global-batch-size", "1"])
    assert responses_per_micro_batch(18432) == 8
    with pytest.raises(script.InputError, match=r"a micro-batch of 73,728 tokens on the replicated layout \(planned with "
                                                r"18,432\) needs more than the memory budget of 129\.2 GiB"):
        script.fit_within(args, [group], budget)


def test_recompute_auto_offloads_layers_before_it_recomputes_them(script, bench, monkeypatch):
    """Qwen3.5-4B's 16 x 8192 x 1024 group within an H200 less 8%, with 64 GiB of pinned host memory:
    --recompute auto takes the fewest offloaded layers that fit, as the benchmark ranks first; with
    --no-offload, layers recomputed whole."""
    import megatron_dualkv.memory as memory_module

    monkeypatch.setattr(memory_module, "host_budget", lambda share=0.5: 64 * GIB)
    n, p, r = 16, 8192, 1024
    group, budget = bench.rollout_group(n, p, r, 248_320, seed=n), 0.92 * 140.4 * GIB
    settings = {}
    for offload in (True, False):
        flags = [] if offload else ["--no-offload"]
        args = script.parse_args(["--model", "qwen3_5-4b", "--recompute", "auto", "--max-tokens", "auto",
                                  "--global-batch-size", "1", *flags])
        fit = script.fit_within(args, [group], budget)
        settings[offload] = (args.recompute, args.recompute_layers, fit.estimate.host > 0)
    memory = MemoryModel.for_card("qwen3_5-4b")
    best = bench.candidate_settings(memory, CostModel.from_config(memory.config, memory.vocab_size), budget, (n, p, r),
                                    "packed")[0]
    assert settings[True] == ("offload", best.recompute_layers, True) and best.recompute == "offload"
    assert settings[False][0] == "selective" and settings[False][1] > settings[True][1] and not settings[False][2]


@pytest.mark.parametrize("flags", [[], ["--no-offload"]])
def test_bench_hands_its_offload_choice_to_each_models_process(bench, tmp_path, flags):
    """With several models each runs in a process of its own, from ``model_flags``: it must plan as asked."""
    args = bench.parse_args(["--device", "cpu", "--tiny", "--full-depth", *flags])
    args.memory_margin = 0.08  # as main() resolves it before it hands on the flags
    again = bench.parse_args(bench.model_flags(args, "qwen3-tiny", tmp_path))
    assert again.offload is args.offload is (not flags)


@pytest.mark.parametrize("rollouts", ["groups", "episodes"])
def test_replicated_sizes_are_those_the_model_runs(script, policy_args, rollouts):
    """What the memory model is asked about for --layout replicated (``replicated_micro_batch``): the
    tokens of the largest micro-batch that the model receives in the step, and the rows that predict
    a trained token (``ResponseTokens``, which the replicated log-probs gather), for rollout groups of
    uneven lengths split over the budget and for agent episodes (masked tool tokens)."""
    if rollouts == "groups":
        groups = [RolloutGroup(list(range(1, 21)), [[50 + i] * (3 + i) for i in range(12)], rewards=[i % 2 for i in range(12)]),
                  RolloutGroup([7, 8, 9], [[10, 11], [12]], rewards=[1.0, 0.0])]
        max_tokens = 64
    else:
        groups = script.file_groups(read_rollouts(AGENT_EPISODES, 256, ROOT / "examples" / "data" / "tokenizer.model"))[:2]
        max_tokens = max(len(t.tokens) for g in groups for t in g) + 40
    args = script.parse_args(["--layout", "replicated", "--global-batch-size", "2", "--steps", "1",
                              "--max-tokens", str(max_tokens)])
    policy = script.build_policy(policy_args)
    step_rollouts = script.step_rollouts(groups, script.step_indices(len(groups), 1, 2))
    seen = []
    policy.model.module.register_forward_pre_hook(lambda _, a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    script.policy_update_step(policy, step_rollouts, script.LOSSES["grpo"], max_tokens, "replicated")
    largest = script.replicated_micro_batch(args, groups, 1, policy.cost.attention_weight, policy.token_multiple)(max_tokens)
    assert len(seen) > 1 and largest[0] == max(seen)
    advantages = torch.zeros(sum(len(g) if isinstance(g, list) else len(g.responses) for g in groups))
    (mini,) = plan_mini_batches(step_rollouts, 1, max_tokens, advantages, attention_weight=policy.cost.attention_weight)
    sizes = [(seq, ResponseTokens.of(mb.batch).num_tokens) for seq, mb in zip(seen, mini.micro_batches)]
    assert largest == max(sizes)


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
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--memory-margin", "1.5"])
    assert "--memory-margin must be in [0, 1), got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("layout, parts", [("packed", 1), ("replicated", 1), ("reuse", 2)])
def test_bench_ranks_settings_by_the_flops_the_step_counts(bench, script, layout, parts):
    """--full-depth's ranking counts a setting's useful FLOPs as the step does: the output layer on
    the rows that predict a trained token (an independent count: the step's, from its packed batch);
    prefix reuse's parts count the prompt once, as the whole group does."""
    memory, cost, _ = bench.planning_models("qwen3-tiny", SimpleNamespace(dtype="float32", device="cpu", memory_margin=0.08,
                                                                   transformer_engine="off", fp8="off", budget_gib=None,
                                                                   offload=False))
    n, p, r = 4, 96, 24
    k = n // parts
    (setting,) = [s for s in bench.candidate_settings(memory, cost, 1e12, (n, p, r), layout) if s.responses == k]
    group = bench.rollout_group(n, p, r, memory.vocab_size, seed=1)
    minis = script.plan_mini_batches([group], 1, p + k * r, torch.zeros(n), prefix_reuse=layout == "reuse")
    assert minis[0].plan.num_micro_batches == parts
    step_layout = "replicated" if layout == "replicated" else "packed"
    assert setting.useful_flops == pytest.approx(bench.STEP_PASSES * script._forward_flops(cost, minis, step_layout))
    if layout == "reuse":
        whole = bench.candidate_settings(memory, cost, 1e12, (n, p, r), "packed")[0]
        assert (whole.responses, setting.useful_flops) == (n, pytest.approx(whole.useful_flops))


def test_bench_reuse_predicts_what_the_launch_script_does(script, bench):
    """Qwen3-4B at 16 x 65,536 x 2,048 within an H200 less 8%: the benchmark's prefix-reuse setting,
    passed to the launch script as --max-tokens and --recompute with --prefix-reuse, is predicted the
    same peak (the held prompt counted alike); the sub-group split at the same budget holds no prompt."""
    n, p, r = 16, 65536, 2048
    budget = 0.92 * 140.4 * GIB
    memory = MemoryModel.for_card("qwen3-4b")
    best = bench.candidate_settings(memory, CostModel.from_config(memory.config, memory.vocab_size), budget, (n, p, r),
                                    "reuse")[0]
    assert best.responses < n and best.predicted_gib * GIB <= budget
    for reuse in (True, False):
        args = script.parse_args(["--model", "qwen3-4b", "--max-tokens", str(p + best.responses * r), "--recompute",
                                  best.recompute, "--recompute-layers", str(best.recompute_layers), "--global-batch-size", "1"])
        args.prefix_reuse = reuse  # as resolve_prefix_reuse leaves it
        fit = script.fit_within(args, [bench.rollout_group(n, p, r, 64, seed=n)], budget)
        assert ("held prompt" in fit.estimate.parts) == reuse
    assert fit.estimate.total_gib < best.predicted_gib


def test_a_prompt_too_long_to_hold_resident_waits_on_the_host(script, bench, monkeypatch):
    """Qwen3-4B (YaRN) at 16 x 131,072 x 4,096 on an H200 less 8%: no prefix-reuse part fits with the
    prompt's activations on the GPU; --recompute/--max-tokens auto put them on the host (64 GiB of
    it), as the benchmark ranks it, and the policy is built so."""
    import megatron_dualkv.memory as memory_module

    monkeypatch.setattr(memory_module, "host_budget", lambda: 64 * GIB)
    n, p, r = 16, 131072, 4096
    group, budget = bench.rollout_group(n, p, r, 64, seed=n), 0.92 * 140.4 * GIB
    args = script.parse_args(["--model", "qwen3-4b-131k", "--recompute", "auto", "--max-tokens", "auto",
                              "--global-batch-size", "1"])
    args.prefix_reuse = True  # as resolve_prefix_reuse leaves it
    fit = script.fit_within(args, [group], budget)
    assert args.prompt_on_host and fit.prompt_on_host and fit.estimate.total <= budget
    assert 0 < fit.estimate.host <= 64 * GIB
    assert "the held prompt's activations on the host" in fit.describe() and "on the host" in fit.estimate.describe()
    memory = MemoryModel.for_card("qwen3-4b-131k")
    with pytest.raises(ValueError):
        memory.fit(budget, p + r, r / (p + r), held_prompt_tokens=p)  # resident: none fits
    best = bench.candidate_settings(memory, CostModel.from_config(memory.config, memory.vocab_size), budget, (n, p, r),
                                    "reuse")[0]
    assert best.prompt_on_host and best.responses < n
    tiny = bench.policy_args("qwen3-tiny", SimpleNamespace(dtype="float32", device="cpu", transformer_engine="off",
                                                           fp8="off"), prompt_on_host=True)
    assert script._build_or_load_model(tiny).config.prefix_reuse_prompt_on_host


def test_bench_full_depth_prefix_reuse_dry_run(bench, tmp_path, monkeypatch, capsys):
    """--layouts packed,reuse,replicated on the tiny card, a budget under which the whole group fits
    only with full recompute: the reuse row runs the group in prefix-reuse parts, its speedup over the
    packed row is finite; --workloads takes any NxPxR, and bad ones or reuse without --full-depth are refused."""
    monkeypatch.setattr(bench, "plot", lambda results, path, baseline: None)  # needs matplotlib
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the tool refuses the CPU where there is a GPU
    bench.main(["--device", device, "--tiny", "--full-depth", "--models", "qwen3-tiny", "--repeats", "1",
                "--layouts", "packed,reuse,replicated", "--workloads", "4x96x24", "--budget-gib", "0.0033",
                "--out", str(tmp_path)])
    packed, reuse, replicated = bench.read_results(tmp_path / "policy_update_full_depth.csv")
    assert [row.layout for row in (packed, reuse, replicated)] == ["packed", "reuse", "replicated"]
    assert (packed.micro_batch_responses, packed.recompute) == (4, "full")
    assert (reuse.micro_batch_responses, reuse.micro_batches, reuse.max_tokens) == (2, 2, 96 + 2 * 24)
    assert reuse.speedup == pytest.approx(packed.step_s / reuse.step_s) and math.isfinite(reuse.speedup)
    assert reuse.tokens_per_s > 0 and reuse.recompute_flops == 0.0
    for flags, error in ((["--workloads", "4x96"], "'4x96' is not NxPxR"),
                         (["--layouts", "packed,reuse"], "--layouts reuse: prefix reuse runs with --full-depth"),
                         (["--full-depth", "--agent", "--replicated-sample"], "--replicated-sample extrapolates"),
                         (["--full-depth", "--layouts", "packed", "--replicated-sample"], "with replicated (no --agent)")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--tiny", *flags])
        assert error in capsys.readouterr().err


def test_bench_extrapolates_a_replicated_step_from_its_first_micro_batches(bench, tmp_path, monkeypatch):
    """--replicated-sample: a step of M micro-batches of one shape from steps of its first one and two,
    t1 + (M - 1)(t2 - t1), with M times one micro-batch's FLOPs and tokens; and through the tool."""
    timed = []

    @dataclasses.dataclass
    class Step:  # the fields of the launch script's StepStats that the tool reads
        seconds: float
        flops: float
        rollout_tokens: int
        micro_batches: int
        peak_memory_gib: float

    def fake_steps(policy, group, layout, max_tokens, repeats):
        timed.append(len(group.responses))
        m = len(group.responses) // 2
        return [Step(1.0 + 3.0 * m, 10.0 * m, 7 * m, m, float(m))]

    group = bench.rollout_group(8, 16, 4, 64, seed=0)
    with monkeypatch.context() as patch:
        patch.setattr(bench, "run_steps", fake_steps)
        (step,) = bench.extrapolated_steps(None, group, 16 + 2 * 4, 1, responses=2)
    assert timed == [2, 4]
    assert (step.seconds, step.flops, step.rollout_tokens, step.micro_batches, step.peak_memory_gib) == (13.0, 40.0, 28, 4, 2.0)
    with pytest.raises(SystemExit, match="micro-batches of one shape: 8 responses in parts of 3"):
        bench.extrapolated_steps(None, group, 16 + 3 * 4, 1, responses=3)
    monkeypatch.setattr(bench, "plot", lambda results, path, baseline: None)  # needs matplotlib
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bench.main(["--device", device, "--tiny", "--full-depth", "--models", "qwen3-tiny", "--repeats", "1",
                "--layouts", "replicated", "--replicated-sample", "--workloads", "4x96x24", "--out", str(tmp_path)])
    (row,) = bench.read_results(tmp_path / "policy_update_full_depth.csv")
    assert row.extrapolated and row.micro_batches == 4 // row.micro_batch_responses and row.step_s > 0


@pytest.mark.parametrize("layout", ["packed", "replicated", "reuse"])
def test_bench_profiles_a_step_in_the_first_layout(bench, tmp_path, monkeypatch, layout):
    """--profile: one step (after two warm-up steps) in the first of --layouts at the setting the
    benchmark ranks first (the whole tiny group in one micro-batch where the budget holds it; its
    budget in packed tokens, as every layout plans), its table written per layout. Prefix reuse is a
    packed step with the prompt held, in parts of the responses under a budget that only they fit."""
    steps = []

    def step(policy, groups, loss_fn, tokens, step_layout, prefix_reuse=False):
        steps.append((tokens, step_layout, prefix_reuse))
        return SimpleNamespace(seconds=0.01)

    monkeypatch.setattr(bench.policy_update, "policy_update_step", step)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = ["--budget-gib", "0.0033"] if layout == "reuse" else []  # as the docstring's dry run: a part only
    bench.main(["--device", device, "--tiny", "--full-depth", "--models", "qwen3-tiny", "--profile", *budget,
                "--layouts", f"{layout},{'packed' if layout == 'replicated' else 'replicated'}", "--workloads", "4x96x24",
                "--out", str(tmp_path)])
    responses = 2 if layout == "reuse" else 4
    assert steps == [(96 + responses * 24, "packed" if layout == "reuse" else layout, layout == "reuse")] * 3
    assert (tmp_path / f"profile_qwen3-tiny_{layout}.txt").exists()


def test_bench_profile_counts_overlapping_kernels_once(bench):
    """--profile's GPU busy time: the union of the kernels' spans (microseconds), not their sum."""
    assert bench.busy_seconds([]) == 0.0
    assert bench.busy_seconds([(10, 20), (0, 5), (15, 30), (40, 41), (16, 18)]) == pytest.approx((5 + 20 + 1) / 1e6)


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
            args = [x.clone() for x in inputs]
            leaves = [x.requires_grad_() for x in args[:op.leaves]]
            out = ops.implementation(op, method)(*args)
            dy = torch.randn_like(out) if dy is None else dy
            results.append((out, *torch.autograd.grad(out, leaves, dy)))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


def test_bench_ops_log_probs_are_the_same_both_ways():
    """tools/bench_ops.py --mode logprobs: all logits then the predicting rows, and the fused op on
    those rows, give the same log-probs, entropies and gradients (float32, a tiny group)."""
    ops = load(ROOT / "tools" / "bench_ops.py", "bench_ops")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (hidden, weight), rows, targets, upstream = ops.logprob_inputs(300, (3, 7, 5), device)
    results = []
    for method in ops.LOGPROB_METHODS:
        leaves = [x.detach().float().requires_grad_() for x in (hidden, weight)]
        logprobs, entropy = ops.logprob_method(method, *leaves, rows, targets, True)
        loss = (upstream[0] * logprobs).sum() + (upstream[1] * entropy).sum()
        results.append((logprobs, entropy, *torch.autograd.grad(loss, leaves)))
    assert results[0][0].shape == (rows.numel(),) == (3 * 5,)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


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
    bench.main(["--device", "cpu", "--tiny", "--repeats", "2", "--models", "moe,dense", "--out", str(tmp_path),
                "--memory-margin", "0.05"])
    assert plotted == [tmp_path / "policy_update.png"]
    assert [cmd[1] for cmd in runs] == [bench.__file__] * 2
    assert [cmd[cmd.index("--models") + 1] for cmd in runs] == ["moe", "dense"]
    assert all({"--tiny", "--device", "cpu", "--repeats", "2"} <= set(cmd) for cmd in runs)
    assert all(cmd[cmd.index("--memory-margin") + 1] == "0.05" for cmd in runs)
    assert [r.model for r in bench.read_results(tmp_path / "policy_update.csv")] == ["moe", "moe", "dense", "dense"]


def test_bench_agent_episodes(bench, tmp_path, monkeypatch):
    """--agent: issue #31's workload (a) (32,768 packed tokens for 65,536, tool tokens masked), and a
    dry run of the packed tree against the replicated trajectories on the tiny card."""
    trajectories = bench.agent_episodes(1000, 0, *bench.AGENT)
    batch = pack_trajectories(trajectories)
    assert batch.num_trajectories == 8 and batch.trajectory_lens == (8192,) * 8 and batch.num_tokens == 32768
    assert [sum(t.loss_mask) for t in trajectories] == [4 * 512] * 8 and batch.layout.max_depth == 2
    monkeypatch.setattr(bench, "plot", lambda results, path, baseline: None)  # needs matplotlib
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the tool refuses the CPU where there is a GPU
    bench.main(["--device", device, "--tiny", "--full-depth", "--agent", "--models", "qwen3-tiny", "--repeats", "1",
                "--out", str(tmp_path)])
    packed, replicated = bench.read_results(tmp_path / "policy_update_agent.csv")
    assert (packed.layout, replicated.layout, packed.workload) == ("packed", "replicated", "agent")
    assert (packed.n, packed.p, packed.r) == (4, 48, 48) and packed.micro_batch_tokens < replicated.micro_batch_tokens
    assert packed.tokens_per_s > 0 and replicated.tokens_per_s > 0


# ------------------------------------------------------------------------------- the whole RL loop
QUESTIONS = ["Kofi has 35 coins and gets 8 more. How many coins does he have?",
             "A farmer has 12 cows and sells 5. How many are left?",
             "What is 7 times 6?", "Amara reads 9 pages a day for 3 days. How many pages is that?"]
ANSWERS = ["He has 43 coins. Answer: 43", "Answer: 42", "There are 7 left. Answer: 7", "Answer: 27", "The answer is 54."]


@pytest.fixture(scope="module")
def rl_loop(tmp_path_factory, weights_77):
    """The launch script with everything on: chat prompts through a Hugging Face tokenizer folder
    (trained here), the rollouts' log-probs with --tis-cap, a reference policy (seed 77's weights)
    with a KL term, dual clip, 2 mini-batches x 2 epochs, warmup then linear decay, TensorBoard and
    JSONL logs; 2 steps of 4 groups."""
    folder = tmp_path_factory.mktemp("rl_loop")
    tokenizer = make_hf_tokenizer(folder / "tokenizer")
    g = torch.Generator().manual_seed(0)
    lines = []
    for i, question in enumerate(QUESTIONS):
        responses = ANSWERS[i % 2 : i % 2 + 2 + i % 3]
        lengths = [len(ids) for ids in read_tokens(tokenizer, responses)]
        lines.append({"prompt": [{"role": "system", "content": "Solve it."}, {"role": "user", "content": question}],
                      "responses": responses, "rewards": [float(j % 2) for j in range(len(responses))],
                      "logprobs": [(-0.1 - 5 * torch.rand(n, generator=g)).tolist() for n in lengths]})
    rollouts = folder / "chat.jsonl"
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--rollouts", rollouts, "--tokenizer", tokenizer, "--global-batch-size", 4, "--mini-batches", 2,
             "--ppo-epochs", 2, "--clip-ratio-c", 2, "--tis-cap", 1.5, "--ref-load", weights_77, "--kl-coef", 0.05,
             "--lr", 1e-2, "--lr-warmup-steps", 1, "--lr-decay-style", "linear", "--steps", 2,
             "--tensorboard-dir", folder / "tb", "--log-jsonl", folder / "run.jsonl"]
    out, steps = run_script(*flags)
    return dict(out=out, steps=steps, updates=update_lines(out), folder=folder, rollouts=rollouts, tokenizer=tokenizer)


def read_tokens(tokenizer, responses):
    """The responses' token ids as the tokenizers library makes them, EOS appended."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    return [raw.encode(r, add_special_tokens=False).ids + [raw.token_to_id("<|im_end|>")] for r in responses]


def test_rl_loop_logs_every_update_and_warms_up(rl_loop):
    out, steps, updates = rl_loop["out"], rl_loop["steps"], rl_loop["updates"]
    assert "| 2 mini-batches x 2 epochs | reference" in out and sorted(steps) == [1, 2]
    assert sorted(updates) == [(step, k) for step in (1, 2) for k in (1, 2, 3, 4)]
    assert [(updates[1, k]["epoch"], updates[1, k]["mini_batch"]) for k in (1, 2, 3, 4)] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    # warmup from 0: step 1 runs at lr 0 (Megatron's first warmup step), so its updates do not move the policy
    assert number(steps[1], "lr") == 0 and number(steps[2], "lr") == pytest.approx(1e-2)
    assert all(number(updates[1, k], "ratio") == pytest.approx(1.0, abs=1e-4) for k in (1, 2, 3, 4))
    moved = [number(updates[2, k], "ratio") for k in (2, 3, 4)]
    assert number(updates[2, 1], "ratio") == pytest.approx(1.0, abs=1e-4) and all(abs(r - 1) > 1e-3 for r in moved), moved
    assert max(number(updates[2, k], "clip") for k in (2, 3, 4)) > 0, "later updates must clip"
    for fields in [*steps.values(), *updates.values()]:
        assert fields["kl"] is not None and fields["dual_clip"] is not None and fields["mismatch"] is not None


def test_rl_loop_metrics_match_an_independent_forward_of_its_models(rl_loop, weights_77):
    """Update 1 of step 1 (the behaviour policy): the KL to the reference checkpoint, the
    rollout-training mismatch |behaviour - rollout| and the entropy, as token means, from the
    script's models built again here (its seed, the checkpoint) on the replicated layout."""
    rollouts = read_rollouts(rl_loop["rollouts"], 256, rl_loop["tokenizer"])
    policy, reference = build_model("qwen3-tiny", seed=1234), load_model(weights_77)
    with torch.no_grad():
        per_group = []
        for group, rollout in zip(rollouts.groups, rollouts.logprobs):
            batch = pack_groups([group])
            (out,) = forward_backward(policy, [RLMicroBatch(batch)], layout="replicated", with_entropy=True)
            (ref,) = forward_logprobs(reference, batch, layout="replicated")
            per_group.append([(lp, ent, rf, ro.to(lp.device)) for lp, ent, rf, ro in zip(out.logprobs[0], out.entropy[0], ref, rollout)])
    tokens = lambda groups, f: torch.cat([f(*r) for g in groups for r in per_group[g]])  # noqa: E731
    k3 = lambda lp, ent, rf, ro: torch.exp(rf - lp) - (rf - lp) - 1  # noqa: E731
    records = [json.loads(line) for line in (rl_loop["folder"] / "run.jsonl").read_text().splitlines()]
    first_update = next(r for r in records if r["kind"] == "update" and r["update"] == 1)
    step_1 = next(r for r in records if r["kind"] == "step" and r["step"] == 1)
    assert first_update["kl"] == pytest.approx(tokens([0, 1], k3).mean().item(), rel=1e-4)
    assert step_1["rollout_mismatch"] == pytest.approx(tokens(range(4), lambda lp, ent, rf, ro: (lp - ro).abs()).mean().item(), rel=1e-4)
    assert step_1["entropy"] == pytest.approx(tokens(range(4), lambda lp, ent, rf, ro: ent).mean().item(), rel=1e-4)
    assert first_update["ratio"] == pytest.approx(1.0, abs=1e-6)


def test_rl_loop_jsonl_tensorboard_and_plots_agree(rl_loop):
    """One JSONL line per update and per step with the printed numbers; the TensorBoard folder
    holds the same step curves; tools/plot_run.py draws a PNG from either."""
    plot_run = load(ROOT / "tools" / "plot_run.py", "plot_run")
    folder, steps, updates = rl_loop["folder"], rl_loop["steps"], rl_loop["updates"]
    records = [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("update", 1)] * 4 + [("step", 1)] + [("update", 2)] * 4 + [("step", 2)]
    assert [r["update"] for r in records if r["kind"] == "update"] == list(range(1, 9))
    for record in records:
        printed = steps[record["step"]] if record["kind"] == "step" else updates[record["step"], (record["update"] - 1) % 4 + 1]
        for key, field in (("loss", "loss"), ("ratio", "ratio"), ("kl", "kl"), ("rollout_mismatch", "mismatch")):
            assert record[key] == pytest.approx(number(printed, field), rel=1e-3, abs=1e-4), (record, key)
    from_jsonl, from_tensorboard = plot_run.read_run(folder / "run.jsonl"), plot_run.read_run(folder / "tb")
    assert from_jsonl.keys() == from_tensorboard.keys() >= {"loss", "reward", "kl", "entropy", "lr", "dual_clip_fraction"}
    for name, points in from_jsonl.items():
        assert [step for step, _ in points] == [1, 2] == [step for step, _ in from_tensorboard[name]], name
        assert [v for _, v in points] == pytest.approx([v for _, v in from_tensorboard[name]], rel=1e-6), name
    for source in (folder / "run.jsonl", folder / "tb"):
        png = folder / f"{source.name}.png"
        plot_run.main([str(source), "--out", str(png)])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_jsonl_log_is_written_anew_unless_appended_to(tmp_path):
    from megatron_dualkv.run_log import RunLog

    path = tmp_path / "run.jsonl"
    for step, append in ((1, False), (2, False), (3, True)):
        log = RunLog(jsonl_path=path, append=append)
        log.step(step, {"loss": 0.5})
        log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2, 3]


@pytest.mark.parametrize("runs, expected", [
    ([[1, 2, 3, 4]], {1: 0, 2: 0, 3: 0, 4: 0}),
    ([[1, 2, 3, 4], [1, 2]], {1: 1, 2: 1}),  # run again into the same file: the rerun alone
    ([[1, 2, 3, 4], [3, 4, 5]], {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}),  # resumed after step 2
])
def test_plot_run_draws_the_last_run_of_a_file_and_says_so(tmp_path, capsys, runs, expected):
    plot_run = load(ROOT / "tools" / "plot_run.py", "plot_run")
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"kind": kind, "step": step, "loss": float(run)}) + "\n"
                            for run, steps in enumerate(runs) for step in steps for kind in ("update", "step")))
    assert dict(plot_run.read_jsonl(path)["loss"]) == expected
    said = capsys.readouterr().out
    assert said == ("" if len(runs) == 1 else
                    f"{path} holds {len(runs)} runs: plotting the last, steps {min(expected)}-{max(expected)}\n")


# ------------------------------------------------------------------------ a step, in this process
@pytest.fixture(scope="module")
def policy_args(script):
    return script.parse_args(["--lr", "3e-2", "--seed", "9"])


def test_update_ratios_are_those_of_the_model_after_the_earlier_updates(script, policy_args):
    """2 mini-batches x 2 epochs: the behaviour log-probs are computed once, before update 1, so the
    ratio of an update is the token mean of exp(new - old), new from an independent forward (the
    replicated layout, a group at a time) of the model after the updates before it."""
    policy = script.build_policy(policy_args)
    groups = make_groups([(6, [3, 5]), (4, [2, 2, 4]), (9, [1, 6]), (3, [4, 3])])
    groups = [RolloutGroup(g.prompt, g.responses, [float(i % 2) for i in range(len(g.responses))]) for g in groups]

    def logprobs():
        with torch.no_grad():
            return [forward_logprobs(policy.model.module, pack_groups([g]), layout="replicated")[0] for g in groups]

    after, step = [logprobs()], policy.optimizer.step
    policy.optimizer.step = lambda: (step(), after.append(logprobs()))[0]
    stats = script.policy_update_step(policy, groups, script.LOSSES["grpo"], 64, "packed", script.PPOSchedule(2, 2))
    old = after[0]
    for k, update in enumerate(stats.updates):
        new, mini = after[k], [(0, 1), (2, 3)][update.mini_batch]
        want = torch.cat([torch.exp(n - o) for g in mini for n, o in zip(new[g], old[g])]).mean().item()
        assert update.ratio == pytest.approx(want, rel=1e-5), k
    assert [(u.epoch, u.mini_batch) for u in stats.updates] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert stats.updates[0].ratio == pytest.approx(1.0, abs=1e-6) and abs(stats.updates[1].ratio - 1) > 1e-3


def test_rollout_logprobs_replace_the_behaviour_pass(script, policy_args, monkeypatch):
    """Without --tis-cap the rollouts' log-probs are the behaviour log-probs: no forward-only pass,
    and update 1's ratio is exp(current - rollout); with it they only weigh, the behaviour log-probs
    being the update's own in one update a step (no pass) and the pass's with two mini-batches."""
    policy = script.build_policy(policy_args)
    groups = make_groups([(6, [3, 5]), (4, [2, 2, 4])])
    rollout = [[torch.full((len(r),), -5.0) for r in g.responses] for g in groups]
    passes = []
    forward_only = script.forward_only
    monkeypatch.setattr(script, "forward_only", lambda *a, **k: passes.append(1) or forward_only(*a, **k))
    with torch.no_grad():
        current = [forward_logprobs(policy.model.module, pack_groups([g]), layout="replicated")[0] for g in groups]
    stats = script.policy_update_step(policy, groups, script.LOSSES["grpo"], 64, "packed", rollout_logprobs=rollout)
    assert passes == [] and stats.rollout_mismatch is None
    want = torch.cat([torch.exp(c + 5.0) for group in current for c in group]).mean().item()
    assert stats.updates[0].ratio == pytest.approx(want, rel=1e-5)
    assert stats.entropy is not None  # from the update itself
    tis = dataclasses.replace(script.LOSSES["grpo"], tis_cap=2.0)
    stats = script.policy_update_step(policy, groups, tis, 64, "packed", rollout_logprobs=rollout)
    assert passes == [] and stats.rollout_mismatch > 0 and stats.updates[0].ratio == 1.0
    stats = script.policy_update_step(policy, groups, tis, 64, "packed", script.PPOSchedule(2, 1), rollout_logprobs=rollout)
    assert passes == [1] and stats.rollout_mismatch > 0 and stats.updates[0].ratio == pytest.approx(1.0, abs=1e-6)


def test_one_update_a_step_takes_its_own_log_probs_as_the_behaviour_ones(script, policy_args, monkeypatch):
    """One update a step runs no forward-only pass: its old log-probs are its own, detached. It moves
    the policy as the same update does with a behaviour pass run by hand (a second policy of the same
    seed), with the same loss, margin and entropy (--tis-cap: the rollouts' log-probs only weigh),
    and counts 3 forward passes of FLOPs instead of 4."""
    groups = make_groups([(6, [3, 5]), (4, [2, 2, 4]), (9, [1, 6])])
    groups = [RolloutGroup(g.prompt, g.responses, [float(i % 2) for i in range(len(g.responses))]) for g in groups]
    rollout = [[torch.full((len(r),), -5.0) for r in g.responses] for g in groups]
    passes = []
    forward_only = script.forward_only
    monkeypatch.setattr(script, "forward_only", lambda *a, **k: passes.append(1) or forward_only(*a, **k))
    tis = dataclasses.replace(script.LOSSES["grpo"], tis_cap=2.0)
    own, given = script.build_policy(policy_args), script.build_policy(policy_args)
    stats = script.policy_update_step(own, groups, tis, 64, "packed", rollout_logprobs=rollout)
    assert passes == []
    minis = script.plan_mini_batches(groups, 1, 64, tis.advantages(script.group_rewards(groups)),
                                     pad_to_multiple_of=given.token_multiple)
    (behaviour,) = forward_only(given.model, minis, "packed", with_entropy=True)
    (mini,) = minis
    mini = mini.with_logprobs(old=[out.logprobs for out in behaviour], rollout=mini.share(rollout))
    (update,) = script.ppo_updates(given.model, given.optimizer, [mini], tis)
    for (name, a), b in zip(own.model.module.named_parameters(), given.model.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    loss = sum(out.loss for out in update.outputs).item() / len(update.outputs)
    assert stats.loss == pytest.approx(loss, rel=1e-5) and stats.updates[0].ratio == 1.0
    pos, n_pos, neg, n_neg = script._margin_sums([(mb, out.logprobs) for mb, out in zip(mini.micro_batches, behaviour)])
    # a difference of two means of log-probs: its rounding is relative to the means (run DW)
    means = pos / n_pos, neg / n_neg
    assert stats.margin == pytest.approx(means[0] - means[1], abs=1e-5 * max(map(abs, means)))
    entropy = script._token_means(script._metric_sums(zip(mini.micro_batches, behaviour)))["entropy"]
    assert stats.entropy == pytest.approx(entropy, rel=1e-5)
    assert stats.flops == pytest.approx(3 * script._forward_flops(own.cost, minis, "packed"))


AGENT_EPISODES = ROOT / "examples" / "data" / "agent_episodes.jsonl"


def test_agent_episodes_update_ratios_and_the_replicated_layout(script, policy_args):
    """The bundled multi-turn episodes (tool outputs masked) as prefix trees, 2 mini-batches of
    GRPO: an update's ratio is the mean over the trained tokens of its mini-batch's trajectories of
    exp(new - old), new from each trajectory alone (the replicated layout) of the model after the
    updates before it; the replicated layout takes the same steps."""
    from megatron_dualkv.rl import trajectory_logprobs

    rollouts = read_rollouts(AGENT_EPISODES, 256, ROOT / "examples" / "data" / "tokenizer.model")
    trajectories = script.step_rollouts(script.file_groups(rollouts), [0, 3])
    assert [t.group for t in trajectories] == [0] * 4 + [1] * 4
    policy = script.build_policy(policy_args)

    def logprobs():
        with torch.no_grad():
            return [trajectory_logprobs(policy.model.module, pack_trajectories([t]), "replicated")[0][
                torch.tensor(t.loss_mask[1:])] for t in trajectories]

    after, step = [logprobs()], policy.optimizer.step
    policy.optimizer.step = lambda: (step(), after.append(logprobs()))[0]
    grpo, two = script.LOSSES["grpo"], script.PPOSchedule(2)
    packed = script.policy_update_step(policy, trajectories, grpo, 1024, "packed", two)
    for k, update in enumerate(packed.updates):
        mini = range(4 * update.mini_batch, 4 * update.mini_batch + 4)
        want = torch.cat([torch.exp(after[k][i] - after[0][i]) for i in mini]).mean().item()
        assert update.ratio == pytest.approx(want, rel=1e-5), k
    assert abs(packed.updates[1].ratio - 1) > 1e-3
    policy = script.build_policy(policy_args)
    replicated = script.policy_update_step(policy, trajectories, grpo, 1024, "replicated", two)
    assert packed.rho > 2 and replicated.rho == packed.rho and packed.reward == 0.5
    for p, r in zip(packed.updates, replicated.updates):
        assert p.loss == pytest.approx(r.loss, rel=1e-4, abs=1e-6) and p.ratio == pytest.approx(r.ratio, rel=1e-5)


def test_the_agent_episodes_command(tmp_path):
    """The documented command on the bundled episodes: trajectories by group, packed as trees."""
    out, steps = run_script("--rollouts", AGENT_EPISODES, "--global-batch-size", 2, "--loss", "dapo", "--steps", 2)
    assert "16 trajectories in 4 groups from agent_episodes.jsonl" in out and sorted(steps) == [1, 2]
    assert all(number(fields, "rho") > 2 and fields["mb"] == "1" for fields in steps.values())


def test_agent_episodes_with_prefix_reuse_of_split_trees(script, capsys):
    """Trees over --max-tokens: their shared paths run once (--prefix-reuse on), or each part carries
    its path (off); the same steps either way, fewer tokens with reuse."""
    runs = {}
    for reuse in ("on", "off"):
        out, steps = train_in_process(script, capsys, "--rollouts", AGENT_EPISODES, "--global-batch-size", 2, "--loss",
                                      "dapo", "--steps", 1, "--max-tokens", 300, "--prefix-reuse", reuse)
        how = "prefix reuse (its shared path runs once)" if reuse == "on" else "parts (each carries its path)"
        assert f"plan: 2 groups over --max-tokens 300 in 4 micro-batches, as {how}" in out
        runs[reuse] = steps[1]
    for key in ("loss", "margin", "ratio"):
        assert number(runs["on"], key) == pytest.approx(number(runs["off"], key), rel=1e-4, abs=1e-6), key
    assert number(runs["on"], "rho") > number(runs["off"], "rho")


def test_the_plan_line_names_each_way_split_trees_run(script):
    """Two trees over the budget: one holds its prompt (prefix reuse); the other has a trajectory of
    its first token alone, which leaves no path to hold, so its parts carry their paths."""
    from megatron_dualkv import Trajectory

    def tree(group, first, lone):
        prompt = [first] + [7] * 9
        trajectories = [Trajectory(prompt + [10 + i] * 8, [False] * 10 + [True] * 8, float(i), group) for i in range(3)]
        return trajectories + [Trajectory([first], [False], 0.0, group)] * lone

    args = script.parse_args(["--prefix-reuse", "on", "--max-tokens", "30", "--global-batch-size", "2"])
    args.prefix_reuse = True
    line = script.plan_summary(args, [tree("a", 1, False), tree("b", 2, True)], 1, 0.0)
    assert line == ("plan: 2 groups over --max-tokens 30 in 4 micro-batches, 1 as prefix reuse (its shared path runs "
                    "once); 1 as parts (each carries its path)"), line


def test_the_plan_line_says_when_the_te_spec_keeps_a_split_group_from_prefix_reuse(script, monkeypatch):
    """--prefix-reuse auto on the Transformer Engine spec splits a long group into sub-groups: the
    plan line says that prefix reuse would hold its prompt, and how to get it."""
    group = RolloutGroup([1] * 40, [[2] * 10] * 4, rewards=[0.0, 1.0, 0.0, 1.0])
    hint = "; prefix reuse does not run on the Transformer Engine spec yet (--transformer-engine off runs it)"
    for te, want in ((False, "as prefix reuse (its prompt runs once)"), (True, "as sub-groups (each carries its prompt)" + hint)):
        monkeypatch.setattr(script, "_transformer_engine", lambda args, card=None, te=te: te)
        args = script.parse_args(["--max-tokens", "60", "--global-batch-size", "1"])
        script.resolve_prefix_reuse(args)
        line = script.plan_summary(args, [group], 1, 0.0)
        assert line.startswith("plan: 1 group over --max-tokens 60 in ") and line.endswith(want), line


def test_memory_fit_counts_the_held_path_of_split_trees(script):
    """A tree over --max-tokens holds its shared path with prefix reuse: ``held_prompt`` is its length."""
    rollouts = read_rollouts(AGENT_EPISODES, 256, ROOT / "examples" / "data" / "tokenizer.model")
    groups = script.file_groups(rollouts)
    args = script.parse_args(["--prefix-reuse", "on"])
    script.resolve_prefix_reuse(args)
    sizes = [pack_trajectories(g).num_tokens for g in groups]  # one tree per group
    over = [held_path_len(g) for g, n in zip(groups, sizes) if n > 300]
    assert over and min(over) > 0 and script.held_prompt(args, groups, 300) == max(over)
    assert script.held_prompt(args, groups, max(sizes)) == 0


@pytest.mark.parametrize("window", [None, 5])
def test_attention_bench_baselines_use_the_layouts_mask(window):
    """tools/bench_attention.py: FlexAttention's mask_mod is the layout's rule (depth 1 and trees),
    SDPA's replicated sequences are the trajectories (each [P][R_i] at depth 1), and so are FA4's
    varlen sequences with its window; small versions
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
        # FA4's varlen rule on the concatenated sequences (same sequence, causal, at most `left` back),
        # mapped to the packed tokens, is the layout's mask
        starts, (left, right) = attention.cumulative_lengths(index), attention.fa4_window(w.window)
        flat, sequence = index.flatten(), torch.bucketize(torch.arange(index.numel()), starts[1:], right=True)
        j = torch.arange(index.numel())
        allowed = ((sequence[:, None] == sequence[None, :]) & (j[None, :] <= j[:, None] + right)
                   & (j[:, None] - j[None, :] <= (left if left is not None else index.numel())))
        fa4 = torch.zeros(T, T).index_put_((flat[:, None].expand_as(allowed), flat[None, :].expand_as(allowed)),
                                           allowed.float(), accumulate=True)  # a prompt is in several sequences
        assert torch.equal(fa4 > 0, layout.dense_mask(w.window))
    trees = {w.name: attention.describe(w) for w in attention.WORKLOADS if isinstance(w, attention.TreeWorkload)}
    assert trees["d128-tree-agent"]["tokens"] == 4096 + 4 * 1024 + 8 * 3 * 1024
    assert trees["d128-tree-agent"]["replicated_tokens"] == 8 * (4096 + 4 * 1024)
    assert trees["d128-tree-search"]["segments"] == 1 + 84
    assert trees["d128-tree-16x8192x1024"]["tokens"] == 8192 + 16 * 1024


def test_attention_bench_prefix_method_is_the_responses_rows_of_the_packed_call():
    """tools/bench_attention.py's dualkv_prefix: the responses' rows against the prompt's K/V held
    apart give the packed call's response rows (a small workload with a window, on the CPU), and its
    FLOPs count the responses' pairs alone."""
    attention = load(ROOT / "tools" / "bench_attention.py", "bench_attention")
    w = attention.Workload("small", 3, 11, 7, 4, 2, 16, window=9)
    layout = w.layout("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(layout.total_tokens, h, w.d, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    run, leaves = attention.method_fn("dualkv_prefix", w, layout, q, k, v)
    torch.testing.assert_close(run(), dualkv_attn_func(q, k, v, layout, window_size=w.window)[w.p:])
    assert len(leaves) == 5 and leaves[0].shape[0] == w.n * w.r and leaves[3].shape[0] == w.p
    held = w.prefixed_layout("cpu")
    assert held.attention_pairs(w.window) == layout.attention_pairs(w.window) - causal_pairs(w.p, w.window)
    with pytest.raises(ValueError, match="depth-1"):
        attention.method_fn("dualkv_prefix", attention.WORKLOADS[-1], layout, q, k, v)


def test_prefix_reuse_on_names_what_is_in_the_way(script):
    args = script.parse_args(["--prefix-reuse", "on", "--layout", "replicated"])
    with pytest.raises(script.InputError, match=r"^--prefix-reuse on does not run with --layout replicated yet; "
                                                r"use --prefix-reuse off$"):
        script.resolve_prefix_reuse(args)
    for flags, want in ((["--layout", "replicated"], False), ([], True), (["--prefix-reuse", "off"], False),
                        (["--model", "qwen3_5-tiny"], True)):
        args = script.parse_args(flags)
        script.resolve_prefix_reuse(args)
        assert args.prefix_reuse is want, flags


def test_memory_fit_counts_the_held_prompt(script):
    """With prefix reuse a group over --max-tokens holds its prompt: the memory model counts it."""
    group = RolloutGroup([1] * 16384, [[2] * 2048] * 16, rewards=[0.0] * 16)
    for reuse, held in (("auto", 16384), ("off", 0)):
        args = script.parse_args(["--model", "qwen3-4b", "--recompute", "selective", "--max-tokens", "20000",
                                  "--prefix-reuse", reuse])
        script.resolve_prefix_reuse(args)
        fit = script.fit_within(args, [group], 1e15)
        want = MemoryModel.for_card("qwen3-4b").held_prompt_bytes(held, "selective")
        assert fit.estimate.parts.get("held prompt", 0) == want and (want > 0) == (reuse == "auto")
