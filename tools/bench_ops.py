"""Ops alone on the GPU, in bf16.

``--mode elementwise`` (default): Gemma's elementwise ops at Gemma-4-31B shapes, Qwen3-4B's q
norm + RoPE and Qwen3.5-4B's short conv on a packed group, our Triton kernels against the PyTorch
ops they replace (eager, and ``torch.compile``'d), forward and forward+backward. For each op:
median time and the bandwidth it reaches over the least traffic the op needs (its inputs read and
its outputs written once per direction, in bf16), so a kernel far below the card's ~4.8 TB/s shows
at once.

``--mode logprobs``: the response-token log-probs of one packed group from the final hidden states,
Qwen3's and Gemma's vocabularies: ``all_logits`` (the output layer on every packed token, then the
rows that predict response tokens through ``vocab_parallel_logprobs``: the path before
``linear_logprobs_func``) against ``fused`` (``linear_logprobs_func`` on those rows only). For each:
median forward and forward+backward time, and the forward+backward peak memory above the inputs
(the hidden states, the weight and their gradients' shapes are the same for both).

Prints a table and writes CSV (ops.csv, logprobs.csv):

    python tools/bench_ops.py --out bench/                 # N=16, P=8192, R=1024: 24,576 tokens
    python tools/bench_ops.py --ops geglu --tokens 8192
    python tools/bench_ops.py --mode logprobs --out bench/ # 16,384 of the 24,576 rows predict
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]  # the other tools, the package; also when imported by path
from bench_attention import bench, write_table  # noqa: E402
from megatron_dualkv.cli import ArgumentParser  # noqa: E402
from tool_args import comma_names  # noqa: E402
from megatron_dualkv.layout import DualKVLayout  # noqa: E402
from megatron_dualkv.ops.causal_conv1d import causal_conv1d_func  # noqa: E402
from megatron_dualkv.ops.geglu import geglu_func, geglu_reference  # noqa: E402
from megatron_dualkv.ops.linear_logprobs import linear_logprobs_func  # noqa: E402
from megatron_dualkv.ops.rms_norm import rms_norm_func, rms_norm_reference  # noqa: E402
from megatron_dualkv.ops.rms_norm_rope import rms_norm_rope_func, rms_norm_rope_reference  # noqa: E402
from megatron_dualkv.rl import ResponseTokens, vocab_parallel_logprobs  # noqa: E402

HIDDEN, FFN, HEADS, HEAD_DIM = 5376, 21504, 32, 256  # Gemma 4 31B (sliding layers' head dim)
QWEN35_CONV_CHANNELS = 8192  # Qwen3.5-4B: 16 key heads' q and k (128 each) and 32 value heads' v (128)
QWEN3_HEADS, QWEN3_HEAD_DIM = 32, 128  # Qwen3-4B's query heads
VOCABS = {"qwen3": 151936, "gemma3": 262208}
LOGPROB_HIDDEN = 2560  # Qwen3-4B and Gemma-3-4B
LOGPROB_METHODS = ("all_logits", "fused")


@dataclass
class Op:
    """``make(tokens, device)`` -> the inputs, the first ``leaves`` taking gradients (None: all);
    ``ours`` and ``pytorch`` map them to the output; ``fwd_elements`` / ``bwd_elements``: the least
    traffic of each direction."""
    make: Callable[[int, torch.device], Tuple[torch.Tensor, ...]]
    ours: Callable
    pytorch: Callable
    fwd_elements: Callable[[Tuple[torch.Tensor, ...]], int]
    bwd_elements: Callable[[Tuple[torch.Tensor, ...]], int]
    leaves: Optional[int] = None


def _randn(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def _rms_norm(*row_shape: int) -> Op:
    """RMSNorm with a weight over the last dim of (tokens, *row_shape): x in, y out; x and dy in, dx out."""
    return Op(
        lambda t, d: (_randn(t, *row_shape, device=d), _randn(row_shape[-1], device=d)),
        lambda x, w: rms_norm_func(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6),
        lambda xs: 2 * xs[0].numel(), lambda xs: 3 * xs[0].numel(),
    )


def _rms_norm_rope(heads: int, head_dim: int) -> Op:
    """Qwen3's q norm + RoPE on (tokens, 1, heads, head_dim), float32 weight and angles as the model
    has them: x in, y out; x and dy in, dx out."""
    def make(t, d):
        freqs = torch.rand(t, 1, 1, head_dim, device=d) * 1000  # angles of any position
        return _randn(t, 1, heads, head_dim, device=d), torch.ones(head_dim, device=d), freqs

    return Op(
        make, lambda x, w, f: rms_norm_rope_func(x, w, 1e-6, f), lambda x, w, f: rms_norm_rope_reference(x, w, 1e-6, f),
        lambda xs: 2 * xs[0].numel(), lambda xs: 3 * xs[0].numel(), leaves=2,
    )


@functools.lru_cache(maxsize=None)
def _group_of(tokens: int, device: torch.device) -> DualKVLayout:
    """A prompt of a third of the rows and up to 16 responses sharing the rest (24,576 rows: 8192 + 16 x 1024);
    one object per size, so its kernel tables are built once, not in the timed calls."""
    prompt = max(1, tokens // 3)
    rest = tokens - prompt
    n = min(16, rest)
    return DualKVLayout((prompt,), (tuple(rest // n + (i < rest % n) for i in range(n)),)).to(device)


def _causal_conv1d(channels: int, width: int) -> Op:
    """The GDN layer's short conv with SiLU over the packed group (each response continues the prompt's
    last rows): x in, y out; x and dy in, dx out (the weight's gradient is a reduction)."""
    def conv(use_kernel: bool):
        return lambda x, w: causal_conv1d_func(x, w, _group_of(x.shape[0], x.device), activation="silu",
                                               use_kernel=use_kernel)

    return Op(
        lambda t, d: (_randn(t, channels, device=d), _randn(channels, width, device=d) / width**0.5),
        conv(True), conv(False), lambda xs: 2 * xs[0].numel(), lambda xs: 3 * xs[0].numel(),
    )


OPS = {
    "rms_norm": _rms_norm(HIDDEN),  # the layer's input / post-attention / post-MLP norms
    "rms_norm_heads": _rms_norm(HEADS, HEAD_DIM),  # the query/key norms, one row per token and head
    "rms_norm_rope": _rms_norm_rope(QWEN3_HEADS, QWEN3_HEAD_DIM),  # Qwen3's q: norm, then RoPE
    # fc1's output (gate and linear halves) -> the MLP's activation; backward: dy in, both halves' grads out
    "geglu": Op(
        lambda t, d: (_randn(t, 2 * FFN, device=d),),
        geglu_func, geglu_reference,
        lambda xs: 3 * xs[0].numel() // 2, lambda xs: 5 * xs[0].numel() // 2,
    ),
    "causal_conv1d": _causal_conv1d(QWEN35_CONV_CHANNELS, 4),  # Qwen3.5-4B's GDN q, k and v before the rule
}
METHODS = ("ours", "torch", "torch_compile")


def implementation(op: Op, method: str) -> Callable:
    if method == "ours":
        return op.ours
    return torch.compile(op.pytorch) if method == "torch_compile" else op.pytorch


def measure(name: str, method: str, tokens: int, device: torch.device) -> dict:
    op = OPS[name]
    inputs = op.make(tokens, device)
    leaves = [x.requires_grad_() for x in inputs[:op.leaves]]
    fn = implementation(op, method)
    dy = torch.randn_like(fn(*inputs))

    def fwd_bwd():
        torch.autograd.grad(fn(*inputs), leaves, dy)

    with torch.no_grad():
        fwd_ms = bench(lambda: fn(*inputs))
    fwd_bwd_ms = bench(fwd_bwd)
    fwd_bytes, bwd_bytes = (2 * count(inputs) for count in (op.fwd_elements, op.bwd_elements))  # bf16
    return dict(op=name, shape="x".join(map(str, inputs[0].shape)), method=method, fwd_ms=fwd_ms,
                fwd_bwd_ms=fwd_bwd_ms, fwd_gbps=fwd_bytes / fwd_ms / 1e6,
                fwd_bwd_gbps=(fwd_bytes + bwd_bytes) / fwd_bwd_ms / 1e6)


def logprob_inputs(vocab: int, group: Tuple[int, int, int], device: torch.device):
    """(hidden [P + N*R, H] and weight [V, H], both taking gradients; the packed rows that predict
    response tokens, their targets, upstream gradients of the log-probs and entropies)."""
    responses, prompt, response = group
    tokens = ResponseTokens.from_layout(DualKVLayout((prompt,), ((response,) * responses,)), device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(prompt + responses * response, LOGPROB_HIDDEN, device=device, generator=g)
    weight = 0.06 * torch.randn(vocab, LOGPROB_HIDDEN, device=device, generator=g)  # logits of std ~3
    targets = torch.randint(0, vocab, (tokens.num_tokens,), device=device, generator=g)
    upstream = torch.randn(2, tokens.num_tokens, device=device, generator=g)
    leaves = [t.bfloat16().requires_grad_() for t in (hidden, weight)]
    return leaves, tokens.predictor_index, targets, upstream


def logprob_method(method: str, hidden, weight, rows, targets, with_entropy: bool):
    if method == "all_logits":  # Megatron's output layer on every token, then the predicting rows
        return vocab_parallel_logprobs((hidden @ weight.T)[rows], targets, None, with_entropy)
    return linear_logprobs_func(hidden[rows], weight, targets, with_entropy=with_entropy)


def measure_logprobs(name: str, method: str, with_entropy: bool, group, device: torch.device) -> dict:
    (hidden, weight), rows, targets, upstream = logprob_inputs(VOCABS[name], group, device)

    def forward():
        return logprob_method(method, hidden, weight, rows, targets, with_entropy)

    def fwd_bwd():
        logprobs, entropy = forward()
        loss = (upstream[0] * logprobs).sum() + ((upstream[1] * entropy).sum() if with_entropy else 0)
        return torch.autograd.grad(loss, (hidden, weight))

    fwd_bwd()  # compiles (the all_logits path's torch.compile'd sums) and autotunes before the peak is taken
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
    del grads
    with torch.no_grad():
        forward()  # the all_logits path compiles again without autograd
        fwd_ms = bench(forward)
    return dict(_logprob_row(name, method, with_entropy), rows=f"{hidden.shape[0]}>{rows.numel()}", fwd_ms=fwd_ms,
                fwd_bwd_ms=bench(fwd_bwd), peak_gib=peak / 2**30)


def _logprob_row(name: str, method: str, with_entropy: bool) -> dict:
    return dict(vocab=f"{name} {VOCABS[name]}", rows="", method=method, entropy="yes" if with_entropy else "no")


def logprobs_main(args, device: torch.device) -> None:
    group = (16, 8192, 1024)
    rows = []
    for name in VOCABS:
        for with_entropy in (False, True):
            for method in LOGPROB_METHODS:
                try:
                    rows.append(measure_logprobs(name, method, with_entropy, group, device))
                except Exception as e:  # noqa: BLE001 - report the row and go on
                    error = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(dict(_logprob_row(name, method, with_entropy), error=error))
                torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, one group of {group[0]} x {group[1]} x {group[2]}, hidden "
          f"{LOGPROB_HIDDEN}, bf16; peak: forward+backward above the inputs and the two gradients")
    os.makedirs(args.out, exist_ok=True)
    write_table(rows, os.path.join(args.out, "logprobs.csv"), [
        ("vocab", "vocabulary", "14"), ("rows", "rows", "12"), ("method", "method", "11"), ("entropy", "entropy", "8"),
        ("fwd_ms", "fwd ms", "8.2f"), ("fwd_bwd_ms", "fwd+bwd ms", "10.2f"), ("peak_gib", "peak GiB", "9.2f"),
    ])


def main():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("elementwise", "logprobs"), default="elementwise")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--tokens", type=int, default=16 * 1024 + 8192, help="rows: P + N*R of one packed group")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    ops, methods = comma_names(parser, "--ops", args.ops, OPS), comma_names(parser, "--methods", args.methods, METHODS)
    if not torch.cuda.is_available():
        parser.error("bench_ops times GPU kernels: no CUDA device here")
    if args.mode == "logprobs":
        return logprobs_main(args, torch.device("cuda"))
    rows = []
    for name in ops:
        for method in methods:
            try:
                rows.append(measure(name, method, args.tokens, torch.device("cuda")))
            except Exception as e:  # noqa: BLE001 - report the row and go on
                rows.append(dict(op=name, shape="", method=method, error=f"{type(e).__name__}: {str(e)[:200]}"))
            torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, {args.tokens} tokens, bf16")
    os.makedirs(args.out, exist_ok=True)
    write_table(rows, os.path.join(args.out, "ops.csv"), [
        ("op", "op", "15"), ("shape", "shape", "16"), ("method", "method", "14"), ("fwd_ms", "fwd ms", "8.3f"),
        ("fwd_bwd_ms", "fwd+bwd ms", "10.3f"), ("fwd_gbps", "fwd GB/s", "9.0f"), ("fwd_bwd_gbps", "f+b GB/s", "9.0f"),
    ])


if __name__ == "__main__":
    main()
