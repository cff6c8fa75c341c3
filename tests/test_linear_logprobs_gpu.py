"""linear_logprobs_func on the GPU (skipped without CUDA): the compiled Triton kernels in float32
against float64 at chunk edges, and in bf16 at real sizes (4096 predicting rows, hidden 2560,
Qwen3's and Gemma's vocabularies) within the flash-attention style bound: every output and
gradient within 2x the error of the same computation in plain PyTorch bf16 (the logits of the
real vocabulary, upcast, softcapped, log_softmax), both against float64 of the same inputs."""
import pytest
import torch

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv.ops.linear_logprobs import linear_logprobs_func
from test_linear_logprobs import check_against_float64, problem, run, targets_for, unfused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a GPU")


@pytest.mark.parametrize("rows, vocab, vocab_size, chunk", [
    (37, 3001, 3001, 1000), (37, 3001, 2900, 1024), (1, 5000, 4999, 2048), (513, 700, 700, 7000),
])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_float32_kernels_match_float64(rows, vocab, vocab_size, chunk, softcap):
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_against_float64(rows, 64, vocab, vocab_size, chunk, softcap, True, dtype=torch.float32, rtol=1e-5,
                              atol=1e-5, device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


@pytest.mark.parametrize("vocab_size, padded, softcap", [(151936, 151936, None), (262208, 262272, 30.0)],
                         ids=["qwen3", "gemma-padded-softcap"])
def test_bf16_within_twice_the_pytorch_error(vocab_size, padded, softcap):
    rows, hidden_size = 4096, 2560
    hidden, weight, upstream = problem(rows, hidden_size, padded, dtype=torch.bfloat16, scale=0.06, device="cuda")
    targets = targets_for(rows, vocab_size, device="cuda")
    ours = run(lambda h, w: linear_logprobs_func(h, w, targets, vocab_size=vocab_size, softcap=softcap,
                                                 with_entropy=True), hidden, weight, upstream)
    pytorch = run(lambda h, w: unfused(h, w, targets, vocab_size, softcap), hidden, weight, upstream)
    exact = run(lambda h, w: unfused(h, w, targets, vocab_size, softcap), hidden.double(), weight.double(), upstream)
    for name, a, b, e in zip(("logprobs", "entropy", "d_hidden", "d_weight"), ours, pytorch, exact):
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, e, 1e-4)
    assert torch.all(ours[3][vocab_size:] == 0)
