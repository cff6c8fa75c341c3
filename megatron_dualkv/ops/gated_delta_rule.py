"""The gated delta rule (Gated DeltaNet's linear attention) on the packed layout: the reference
recurrence, in any dtype (float64 for the tests' oracle), with each segment starting from the
final state of its parent segment.

Per head, with a state ``h`` of shape (Dk, Dv), for each token t of a segment (Yang, Kautz and
Hatamizadeh, "Gated Delta Networks", 2024; the delta rule with a scalar decay gate):

    h     <- exp(g_t) * h                              decay, g_t = log alpha_t <= 0
    u_t    = beta_t * (v_t - h^T k_t)                  what h predicts for k_t, corrected by beta_t
    h     <- h + k_t u_t^T                             so h_t = alpha_t (I - beta_t k_t k_t^T) h_{t-1} + beta_t k_t v_t^T
    o_t    = h^T (scale * q_t)                         read out after the update

On a packed micro-batch ``[P][R1]..[RN]`` (or a prefix tree) a recurrent layer must not carry
its state across segment boundaries as one sequence would: each response continues from the
prompt's final state, not from zero and not from the previous response. Here every segment
starts from its parent's final state (a root from ``initial_state``, or zero), which is exactly
each trajectory run alone. A shared state feeds several children, so its gradient is the sum over
them: autograd gets that from the reuse of one tensor.

``gated_delta_rule_reference`` is the oracle: O(T Dk Dv) per head, token by token, on any device.
``gated_delta_rule_func`` is what the layers call. Its chunked backends run once per tree level
(``run_by_level``), every segment of a level one variable-length sequence whose initial state is
its parent's final state, so a group ``[P][R1]..[RN]`` is two calls: the prompt, then the N
responses from the prompt's state. The backends:

* ``"fla"``: fla's Triton kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, fla-core
  0.6.0; the ``hybrid`` extra), which returns final states and takes their gradients. Its backward
  refuses Hopper with Triton 3.4 to 3.7.0 (a Triton miscompile, fla issue 640; torch 2.11 pins
  Triton 3.6) unless tilelang is installed: ``fla_usable``.
* ``"torch"``: ``torch_chunk_varlen``, the same chunked (WY) form in plain PyTorch ops, which
  autograd differentiates; any device, float32 (float64 for float64 inputs) inside. The state
  passes from chunk to chunk in a Python loop (``chunk_state_scan_reference``).
* ``"triton"``: ``torch_chunk_varlen(scan="triton")``, the same with that loop replaced by one
  Triton kernel per direction (``ops.chunk_state_scan``); CUDA, or the CPU under
  ``TRITON_INTERPRET=1``; float32 inside, Dk a power of two >= 16, Dv >= 16.
* ``"reference"``: the oracle, for the tests.

``"auto"`` takes fla on CUDA where it is installed and usable, else torch (on the CPU too: an order
of magnitude faster than the token loop, and as exact). It does not take "triton" yet: its scan has
run on the CPU interpreter only, and "auto" switches to it after its first GPU test.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
from packaging.version import Version
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..layout import PackedLayout
from .checks import check_layout, triton_available
from .chunk_state_scan import chunk_state_scan_func

L2NORM_EPS = 1e-6


def gated_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    layout: PackedLayout,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The gated delta rule over every segment of ``layout``, each from its parent's final state.

    q, k: (T, H, Dk); v: (T, H, Dv); g (log decay, <= 0 in the models) and beta (in [0, 1]):
    (T, H); scale: multiplies q (default Dk ** -0.5); initial_state: (H, Dk, Dv), the state every
    root segment starts from (default zero). Returns the output (T, H, Dv) and each segment's final
    state (S, H, Dk, Dv), S = ``len(layout.nodes)``. Computes in the inputs' dtype; differentiable.
    """
    scale = _check_inputs(q, k, v, g, beta, layout, scale, initial_state)
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    start_state = initial_state if initial_state is not None else q.new_zeros(heads, dk, dv)
    outputs: List[Tensor] = []
    finals: List[Tensor] = []
    for node in layout.nodes:
        h = start_state if node.parent < 0 else finals[node.parent]
        for t in range(node.start, node.start + node.length):
            h = h * torch.exp(g[t])[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", h, k[t]))
            h = h + k[t][:, :, None] * u[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", h, q[t] * scale))
        finals.append(h)
    # nodes are in packed order, so the outputs are too
    return torch.stack(outputs), torch.stack(finals)


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKENDS = ("auto", "fla", "triton", "torch", "reference")
SCANS = ("torch", "triton")


def gated_delta_rule_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    layout: PackedLayout,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    qk_l2norm: bool = False,
    backend: str = "auto",
) -> Tuple[Tensor, Tensor]:
    """The gated delta rule over every segment of ``layout``, each from its parent's final state.

    q, k: (T, H, Dk); v: (T, HV, Dv), HV a multiple of H (value head j reads key head j // (HV/H));
    g (log decay) and beta: (T, HV), float32; initial_state: (HV, Dk, Dv) float32, every root's
    (default zero); qk_l2norm: L2-normalise q and k first (x / sqrt(sum x^2 + 1e-6)), inside the
    kernel. Returns the output (T, HV, Dv) in v's dtype and each segment's final state
    (S, HV, Dk, Dv) in float32 (float64 for float64 inputs), S = ``len(layout.nodes)``.

    backend: "fla" (CUDA; bf16, fp16 or fp32 inputs), "torch" (``torch_chunk_varlen``, any device
    and float dtype), "triton" (``torch_chunk_varlen(scan="triton")``: CUDA or the Triton
    interpreter, float32 inside, Dk a power of two >= 16, Dv >= 16), "reference", or "auto": on
    CUDA fla when it is installed, usable on this GPU and Triton (``fla_usable``) and takes the
    dtype, else torch (the CPU too). The environment variable ``DUALKV_GDN_BACKEND`` (one of the
    others) overrides what "auto" picks.
    """
    backend = _backend(q, backend)
    if q.dim() == 3 and v.dim() == 3 and v.shape[1] % q.shape[1]:
        raise ValueError(f"v's {v.shape[1]} heads must be a multiple of q's {q.shape[1]}")
    if backend == "reference":
        q, k = _per_value_head(q, k, v.shape[1], qk_l2norm)
        dtype = q.dtype
        out, finals = gated_delta_rule_reference(q, k, v.to(dtype), g.to(dtype), beta.to(dtype), layout, scale,
                                                 None if initial_state is None else initial_state.to(dtype))
        return out.to(v.dtype), finals.float() if dtype != torch.float64 else finals
    scale = scale if scale is not None else q.shape[2] ** -0.5
    if backend == "fla":
        _check_kernel_inputs(q, k, v, g, beta, layout, scale, initial_state)
        run = fla_varlen(scale, qk_l2norm)
    else:
        _check_torch_inputs(q, k, v, g, beta, layout, scale, initial_state)
        run = torch_chunk_varlen(scale, qk_l2norm, scan="triton" if backend == "triton" else "torch")
    return run_by_level(run, q, k, v, g, beta, layout, initial_state)


VarlenRule = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]], Tuple[Tensor, Tensor]]


def fla_varlen(scale: float, qk_l2norm: bool) -> VarlenRule:
    """fla's chunked rule on packed sequences: (q, k, v, g, beta, cu_seqlens, cu_seqlens on the
    host, initial states (N, HV, Dk, Dv) or None) -> (output, final states (N, HV, Dk, Dv))."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial):
        out, final = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu)
        return out[0], final

    return run


def torch_chunk_varlen(scale: float, qk_l2norm: bool, chunk_size: int = 64, scan: str = "torch") -> VarlenRule:
    """The chunked rule in plain PyTorch ops with ``fla_varlen``'s contract; autograd differentiates
    it (q, k, v, g, beta and the initial states). Computes in float32, float64 for float64 inputs.

    Every sequence is padded to the longest one's whole number of chunks, so the N sequences run as
    one (N, HV, chunks, C, D) batch and only the state recurrence loops, over the chunk index. Padding
    is inert: g = 0 keeps the decay, beta = 0 and k = 0 add nothing to the state. ``scan`` runs that
    recurrence: "torch", a Python loop; "triton", one kernel per direction (``chunk_state_scan_func``,
    which raises ValueError for what its kernels cannot take).

    Its intermediates (float32 copies of q and k per value head, each chunk's C x C matrices, the
    state after every chunk) would be several times what fla keeps per token, so they are not kept:
    the call runs under activation checkpointing and its backward recomputes them. Like fla's
    kernel, it keeps its inputs, so the memory model's count of a GDN layer holds for both.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")

    def chunked_rule(q, k, v, g, beta, cu_seqlens_cpu, initial):
        q, k = _per_value_head(q, k, v.shape[1], qk_l2norm)
        dtype = q.dtype
        padding = _ChunkPadding.of(cu_seqlens_cpu, chunk_size, q.device)
        chunked = [padding.chunked(x.to(dtype)) for x in (q * scale, k, v, g, beta)]
        if initial is None:
            initial = q.new_zeros(padding.sequences, v.shape[1], q.shape[2], v.shape[2])
        out, final = _chunk_recurrence(*chunked, initial.to(dtype), scan)
        return padding.unchunked(out).to(v.dtype), final

    def run(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial):
        if not torch.is_grad_enabled():
            return chunked_rule(q, k, v, g, beta, cu_seqlens_cpu, initial)
        return checkpoint(chunked_rule, q, k, v, g, beta, cu_seqlens_cpu, initial, use_reentrant=False)

    return run


@dataclass(frozen=True)
class _ChunkPadding:
    """Packed tokens <-> an (N, HV, chunks, C, ...) batch, each sequence zero-padded at its end."""

    gather: Tensor  # (N * chunks * C,): each padded place's packed token; T (a zero row) for padding
    real: Tensor  # (T,): each packed token's padded place
    sequences: int
    chunks: int
    chunk_size: int

    @staticmethod
    def of(cu_seqlens_cpu: Tensor, chunk_size: int, device) -> "_ChunkPadding":
        # from the host copy, so that planning the padding does not wait for the GPU; once per
        # sequence lengths, not again for every layer and every recompute
        return _ChunkPadding._of(tuple(cu_seqlens_cpu.tolist()), chunk_size, torch.device(device))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _of(boundaries: Tuple[int, ...], chunk_size: int, device: torch.device) -> "_ChunkPadding":
        cu_seqlens_cpu = torch.tensor(boundaries, dtype=torch.int64)
        starts, lengths = cu_seqlens_cpu[:-1], cu_seqlens_cpu.diff()
        sequences, tokens = len(lengths), int(cu_seqlens_cpu[-1])
        chunks = -(-int(lengths.max()) // chunk_size)
        width = chunks * chunk_size
        offset = torch.arange(width, dtype=torch.int64)
        inside = offset[None, :] < lengths[:, None]
        gather = torch.where(inside, starts[:, None] + offset[None, :], tokens).flatten()
        real = (torch.arange(sequences, dtype=torch.int64)[:, None] * width + offset[None, :])[inside]
        return _ChunkPadding(gather.to(device), real.to(device), sequences, chunks, chunk_size)

    def chunked(self, x: Tensor) -> Tensor:
        """(T, HV, ...) -> (N, HV, chunks, C, ...)."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, self.gather)
        padded = padded.view(self.sequences, self.chunks, self.chunk_size, *x.shape[1:])
        return padded.movedim(3, 1)

    def unchunked(self, x: Tensor) -> Tensor:
        """(N, HV, chunks, C, ...) -> (T, HV, ...), the padding dropped."""
        return x.movedim(1, 3).flatten(0, 2).index_select(0, self.real)


def _chunk_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                      scan: str = "torch") -> Tuple[Tensor, Tensor]:
    """The gated delta rule chunk by chunk (Yang et al., "Parallelizing Linear Transformers with the
    Delta Rule over Sequence Length", 2024, with Gated DeltaNet's scalar decay). q (already scaled),
    k: (..., chunks, C, Dk); v: (..., chunks, C, Dv); g, beta: (..., chunks, C); state: (..., Dk, Dv),
    the state before the first chunk; scan: ``chunk_state_scan_func``'s backend for the chunk-to-chunk
    part. Returns the outputs (..., chunks, C, Dv) and the last state.

    Within a chunk that starts from state S, let G_t = g_1 + .. + g_t (the log of the decay from the
    chunk's start through token t). Unrolling h_t = exp(g_t) h_{t-1} + k_t u_t^T:

        h_t = exp(G_t) S + sum_{j<=t} exp(G_t - G_j) k_j u_j^T
        u_t = beta_t (v_t - (exp(g_t) h_{t-1})^T k_t)
            = beta_t (v_t - exp(G_t) S^T k_t - sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j)

    so (I + A) U = diag(beta) V - diag(beta exp(G)) K S with A strictly lower triangular,
    A_tj = beta_t exp(G_t - G_j) (k_t . k_j). Forward substitution (a unit lower-triangular solve)
    gives the WY (UT-transform) form U = U0 - W S with U0 = (I + A)^-1 diag(beta) V and
    W = (I + A)^-1 diag(beta exp(G)) K, neither of which depends on S, so every chunk's is solved at
    once. Then, per chunk in turn (``chunk_state_scan_func``):

        O     = diag(exp(G)) Q S + (Q K^T * D) U             D_tj = exp(G_t - G_j) for j <= t, else 0
        S_new = exp(G_C) S + (diag(exp(G_C - G)) K)^T U

    With g <= 0 every exponent here is <= 0 (G falls along the chunk), so nothing overflows however
    strong the decay: nothing is divided by exp(G).
    """
    size = g.shape[-1]
    log_decay = g.cumsum(-1)  # G
    future = torch.ones(size, size, dtype=torch.bool, device=g.device).triu(1)
    pairwise = log_decay[..., :, None] - log_decay[..., None, :]  # G_t - G_j
    # masked before the exponent: above the diagonal G_t - G_j > 0 and may overflow
    decay = pairwise.masked_fill(future, float("-inf")).exp()  # D
    lower = ((k @ k.transpose(-1, -2)) * decay * beta[..., :, None]).tril(-1)  # A
    eye = torch.eye(size, dtype=k.dtype, device=k.device)
    rhs = torch.cat([beta[..., None] * v, (beta * log_decay.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attention = (q @ k.transpose(-1, -2)) * decay
    read_state = log_decay.exp()[..., None] * q  # diag(exp(G)) Q
    to_end = (log_decay[..., -1:] - log_decay).exp()[..., None] * k  # diag(exp(G_C - G)) K
    chunk_decay = log_decay[..., -1].exp()  # exp(G_C)
    return chunk_state_scan_func(u0, w, read_state, attention, to_end, chunk_decay, state, backend=scan)


@dataclass(frozen=True)
class _Level:
    """The segments of one tree depth, as one packed batch of sequences."""

    tokens: Union[slice, Tensor]  # their tokens: a slice when they are contiguous, else indices
    cu_seqlens: Tensor  # (n + 1,) int64 on the device
    cu_seqlens_cpu: Tensor  # the same on the host (fla plans its chunks from it without a sync)
    parents: Optional[Tensor]  # (n,) their parents' places in the previous level (None: roots)


@dataclass(frozen=True)
class _LevelPlan:
    levels: Tuple[_Level, ...]
    token_order: Optional[Tensor]  # where each packed token is in the levels' concatenation (None: in place)
    node_order: Optional[Tensor]  # the same for the segments' final states


def _level_plan(layout: PackedLayout, device) -> _LevelPlan:
    depth_of = [len(node.ancestors) for node in layout.nodes]
    by_depth: List[List[int]] = [[] for _ in range(max(depth_of, default=-1) + 1)]
    for index, depth in enumerate(depth_of):
        by_depth[depth].append(index)
    place = {}  # segment -> its place within its level
    levels, token_chunks = [], []
    for depth, members in enumerate(by_depth):
        place.update((index, i) for i, index in enumerate(members))
        nodes = [layout.nodes[i] for i in members]
        lengths = torch.tensor([0] + [n.length for n in nodes], dtype=torch.int64).cumsum(0)
        ranges = [torch.arange(n.start, n.start + n.length) for n in nodes]
        contiguous = all(a.start + a.length == b.start for a, b in zip(nodes, nodes[1:]))
        tokens = slice(nodes[0].start, nodes[-1].start + nodes[-1].length) if contiguous else torch.cat(ranges).to(device)
        parents = None if depth == 0 else torch.tensor([place[n.parent] for n in nodes], dtype=torch.int64, device=device)
        levels.append(_Level(tokens, lengths.to(device), lengths, parents))
        token_chunks += ranges
    node_sequence = [i for members in by_depth for i in members]
    in_place = node_sequence == list(range(len(layout.nodes)))
    token_order = node_order = None
    if not in_place:
        token_order = torch.argsort(torch.cat(token_chunks)).to(device)
        node_order = torch.argsort(torch.tensor(node_sequence)).to(device)
    return _LevelPlan(tuple(levels), token_order, node_order)


def run_by_level(run: VarlenRule, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, layout: PackedLayout,
                 initial_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``run`` once per tree depth: the roots from ``initial_state``, then every deeper segment from
    its parent's final state. Returns the outputs in packed order and the final states in segment
    order. Autograd reaches a parent's state through the gather of its children's initial states,
    so its gradient is their sum."""
    plan = layout.derived(("gated_delta_rule_levels", q.device), lambda: _level_plan(layout, q.device))
    outputs, finals = [], []
    for level in plan.levels:
        pick = ((lambda x: x[level.tokens]) if isinstance(level.tokens, slice)
                else (lambda x: x.index_select(0, level.tokens)))
        if level.parents is not None:
            initial = finals[-1].index_select(0, level.parents)
        elif initial_state is not None:
            initial = initial_state.expand(len(level.cu_seqlens) - 1, *initial_state.shape).contiguous()
        else:
            initial = None
        out, final = run(pick(q), pick(k), pick(v), pick(g), pick(beta), level.cu_seqlens, level.cu_seqlens_cpu,
                         initial)
        outputs.append(out)
        finals.append(final)
    out, final = torch.cat(outputs), torch.cat(finals)
    if plan.token_order is not None:
        out, final = out.index_select(0, plan.token_order), final.index_select(0, plan.node_order)
    return out, final


def _backend(q: Tensor, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    chosen = os.environ.get("DUALKV_GDN_BACKEND", "auto")
    if backend == "auto" and chosen != "auto":
        # a whole run's choice (benchmarks, or a stack whose fla is known to be slow or broken)
        if chosen not in BACKENDS:
            raise ValueError(f"DUALKV_GDN_BACKEND must be one of {BACKENDS}, got {chosen!r}")
        return _backend(q, chosen)
    if backend == "auto":
        # the chunked PyTorch form is exact too (float64 in, float64 math) and an order of magnitude
        # faster than the token loop on a CPU; the reference stays the tests' oracle
        fla = q.is_cuda and q.dtype in KERNEL_DTYPES and fla_installed() and fla_usable(*_fla_environment(q.device))
        return "fla" if fla else "torch"
    if backend == "fla":
        if not fla_installed():
            raise ValueError("backend 'fla' needs fla-core (pip install 'megatron-dualkv[hybrid]')")
        if q.is_cuda:
            capability, triton_version, tilelang = _fla_environment(q.device)
            if not fla_usable(capability, triton_version, tilelang):
                raise ValueError(
                    f"fla-core's backward refuses compute capability {capability} (Hopper) with Triton "
                    f"{triton_version}, which miscompiles it (fla issue 640): install Triton >= 3.7.1 or "
                    "tilelang, or use backend='torch'")
    if backend == "triton" and not triton_available(q.device):
        raise ValueError(f"backend 'triton' runs on CUDA, or on the CPU under TRITON_INTERPRET=1, not on {q.device}")
    return backend


def fla_usable(capability: Tuple[int, int], triton_version: str, tilelang: bool) -> bool:
    """Whether fla-core 0.6.0's backward runs: it raises on Hopper (compute capability 9.x) with
    Triton 3.4.0 up to 3.7.0, which miscompile it (fla issue 640), unless tilelang is there to take
    over those kernels."""
    miscompiling = Version("3.4.0") <= Version(triton_version) < Version("3.7.1")
    return not (capability[0] == 9 and miscompiling and not tilelang)


def _fla_environment(device) -> Tuple[Tuple[int, int], str, bool]:
    """What ``fla_usable`` decides on: the GPU's compute capability, Triton's version, tilelang."""
    import triton

    return torch.cuda.get_device_capability(device), triton.__version__, importlib.util.find_spec("tilelang") is not None


def fla_installed() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _check_varlen_inputs(q, k, v, g, beta, layout, scale, initial_state) -> None:
    """ValueError naming the shape that the level-by-level backends cannot take."""
    check_layout(layout)
    tokens = layout.total_tokens
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.shape[0] != tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, the layout {tokens}")
    if q.shape != k.shape:
        raise ValueError(f"k's shape {tuple(k.shape)} differs from q's {tuple(q.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:2]:
            raise ValueError(f"{name} must be (tokens, value heads) = {tuple(v.shape[:2])}, got {tuple(t.shape)}")
    want = (v.shape[1], q.shape[2], v.shape[2])
    if initial_state is not None and initial_state.shape != want:
        raise ValueError(f"initial_state must be (value heads, Dk, Dv) = {want}, got {tuple(initial_state.shape)}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")


def _check_kernel_inputs(q, k, v, g, beta, layout, scale, initial_state) -> None:
    """ValueError naming what fla's kernel cannot take."""
    _check_varlen_inputs(q, k, v, g, beta, layout, scale, initial_state)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"the fla backend takes {name} in bf16, fp16 or fp32, got {t.dtype} "
                             "(float64 runs on the torch and reference backends)")
    if g.dtype != torch.float32:
        raise ValueError(f"g (the log decay, summed over a chunk) must be float32, got {g.dtype}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"the fla backend keeps states in float32; initial_state is {initial_state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_cuda:
            raise ValueError(f"the fla backend runs on CUDA; {name} is on {t.device}")


def _check_torch_inputs(q, k, v, g, beta, layout, scale, initial_state) -> None:
    """ValueError naming what ``torch_chunk_varlen`` cannot take: a decay or state below float32
    would lose what the chunk's cumulative sum and the recurrence keep."""
    _check_varlen_inputs(q, k, v, g, beta, layout, scale, initial_state)
    wide = (torch.float32, torch.float64)
    if g.dtype not in wide:
        raise ValueError(f"g (the log decay, summed over a chunk) must be float32 or float64, got {g.dtype}")
    if initial_state is not None and initial_state.dtype not in wide:
        raise ValueError("the torch backend keeps states in float32 or float64; "
                         f"initial_state is {initial_state.dtype}")


def _per_value_head(q: Tensor, k: Tensor, value_heads: int, qk_l2norm: bool) -> Tuple[Tensor, Tensor]:
    """q and k in float32 at least (as transformers' PyTorch path computes them), L2-normed if asked,
    each key head repeated for the value heads it serves: what the PyTorch backends take."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k = q.to(dtype), k.to(dtype)
    if qk_l2norm:
        q, k = _l2_normed(q), _l2_normed(k)
    repeat = value_heads // q.shape[1]
    return q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)


def _l2_normed(x: Tensor) -> Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dim: transformers' and fla's l2norm."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def _check_inputs(q, k, v, g, beta, layout, scale, initial_state) -> float:
    """ValueError naming the input that does not fit; the scale to use."""
    check_layout(layout)
    tokens = layout.total_tokens
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-d (tokens, heads{', dim' if dims == 3 else ''}) tensor, "
                             f"got shape {getattr(t, 'shape', None)}")
        if t.shape[0] != tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, the layout {tokens}")
        if t.shape[1] != q.shape[1]:
            raise ValueError(f"{name} has {t.shape[1]} heads, q {q.shape[1]}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}")
    if k.shape != q.shape:
        raise ValueError(f"k's shape {tuple(k.shape)} differs from q's {tuple(q.shape)}")
    if initial_state is not None and initial_state.shape != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"initial_state must be (heads, Dk, Dv) = {(q.shape[1], q.shape[2], v.shape[2])}, "
                         f"got {tuple(initial_state.shape)}")
    if scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    return float(scale)
