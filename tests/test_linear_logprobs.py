"""linear_logprobs_func (the vocabulary projection, log-softmax and gather fused and chunked over
the vocabulary) against the unfused computation in float64: log-probs, entropies and the
gradients of the hidden states and the weight under random upstream gradients, with softcaps,
padded vocabularies, chunk edges and odd sizes; the Triton kernels (interpreter) in float32 and
within twice PyTorch's float16 error; and the model integration (hidden states of the predicting
rows only) against the logits of every token, for dense, tied and softcapped models.
Tensor parallelism: test_rl_logprobs.test_tensor_parallel_matches_one_rank."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv.mcore import DualKVPackedSeqParams
from megatron_dualkv.models import build_model
from megatron_dualkv.ops.linear_logprobs import linear_logprobs_func
from megatron_dualkv.rl import ResponseTokens, response_logprobs, vocab_parallel_logprobs
from rollouts import device_of, make_batch


def unfused(hidden, weight, targets, vocab_size=None, softcap=None):
    """The logits of the real vocabulary, (softcapped,) log_softmax, gathered; the entropy."""
    logits = (hidden @ weight.T)[:, :vocab_size]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    log_softmax = logits.log_softmax(-1)
    return log_softmax.gather(1, targets[:, None])[:, 0], -(log_softmax.exp() * log_softmax).sum(-1)


def problem(rows, hidden_size, vocab, seed=0, dtype=torch.float64, scale=1.0, device="cpu"):
    """hidden, weight, upstream gradients of the log-probs and entropies (float64 draws, cast)."""
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g, dtype=torch.float64, device=device)
    weight = scale * torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64, device=device)
    upstream = torch.randn(2, rows, generator=g, dtype=torch.float64, device=device)
    return hidden.to(dtype), weight.to(dtype), upstream


def run(fn, hidden, weight, upstream, with_entropy=True):
    """(log-probs, entropy, d hidden, d weight) of ``fn(hidden, weight)`` under the loss
    ``sum(g0 * logp) + sum(g1 * H)``."""
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    logprobs, entropy = fn(h, w)
    loss = (upstream[0].to(logprobs.dtype) * logprobs).sum()
    if with_entropy:
        loss = loss + (upstream[1].to(entropy.dtype) * entropy).sum()
    d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
    return logprobs, entropy, d_hidden, d_weight


def targets_for(rows, vocab_size, seed=1, device="cpu"):
    return torch.randint(0, vocab_size, (rows,), generator=torch.Generator(device).manual_seed(seed), device=device)


def check_against_float64(rows, hidden_size, vocab, vocab_size, chunk, softcap, with_entropy, dtype=torch.float64,
                          seed=0, rtol=1e-9, atol=1e-9, device="cpu", use_kernels=None):
    hidden, weight, upstream = problem(rows, hidden_size, vocab, seed, dtype, device=device)
    targets = targets_for(rows, vocab_size, seed, device)
    got = run(lambda h, w: linear_logprobs_func(h, w, targets, vocab_size=vocab_size, softcap=softcap,
                                                with_entropy=with_entropy, chunk_columns=chunk, use_kernels=use_kernels),
              hidden, weight, upstream, with_entropy)
    want = run(lambda h, w: unfused(h, w, targets, vocab_size, softcap), hidden.double(), weight.double(), upstream,
               with_entropy)
    assert (got[1] is not None) == with_entropy
    for name, a, b in zip(("logprobs", "entropy", "d_hidden", "d_weight"), got, want):
        if a is None:
            continue
        assert a.shape == b.shape, name
        assert a.dtype == (torch.float64 if dtype == torch.float64 else torch.float32 if name in ("logprobs", "entropy")
                           else dtype), name
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol * (1 + b.abs().max().item()), msg=name)
    assert torch.all(got[3][vocab_size:] == 0), "padding rows of the weight get no gradient"


@pytest.mark.parametrize("rows, vocab, chunk", [
    (9, 40, 7),  # the last chunk narrower
    (9, 40, 8),  # chunks divide the vocabulary
    (9, 40, 64),  # one chunk wider than the vocabulary
    (9, 40, 1),  # one column per chunk
    (1, 40, 7),  # one row
    (300, 5, 2),  # more rows than columns
])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_the_unfused_computation_in_float64(rows, vocab, chunk, softcap, with_entropy):
    check_against_float64(rows, 6, vocab, vocab, chunk, softcap, with_entropy)


@pytest.mark.parametrize("vocab_size, chunk", [(33, 7), (28, 7), (1, 7), (40, 64)])
def test_padded_vocabulary_columns_are_left_out(vocab_size, chunk):
    """Columns from vocab_size on: never in a softmax (a chunk ending at, or lying wholly in, the padding)."""
    check_against_float64(9, 6, 40, vocab_size, chunk, 3.0, True)
    hidden, weight, upstream = problem(9, 6, 40)
    targets = targets_for(9, vocab_size)
    huge = weight.clone()
    huge[vocab_size:] = 1e6  # their logits would swamp every softmax
    for w in (weight, huge):
        logprobs, entropy = linear_logprobs_func(hidden, w, targets, vocab_size=vocab_size, with_entropy=True,
                                                 chunk_columns=chunk)
        want = unfused(hidden, weight, targets, vocab_size)
        torch.testing.assert_close(logprobs, want[0])
        torch.testing.assert_close(entropy, want[1])


@given(
    rows=st.integers(1, 9), hidden_size=st.integers(1, 7), vocab=st.integers(1, 45), padding=st.integers(0, 44),
    chunk=st.integers(1, 50), softcap=st.sampled_from([None, 0.7, 30.0]), with_entropy=st.booleans(),
    seed=st.integers(0, 100),
)
@settings(max_examples=40, deadline=None)
def test_odd_sizes(rows, hidden_size, vocab, padding, chunk, softcap, with_entropy, seed):
    check_against_float64(rows, hidden_size, vocab, max(1, vocab - padding), chunk, softcap, with_entropy, seed=seed)


@pytest.mark.parametrize("rows, vocab, vocab_size, chunk", [
    (13, 1100, 1100, 2048), (13, 1100, 1030, 300), (5, 37, 37, 9),
])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_kernels_in_float32(rows, vocab, vocab_size, chunk, softcap):
    """The Triton kernels (interpreter on CPU) in float32: tiles of 4 x 1024 against chunks wider,
    narrower and ragged."""
    check_against_float64(rows, 8, vocab, vocab_size, chunk, softcap, True, dtype=torch.float32, rtol=1e-5, atol=1e-5,
                          use_kernels=True)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_half_precision_within_twice_the_pytorch_error(softcap):
    """float16 (bf16 needs the GPU: tests/test_linear_logprobs_gpu.py): every output and gradient
    within 2x the error of the unfused computation in PyTorch at the same precision, against
    float64 of the same inputs."""
    hidden, weight, upstream = problem(16, 32, 1100, dtype=torch.float16, scale=0.5)
    targets = targets_for(16, 1050)
    ours = run(lambda h, w: linear_logprobs_func(h, w, targets, vocab_size=1050, softcap=softcap, with_entropy=True,
                                                 chunk_columns=400, use_kernels=True), hidden, weight, upstream)
    pytorch = run(lambda h, w: unfused(h, w, targets, 1050, softcap), hidden, weight, upstream)
    exact = run(lambda h, w: unfused(h, w, targets, 1050, softcap), hidden.double(), weight.double(), upstream)
    for name, a, b, e in zip(("logprobs", "entropy", "d_hidden", "d_weight"), ours, pytorch, exact):
        assert_within_twice_the_reference_error(name, a, b, e, 1e-4)


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_holds_the_logits_of_all_rows():
    """No tensor made forward or backward is larger than a chunk of logits or the weight."""
    rows, vocab, chunk = 50, 400, 40
    hidden, weight, upstream = problem(rows, 6, vocab)
    targets = targets_for(rows, vocab)
    with _LargestOutput() as mode:
        run(lambda h, w: linear_logprobs_func(h, w, targets, with_entropy=True, chunk_columns=chunk), hidden, weight,
            upstream)
    assert mode.largest <= max(rows * chunk, weight.numel()) < rows * vocab


def test_no_rows():
    hidden, weight, upstream = problem(0, 6, 40)
    logprobs, entropy, d_hidden, d_weight = run(
        lambda h, w: linear_logprobs_func(h, w, torch.zeros(0, dtype=torch.long), with_entropy=True), hidden, weight,
        upstream)
    assert logprobs.shape == entropy.shape == (0,) and d_hidden.shape == (0, 6)
    assert torch.all(d_weight == 0)


def test_matches_vocab_parallel_logprobs_on_the_logits():
    """The logits-level entry point, on the logits this op never forms, gives the same numbers."""
    hidden, weight, upstream = problem(11, 6, 40)
    targets = targets_for(11, 40)
    got = run(lambda h, w: linear_logprobs_func(h, w, targets, with_entropy=True, chunk_columns=16), hidden, weight,
              upstream)
    want = run(lambda h, w: vocab_parallel_logprobs(h @ w.T, targets, None, True), hidden, weight, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_bad_inputs_name_the_argument():
    hidden, weight, _ = problem(3, 4, 10)
    targets = torch.tensor([0, 5, 9])
    cases = [
        (dict(hidden=hidden[0]), "hidden must be a .rows, hidden. tensor"),
        (dict(weight=weight[None]), "weight must be a .vocabulary shard, hidden. tensor"),
        (dict(weight=weight[:, :3]), "hidden has 4 features, weight 3"),
        (dict(hidden=hidden.long()), "hidden must be float16, bfloat16, float32 or float64"),
        (dict(weight=weight.float()), "differ in dtype or device"),
        (dict(targets=targets[:2]), r"targets must have shape \(3,\)"),
        (dict(targets=targets.double()), "targets must hold integer token ids"),
        (dict(targets=torch.tensor([0, 10, 1])), "target id 10 is outside the vocabulary of 10"),
        (dict(targets=torch.tensor([0, -1, 1])), "target id -1 is outside"),
        (dict(vocab_size=8), r"target id 9 is outside the vocabulary of 8 \(ids from 8 on pad the vocabulary\)"),
        (dict(vocab_size=11), r"vocab_size must be an int in \[1, 10\]"),
        (dict(vocab_size=0), "vocab_size must be an int"),
        (dict(softcap=0.0), "softcap must be positive"),
        (dict(chunk_columns=0), "chunk_columns must be a positive int"),
        (dict(with_entropy=1), "with_entropy must be a bool"),
    ]
    for change, message in cases:
        args = dict(hidden=hidden, weight=weight, targets=targets)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            linear_logprobs_func(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


# The model integration: the hidden states of the predicting rows only, against the logits of
# every packed (or replicated) token selected afterwards, as before.

@pytest.fixture(scope="module", params=["qwen3-tiny", "gemma3-tiny", "gemma4-tiny"])
def model(request):
    """Untied; tied to the embedding; tied with a final logit softcap."""
    return build_model(request.param)


def logprobs_from_all_logits(model, batch, layout):
    """Every token's logits from a plain call of the model, then the rows that predict response tokens."""
    tokens = ResponseTokens.from_layout(batch.layout)
    if layout == "packed":
        logits = model(batch.tokens[None], batch.position_ids[None], None,
                       packed_seq_params=DualKVPackedSeqParams.from_layout(batch.layout))[0]
        return vocab_parallel_logprobs(logits[tokens.predictor_index], batch.tokens[tokens.token_index], None, True)
    sequences = [(p, r) for p, rs in zip(batch.layout.prompt_lens, batch.layout.response_lens) for r in rs]
    rep = batch.replicated()
    ids = torch.nn.utils.rnn.pad_sequence(rep.split(rep.tokens), batch_first=True)
    logits = model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)
    rows = torch.cat([logits[i, p - 1 : p - 1 + r] for i, (p, r) in enumerate(sequences)])
    return vocab_parallel_logprobs(rows, batch.tokens[tokens.token_index], None, True)


@pytest.mark.parametrize("layout", ["packed", "replicated"])
def test_model_log_probs_and_every_gradient_match_all_logits(model, layout):
    batch = make_batch().to(device_of(model))
    tokens = ResponseTokens.from_layout(batch.layout)
    upstream = torch.randn(2, tokens.num_tokens, generator=torch.Generator().manual_seed(3)).to(batch.tokens.device)
    results = []
    for fn in (lambda: response_logprobs(model, batch, layout, with_entropy=True),
               lambda: logprobs_from_all_logits(model, batch, layout)):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = fn()
        ((upstream[0] * logprobs).sum() + (upstream[1] * entropy).sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.zero_grad(set_to_none=True)
    (logprobs, entropy, grads), (want_logprobs, want_entropy, want_grads) = results
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=2e-6)
    for name, grad in want_grads.items():
        # float32 sums in another order (attention and the MLP see other rows' gradients in
        # another grouping): differences of a few 1e-7 of the tensor's largest element
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6 + 1e-5 * grad.abs().max().item(), msg=name)
    tied = model.share_embeddings_and_output_weights
    assert grads["embedding.word_embeddings.weight" if tied else "output_layer.weight"].abs().max() > 0


def test_a_plain_call_still_returns_logits(model):
    batch = make_batch().to(device_of(model))
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    logits = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)
    hidden = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params, skip_output_layer=True)
    assert logits.shape == (1, batch.num_tokens, model.vocab_size)
    assert hidden.shape == (batch.num_tokens, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match="cannot compute the loss of labels"):
        model(batch.tokens[None], batch.position_ids[None], None, labels=batch.tokens[None], packed_seq_params=params,
              skip_output_layer=True)
