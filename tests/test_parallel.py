"""Model parallelism on the packed layout against the single-process model.

Each run of ``distributed_worker.PARALLEL_RUNS`` takes one GRPO step (behaviour and reference
log-probs, KL term) through Megatron's DDP and schedule on several gloo processes, with the
micro-batches padded to the run's ``ParallelSizes.token_multiple``. The test assembles the ranks'
parameters into full tensors, loads them into a model of one process and runs the same step on
unpadded micro-batches: the per-response log-probs, entropies, losses and metrics that every rank
returns, and the gradients of every full parameter, must match; so must forward_logprobs on the
packed layout, and on the replicated layout where Megatron's attention runs it (no CP). Runs with
activation recompute are compared with a reference built without it. Two PPO mini-batches on two
data-parallel ranks end with the parameters of one process. The ``trees_`` runs do the same on
prefix trees of trajectories, the ``reuse_`` runs on prefix-reuse parts, whose prompt runs once
each way on every rank (under pipeline parallelism, once per stage) and whose forward-only step
stands in for forward_logprobs.
"""
from collections import defaultdict

import pytest
import torch

from distributed_worker import LOSS, PARALLEL_RUNS, launch, micro_batches, packed_logprobs, ppo_run
from megatron_dualkv.mcore import ParallelSizes
from megatron_dualkv.models import build_model
from megatron_dualkv.models.family import VOCAB_TENSORS
from megatron_dualkv.rl import forward_backward
from rollouts import max_abs_diff

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU")

TWO_RANK_RUNS = [name for name, run in PARALLEL_RUNS.items() if run.world == 2] + ["ppo_dp2"]
FOUR_RANK_RUNS = [name for name, run in PARALLEL_RUNS.items() if run.world == 4]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return launch(TWO_RANK_RUNS, 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory):
    return launch(FOUR_RANK_RUNS, 4, tmp_path_factory.mktemp("four_ranks"))


@pytest.mark.parametrize("name", [name for name in TWO_RANK_RUNS if name in PARALLEL_RUNS])
def test_two_ranks_match_one_process(two_rank_results, name):
    check_against_one_process(name, two_rank_results[name])


def test_ppo_mini_batches_on_two_data_parallel_ranks_match_one_process(two_rank_results):
    """Each mini-batch's loss normaliser counts both ranks' responses, and a padding micro-batch
    adds nothing (not even to the KL term): two optimizer steps at dp=2 are those of one process."""
    ranks = two_rank_results["ppo_dp2"]
    assert [r["padding"] for r in ranks] == [[[False], [False]], [[False], [True]]]
    want = ppo_run()
    assert want["padding"] == [[False], [False]]
    for rank, result in enumerate(ranks):
        assert result["parameters"].keys() == want["parameters"].keys()
        for n, value in want["parameters"].items():
            torch.testing.assert_close(result["parameters"][n], value, rtol=1e-5, atol=1e-6, msg=f"{n} on rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_RANK_RUNS)
def test_four_ranks_match_one_process(four_rank_results, name):
    check_against_one_process(name, four_rank_results[name])


def check_against_one_process(name, ranks):
    run = PARALLEL_RUNS[name]
    full = assemble(ranks)
    model = build_model(run.card, **run.reference_kwargs())
    names = {n for n, _ in model.named_parameters()}
    assert set(full) == names, f"parameters missing {sorted(names - set(full))}, unexpected {sorted(set(full) - names)}"
    vocab = model.unpadded_vocab_size
    with torch.no_grad():
        for n, p in model.named_parameters():
            # a vocabulary padded for tp=2 has other padding rows than one process: the real rows count
            real_rows(n, p, vocab).copy_(real_rows(n, full[n]["value"], vocab))
            if n in VOCAB_TENSORS:
                assert not full[n]["grad"][vocab:].any(), f"{n}: padded rows get no gradient"
    batches = micro_batches(pad_to_multiple_of=1, trees=run.trees, reuse=run.reuse)
    with torch.no_grad():
        logprobs = packed_logprobs(model, batches, run.reuse)
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, LOSS, with_entropy=True)
    for rank, result in enumerate(ranks):
        for layout in ("logprobs", "replicated"):
            if result[layout] is not None:
                assert len(result[layout]) == len(logprobs)
                for got, want in zip(result[layout], logprobs):
                    assert max_abs_diff(got, want) < 2e-6, f"forward_logprobs ({layout}) on rank {rank}"
        assert len(result["outputs"]) == len(outputs), f"rank {rank} returned {len(result['outputs'])} outputs"
        # every rank (each pipeline stage) runs the prompt once each way
        assert result["prompt_passes"] == dict(forward=int(run.reuse), backward=int(run.reuse)), f"rank {rank}"
        for got, want in zip(result["outputs"], outputs):
            assert max_abs_diff(got.logprobs, want.logprobs) < 2e-6, f"log-probs on rank {rank}"
            assert max_abs_diff(got.entropy, want.entropy) < 2e-6, f"entropies on rank {rank}"
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6, msg=f"loss on rank {rank}")
            assert got.metrics.keys() == want.metrics.keys()
            for metric in want.metrics:
                torch.testing.assert_close(torch.cat(got.metrics[metric]), torch.cat(want.metrics[metric]), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        got, want = real_rows(n, full[n]["grad"], vocab), real_rows(n, p.grad, vocab)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=n)
    sizes = ParallelSizes(**run.sizes)
    if sizes.token_multiple > 1 and sizes.pp == 1 and not (run.trees or run.reuse):  # what an unpadded micro-batch of 35 tokens gets
        for result in ranks:
            assert f"35 packed tokens, not a multiple of {sizes.token_multiple}" in result["unpadded_error"]
            assert f"pad_to_multiple_of={sizes.token_multiple})" in result["unpadded_error"]
    assert all(p.grad.abs().max() > 0 for n, p in model.named_parameters() if "experts" not in n)
    model.zero_grad(set_to_none=True)


def real_rows(name, tensor, vocab_size):
    return tensor[:vocab_size] if name in VOCAB_TENSORS else tensor


def assemble(ranks):
    """The ranks' parameter pieces -> per parameter name, the full ``value`` and ``grad``.

    Replicas of a piece (data, context and sequence parallel copies, the other tensor-parallel
    group of a pipeline stage) must agree; tensor-parallel pieces are concatenated in Megatron's
    split order (with ``stride`` > 1, e.g. the gated fc1, each piece holds a slice of every part).
    """
    pieces = defaultdict(dict)
    for rank, result in enumerate(ranks):
        for n, piece in result["parameters"].items():
            split = piece["split"] or dict(rank=0, size=1, dim=0, stride=1)
            seen = pieces[n].setdefault(split["rank"], (piece, split))[0]
            for key in ("value", "grad"):
                torch.testing.assert_close(piece[key], seen[key], rtol=1e-6, atol=1e-7, msg=f"{key} of {n} on rank {rank}")
    full = {}
    for n, by_rank in pieces.items():
        split = by_rank[0][1]
        assert sorted(by_rank) == list(range(split["size"])), f"{n}: tensor-parallel pieces {sorted(by_rank)}"
        full[n] = {
            key: _concatenated([by_rank[r][0][key] for r in range(split["size"])], split["dim"], split["stride"])
            for key in ("value", "grad")
        }
    return full


def _concatenated(shards, dim: int, stride: int) -> torch.Tensor:
    parts = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([part[k] for k in range(stride) for part in parts], dim)
