"""Response-token log-probs: vocab-parallel math, the indexing against a hand computation, the
packed layout against the replicated oracle (dense and MoE), tensor and expert parallelism."""
import pytest
import torch
from hypothesis import given, settings

from megatron_dualkv import pack_groups
from megatron_dualkv.mcore import DualKVPackedSeqParams
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import forward_logprobs, response_logprobs, vocab_parallel_logprobs
from rollouts import device_of, make_batch, max_abs_diff
from strategies import rollout_groups


@pytest.fixture(scope="module")
def dense():
    return build_model("qwen3-tiny")


@pytest.fixture(scope="module")
def moe():
    # exact MoE comparison: fp32, no token dropping (Megatron's default), no load-balancing loss
    return build_model("qwen3-moe-tiny", moe_aux_loss_coeff=0.0)


def test_vocab_parallel_logprobs_on_one_rank():
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(6, 50, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 50, (6,), generator=g)
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, None, with_entropy=True)
    log_softmax = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(logprobs, log_softmax[torch.arange(6), targets])
    torch.testing.assert_close(entropy, -(log_softmax.exp() * log_softmax).sum(-1))
    assert vocab_parallel_logprobs(logits, targets)[1] is None


@pytest.mark.parametrize("vocab_size", [37, 50])
def test_padded_columns_count_in_no_softmax(vocab_size):
    """The columns from vocab_size on (padding, made the largest logits here) change neither the
    log-probs nor the entropy and get zero gradient: as the float64 softmax over the real columns."""
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(6, 50, generator=g, dtype=torch.float64)
    logits[:, vocab_size:] = 100.0
    logits.requires_grad_()
    targets = torch.randint(0, vocab_size, (6,), generator=g)
    weights = torch.randn(2, 6, generator=g, dtype=torch.float64)
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, None, True, vocab_size)
    (grad,) = torch.autograd.grad((weights[0] * logprobs + weights[1] * entropy).sum(), logits)
    real = logits.detach()[:, :vocab_size].requires_grad_()
    log_softmax = torch.log_softmax(real, -1)
    want_logprobs, want_entropy = log_softmax[torch.arange(6), targets], -(log_softmax.exp() * log_softmax).sum(-1)
    (want_grad,) = torch.autograd.grad((weights[0] * want_logprobs + weights[1] * want_entropy).sum(), real)
    torch.testing.assert_close(logprobs, want_logprobs)
    torch.testing.assert_close(entropy, want_entropy)
    torch.testing.assert_close(grad[:, :vocab_size], want_grad)
    assert not grad[:, vocab_size:].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused (compiled) path runs on CUDA")
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("vocab_size", [None, 2950])  # 2950: the last 51 columns are padding
def test_fused_cuda_path_matches_float64(with_entropy, vocab_size):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, columns = 37, 3001  # odd sizes: no block divides them
    vocab = vocab_size or columns
    logits = (4 * torch.randn(rows, columns, device="cuda", generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    weights = torch.randn(2, rows, device="cuda", generator=g)
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, None, with_entropy, vocab_size)
    loss = (weights[0] * logprobs).sum() + ((weights[1] * entropy).sum() if with_entropy else 0)
    (grad,) = torch.autograd.grad(loss, logits)
    assert not grad[:, vocab:].any()
    grad = grad[:, :vocab]
    exact = logits.detach()[:, :vocab].double().requires_grad_()
    log_softmax = torch.log_softmax(exact, -1)
    exact_loss = (weights[0].double() * log_softmax[torch.arange(rows), targets]).sum()
    if with_entropy:
        exact_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        torch.testing.assert_close(entropy.double(), exact_entropy, rtol=1e-5, atol=1e-5)
        exact_loss = exact_loss + (weights[1].double() * exact_entropy).sum()
    (exact_grad,) = torch.autograd.grad(exact_loss, exact)
    torch.testing.assert_close(logprobs.double(), log_softmax[torch.arange(rows), targets].detach(), rtol=1e-5, atol=1e-5)
    # the gradient is stored in bfloat16: compare at its precision
    torch.testing.assert_close(grad.double(), exact_grad, rtol=1e-2, atol=1e-2 * exact_grad.abs().max().item())


def test_indexing_against_a_hand_computation(dense):
    """Token j of a response is predicted by the logits one position earlier in its own sequence:
    the group's last prompt token for j = 0, the response's previous token otherwise."""
    batch = make_batch().to(device_of(dense))
    with torch.no_grad():
        params = DualKVPackedSeqParams.from_layout(batch.layout)
        logits = dense(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0].double()
        got = forward_logprobs(dense, batch)
    start = 0
    for g, (p, rs) in enumerate(zip(batch.layout.prompt_lens, batch.layout.response_lens)):
        last_prompt, response_start = start + p - 1, start + p
        for i, r in enumerate(rs):
            assert got[g][i].shape == (r,) and got[g][i].dtype == torch.float32
            for j in range(r):
                predictor = last_prompt if j == 0 else response_start + j - 1
                want = torch.log_softmax(logits[predictor], -1)[batch.tokens[response_start + j]]
                assert abs(got[g][i][j].item() - want.item()) < 1e-5, (g, i, j)
            response_start += r
        start = response_start


@given(rollout_groups(max_groups=4, max_prompt=10, max_responses=4, max_response=8, vocab=256))
@settings(max_examples=12, deadline=None)
def test_packed_equals_replicated_dense(dense, groups):
    batch = pack_groups(groups, pad_to_multiple_of=8)
    with torch.no_grad():
        packed, packed_entropy = response_logprobs(dense, batch, "packed", with_entropy=True)
        replicated, replicated_entropy = response_logprobs(dense, batch, "replicated", with_entropy=True)
    torch.testing.assert_close(packed, replicated, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(packed_entropy, replicated_entropy, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_equals_replicated_moe(moe, seed):
    batch = make_batch(seed=seed)
    with torch.no_grad():
        packed = forward_logprobs(moe, batch)
        replicated = forward_logprobs(moe, batch, layout="replicated")
    assert max_abs_diff(packed, replicated) < 2e-6


def test_bad_input(dense):
    batch = make_batch()
    with pytest.raises(ValueError, match="layout must be one of"):
        forward_logprobs(dense, batch, layout="shared")
    with pytest.raises(ValueError, match="expected a PackedBatch"):
        forward_logprobs(dense, batch.replicated())
    with pytest.raises(ValueError, match=r"token id \d+ is outside the model.s vocabulary of 256"):
        forward_logprobs(dense, make_batch(vocab=301, seed=3))


two_cpu_ranks = pytest.mark.skipif(torch.cuda.is_available(), reason="two gloo ranks on the CPU")


def run_two_ranks(scenario, tmp_path):
    from distributed_worker import launch

    return launch([scenario], 2, tmp_path)[scenario]


@two_cpu_ranks
def test_tensor_parallel_matches_one_rank(dense, tmp_path):
    """tp=2 (same seed, so the same full weights): log-probs, GRPO gradients of a replicated and a
    vocab-split parameter, vocab_parallel_logprobs against the float64 softmax over the real
    vocabulary (all 256 columns, or fewer: padding in rank 1's shard, or all of it), and
    linear_logprobs_func on weight shards against one rank with the whole weight."""
    from distributed_worker import FUSED_CASES, VOCAB_SIZES, fixed_logits_and_targets, fixed_projection, fused_projection
    from megatron_dualkv.rl import GRPOLoss, RLMicroBatch, forward_backward
    from rollouts import perturbed

    ranks = run_two_ranks("tp2", tmp_path)
    batch = make_batch()
    packed = forward_logprobs(dense, batch)
    dense.zero_grad(set_to_none=True)
    forward_backward(dense, [RLMicroBatch(batch, old_logprobs=perturbed(packed, 0.05))], GRPOLoss())
    for result in ranks:
        assert max_abs_diff(result["packed"], packed) < 2e-6
        assert max_abs_diff(result["replicated"], packed) < 2e-6
        torch.testing.assert_close(result["final_norm_grad"], dense.decoder.final_layernorm.weight.grad, rtol=1e-4, atol=1e-6)
    output_grad = torch.cat([r["output_grad"] for r in ranks])
    torch.testing.assert_close(output_grad, dense.output_layer.weight.grad, rtol=1e-4, atol=1e-6)
    dense.zero_grad(set_to_none=True)

    logits, targets = fixed_logits_and_targets()
    for vocab_size in VOCAB_SIZES:  # rank 1's shard: all tokens, partly padding, all padding
        real = logits[:, :vocab_size].double().requires_grad_()
        logprobs, entropy = vocab_parallel_logprobs(real, targets % real.shape[1], None, with_entropy=True)
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        want_grad = torch.cat([real.grad.float(), real.grad.new_zeros(7, 256 - real.shape[1]).float()], dim=1)
        for result in ranks:
            torch.testing.assert_close(result["vocab"][vocab_size]["logprobs"], logprobs.float())
            torch.testing.assert_close(result["vocab"][vocab_size]["entropy"], entropy.float())
        grad = torch.cat([r["vocab"][vocab_size]["grad"] for r in ranks], dim=1)
        torch.testing.assert_close(grad, want_grad)
        assert not grad[:, real.shape[1]:].any(), "padded columns get no gradient"

    for case, (vocab_size, softcap) in enumerate(FUSED_CASES):
        logprobs, entropy, d_hidden, d_weight = fused_projection(*fixed_projection(vocab_size), vocab_size, softcap)
        for result in ranks:
            got = result["fused"][case]
            torch.testing.assert_close(got[0], logprobs, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[1], entropy, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[2], d_hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.cat([r["fused"][case][3] for r in ranks]), d_weight, rtol=1e-12, atol=1e-12)


@two_cpu_ranks
def test_expert_parallel_packed_equals_replicated(tmp_path):
    """ep=2 over gloo: the alltoall dispatcher exchanges tokens between ranks (each holds 4 experts)."""
    for result in run_two_ranks("ep2", tmp_path):
        assert max_abs_diff(result["packed"], result["replicated"]) < 2e-6
