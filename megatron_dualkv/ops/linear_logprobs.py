"""Log-probs (and entropies) of target tokens straight from the final hidden states: the
vocabulary projection, log-softmax and gather fused, chunk by chunk over the vocabulary, so that
the (rows, vocabulary) logits never exist at once.

The unfused path computes logits for every packed token (Qwen3's 151,936 or Gemma's 262,208
columns: 7.5-13 GB in bf16 at 24,576 tokens), upcasts them, and keeps them and their gradient for
backward. Here the projection runs on the rows that predict a trained token only, one vocabulary
chunk of about 1 GiB of fp32 logits at a time; forward keeps per-row statistics, backward
recomputes each chunk's logits. The chunks run along the vocabulary, not the rows: the weight
gradient of a chunk's vocabulary rows is then one product over all the rows, as in the unfused
path (no fp32 accumulator of the whole weight's shape, no extra rounding), and only the hidden
gradient, (rows, hidden), is accumulated over chunks, in fp32. The matrix products are torch's;
on GPU one Triton kernel per direction does a chunk's elementwise work (and on CPU under
``TRITON_INTERPRET=1``); float64 and CPU inputs take the same math as PyTorch ops.

Math per row, z_j = c tanh(x_j / c) with Gemma's softcap c (z = x without), x = hidden @ weight^T,
over the real vocabulary j < vocab_size only (padding columns are never computed):
    forward, over the chunks with a running shift m (online log-sum-exp, m starts at a finite floor
    so that the first rescaling is exp(floor - m') = 0, never NaN):
        s = sum_j exp(z_j - m),  u = sum_j exp(z_j - m) (z_j - m),  t = z_target
        a chunk with max m' > m first rescales: s <- e s,  u <- e (u + (m - m') s),  e = exp(m - m')
        lse = m + log s,  log p(target) = t - lse,  E_p[z] = m + u / s,  H = lse - E_p[z] = log s - u / s
    tensor parallelism: each rank's (m, s, u, t) over its vocabulary shard, merged by the same
        rescaling (an all-reduce of max m, then one all-reduce sum of s, u and t)
    backward, with p_j = exp(z_j - lse) and upstream gradients g_logp, g_H:
        dz_j = g_logp ([j = target] - p_j) - g_H p_j (z_j - E_p[z]),  dx_j = dz_j (1 - (z_j / c)^2)
        dweight[chunk] = dx^T hidden,  dhidden += dx weight[chunk]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from .checks import use_triton

CHUNK_ELEMENTS = 1 << 28  # logits per chunk: 1 GiB in fp32 (the kernels keep them in the inputs' dtype)
MIN_CHUNK_COLUMNS = 128  # even with very many rows: matrix products stay wide enough to run well
SHIFT_FLOOR = -1e30  # the running shift before any column (finite: see the module docstring)
BLOCK_M, BLOCK_N = 4, 1024  # rows and columns of one kernel tile
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """c tanh(x / c), tanh through the sigmoid (portable across Triton versions and the interpreter)."""
    if HAS_SOFTCAP:
        x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)
    return x


@triton.jit
def _chunk_stats_kernel(Z, TARGET, M, S, U, T, n_rows, n_cols, col_offset, softcap, HAS_SOFTCAP: tl.constexpr,
                        WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows of one (n_rows, n_cols) chunk of logits: its columns fold into the running (m, s, u) of
    # the rows, read and written back in place, and the target's logit into t where it falls here
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    base = rows.to(tl.int64)[:, None] * n_cols
    m = tl.load(M + rows, mask=row_mask, other=0.0)
    s = tl.load(S + rows, mask=row_mask, other=0.0)
    u = tl.zeros([BLOCK_M], tl.float32)
    if WITH_ENTROPY:
        u = tl.load(U + rows, mask=row_mask, other=0.0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = tl.load(Z + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = _softcapped(x, softcap, HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), 1))
        rescale = tl.exp(m - m_new)
        shifted = tl.where(mask, z - m_new[:, None], 0.0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        if WITH_ENTROPY:
            u = rescale * (u + (m - m_new) * s) + tl.sum(e * shifted, 1)
        s = rescale * s + tl.sum(e, 1)
        m = m_new
    tl.store(M + rows, m, mask=row_mask)
    tl.store(S + rows, s, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(U + rows, u, mask=row_mask)
    local = tl.load(TARGET + rows, mask=row_mask, other=-1) - col_offset
    hit = row_mask & (local >= 0) & (local < n_cols)
    x = tl.load(Z + rows.to(tl.int64) * n_cols + local, mask=hit, other=0.0).to(tl.float32)
    t = tl.load(T + rows, mask=row_mask, other=0.0)
    tl.store(T + rows, t + tl.where(hit, _softcapped(x, softcap, HAS_SOFTCAP), 0.0), mask=row_mask)


@triton.jit
def _chunk_grad_kernel(Z, TARGET, LSE, MEAN_Z, G_LOGP, G_ENTROPY, n_rows, n_cols, col_offset, softcap,
                       HAS_SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # the chunk's logits x -> their gradient dx, in place
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    z = _softcapped(x, softcap, HAS_SOFTCAP)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    p = tl.exp(z - lse[:, None])
    local = tl.load(TARGET + rows, mask=row_mask, other=-1) - col_offset
    g_logp = tl.load(G_LOGP + rows, mask=row_mask, other=0.0)
    dz = g_logp[:, None] * (tl.where(cols[None, :] == local[:, None], 1.0, 0.0) - p)
    if WITH_ENTROPY:
        mean_z = tl.load(MEAN_Z + rows, mask=row_mask, other=0.0)
        g_entropy = tl.load(G_ENTROPY + rows, mask=row_mask, other=0.0)
        dz -= g_entropy[:, None] * p * (z - mean_z[:, None])
    if HAS_SOFTCAP:
        dz *= 1.0 - (z / softcap) * (z / softcap)
    tl.store(Z + offs, dz.to(Z.dtype.element_ty), mask=mask)


@dataclass
class _RowStats:
    """Running per-row statistics (see the module docstring); u is None without entropy."""

    m: Tensor
    s: Tensor
    t: Tensor
    u: Optional[Tensor]

    @classmethod
    def start(cls, rows: int, dtype: torch.dtype, device: torch.device, with_entropy: bool) -> "_RowStats":
        zeros = lambda: torch.zeros(rows, dtype=dtype, device=device)  # noqa: E731
        return cls(torch.full((rows,), SHIFT_FLOOR, dtype=dtype, device=device), zeros(), zeros(),
                   zeros() if with_entropy else None)


def _softcapped_torch(x: Tensor, softcap: Optional[float]) -> Tensor:
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def _chunk_stats_torch(x: Tensor, targets: Tensor, col_offset: int, stats: _RowStats, softcap: Optional[float]) -> None:
    """``_chunk_stats_kernel`` as PyTorch ops, the whole chunk as one tile."""
    z = _softcapped_torch(x.to(stats.m.dtype), softcap)
    m_new = torch.maximum(stats.m, z.max(dim=1).values)
    rescale = (stats.m - m_new).exp()
    shifted = z - m_new[:, None]
    e = shifted.exp()
    if stats.u is not None:
        stats.u.copy_(rescale * (stats.u + (stats.m - m_new) * stats.s) + (e * shifted).sum(1))
    stats.s.copy_(rescale * stats.s + e.sum(1))
    stats.m.copy_(m_new)
    local = targets - col_offset
    hit = (local >= 0) & (local < z.shape[1])
    stats.t.add_(torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0))


def _chunk_grad_torch(x: Tensor, targets: Tensor, col_offset: int, lse: Tensor, mean_z: Optional[Tensor],
                      g_logp: Tensor, g_entropy: Optional[Tensor], softcap: Optional[float]) -> None:
    """``_chunk_grad_kernel`` as PyTorch ops."""
    z = _softcapped_torch(x.to(lse.dtype), softcap)
    p = (z - lse[:, None]).exp()
    onehot = torch.arange(col_offset, col_offset + z.shape[1], device=z.device) == targets[:, None]
    dz = g_logp[:, None] * (onehot.to(z.dtype) - p)
    if g_entropy is not None:
        dz -= g_entropy[:, None] * p * (z - mean_z[:, None])
    if softcap is not None:
        dz *= 1.0 - (z / softcap) ** 2
    x.copy_(dz)


def _chunk_stats(x: Tensor, targets: Tensor, col_offset: int, stats: _RowStats, softcap: Optional[float],
                 kernels: bool) -> None:
    """Fold the logits chunk x (rows, n_cols) of vocabulary columns col_offset.. into ``stats``."""
    if not (kernels and _kernels_take(x, stats.m)):
        return _chunk_stats_torch(x, targets, col_offset, stats, softcap)
    if x.shape[0] == 0:  # no grid to launch for no rows
        return
    _chunk_stats_kernel[(triton.cdiv(x.shape[0], BLOCK_M),)](
        x, targets, stats.m, stats.s, stats.u if stats.u is not None else stats.s, stats.t, x.shape[0], x.shape[1],
        col_offset, softcap or 1.0, HAS_SOFTCAP=softcap is not None, WITH_ENTROPY=stats.u is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)


def _chunk_grad(x: Tensor, targets: Tensor, col_offset: int, lse: Tensor, mean_z: Optional[Tensor], g_logp: Tensor,
                g_entropy: Optional[Tensor], softcap: Optional[float], kernels: bool) -> None:
    """The logits chunk x -> the gradient of the loss with respect to it, in place."""
    if not (kernels and _kernels_take(x, lse)):
        return _chunk_grad_torch(x, targets, col_offset, lse, mean_z, g_logp, g_entropy, softcap)
    if x.numel() == 0:
        return
    with_entropy = g_entropy is not None
    _chunk_grad_kernel[(triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(x.shape[1], BLOCK_N))](
        x, targets, lse, mean_z if with_entropy else lse, g_logp, g_entropy if with_entropy else g_logp, x.shape[0],
        x.shape[1], col_offset, softcap or 1.0, HAS_SOFTCAP=softcap is not None, WITH_ENTROPY=with_entropy,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)


def _kernels_take(x: Tensor, stats: Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and stats.dtype == torch.float32


def _merge_over_shards(stats: _RowStats, tp_group: Optional[dist.ProcessGroup]) -> _RowStats:
    """Every rank's statistics over its vocabulary shard -> those over the whole vocabulary."""
    if tp_group is None or tp_group.size() == 1:
        return stats
    m = stats.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    rescale = (stats.m - m).exp()
    sums = [rescale * stats.s, stats.t]
    if stats.u is not None:
        sums.append(rescale * (stats.u + (stats.m - m) * stats.s))
    sums = torch.stack(sums)
    dist.all_reduce(sums, group=tp_group)
    return _RowStats(m, sums[0], sums[1], sums[2] if stats.u is not None else None)


@dataclass(frozen=True)
class _Shard:
    """This rank's vocabulary columns: ``valid`` real ones (the rest of its rows pad the
    vocabulary), global ids from ``offset``, ``chunk`` columns per chunk."""

    offset: int
    valid: int
    chunk: int
    kernels: bool  # the Triton kernels do each chunk's elementwise work, else PyTorch ops

    def chunks(self):
        for start in range(0, self.valid, self.chunk):
            yield start, min(start + self.chunk, self.valid)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, shard: _Shard, tp_group, softcap, with_entropy: bool):
        stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
        stats = _RowStats.start(hidden.shape[0], stats_dtype, hidden.device, with_entropy)
        for start, stop in shard.chunks():
            _chunk_stats(hidden @ weight[start:stop].T, targets, shard.offset + start, stats, softcap, shard.kernels)
        stats = _merge_over_shards(stats, tp_group)
        log_s = stats.s.log()
        lse = stats.m + log_s
        logprobs = stats.t - lse
        entropy = mean_z = None
        if with_entropy:
            mean_u = stats.u / stats.s
            entropy, mean_z = log_s - mean_u, stats.m + mean_u
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.shard, ctx.softcap = shard, softcap
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if g_logp is None and g_entropy is None:
            return (None,) * 7
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.contiguous()
        g_entropy = None if g_entropy is None else g_entropy.contiguous()
        shard = ctx.shard
        d_weight = torch.empty_like(weight) if need_weight else None
        if need_weight:
            d_weight[shard.valid:].zero_()  # padding columns get no gradient
        # fp32 sums over the chunks (the weight gradient is one product per chunk, no sum)
        sum_dtype = torch.promote_types(hidden.dtype, torch.float32)
        d_hidden = torch.zeros_like(hidden, dtype=sum_dtype) if need_hidden else None
        for start, stop in shard.chunks():
            w = weight[start:stop]
            dx = hidden @ w.T
            _chunk_grad(dx, targets, shard.offset + start, lse, mean_z, g_logp, g_entropy, ctx.softcap, shard.kernels)
            if need_weight:
                torch.mm(dx.T, hidden, out=d_weight[start:stop])
            if need_hidden:
                if d_hidden.dtype == dx.dtype:
                    d_hidden.addmm_(dx, w)
                else:
                    d_hidden += dx @ w
        return (None if d_hidden is None else d_hidden.to(hidden.dtype)), d_weight, None, None, None, None, None


def linear_logprobs_func(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    softcap: Optional[float] = None,
    with_entropy: bool = False,
    chunk_columns: Optional[int] = None,
    use_kernels: Optional[bool] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """log p(target) and (optionally) the entropy of each row of the logits ``hidden @ weight.T``,
    without ever holding those logits (see the module docstring).

    hidden: (N, H); weight: (V_local, H), this tensor-parallel rank's vocabulary shard (rank r of
    ``tp_group`` holds global ids ``[r*V_local, (r+1)*V_local)``, Megatron's ``VocabUtility``), same
    dtype and device; targets: (N,) integer global ids in ``[0, vocab_size)``, on hidden's device
    or on the CPU (checked there without waiting for the device).
    vocab_size: the real vocabulary; global ids from it on are the padding of a vocabulary padded
    for tensor parallelism, left out of every softmax (zero weight gradient). None: V_local * tp.
    softcap: the logits become ``softcap * tanh(logits / softcap)`` (Gemma's final logit softcap).
    chunk_columns: vocabulary columns per chunk (default: about 1 GiB of fp32 logits per chunk).
    use_kernels: the Triton kernels do each chunk's elementwise work: None on CUDA devices, True
        wherever Triton runs (also CPU under ``TRITON_INTERPRET=1``, which the tests use: slow), False
        never (PyTorch ops). float64 always takes PyTorch ops.
    Returns (logprobs (N,), entropy (N,) or None), float32 (float64 for float64 inputs).

    Gradients: the weight gets this shard's own (the loss that follows is the same on every
    tensor-parallel rank); hidden gets this shard's share only, to be summed over ``tp_group`` where
    Megatron's output layer sums it (``copy_to_tensor_model_parallel_region``, or
    ``gather_from_sequence_parallel_region`` under sequence parallelism).
    """
    world, rank = (1, 0) if tp_group is None else (tp_group.size(), tp_group.rank())
    vocab_size = _checked_inputs(hidden, weight, targets, world, vocab_size, softcap, with_entropy, chunk_columns)
    local = weight.shape[0]
    valid = min(max(vocab_size - rank * local, 0), local)
    if chunk_columns is None:
        chunk_columns = max(MIN_CHUNK_COLUMNS, CHUNK_ELEMENTS // max(hidden.shape[0], 1))
    kernels = use_triton(hidden.device, use_kernels)
    shard = _Shard(offset=rank * local, valid=valid, chunk=min(chunk_columns, max(valid, 1)), kernels=kernels)
    targets = targets.to(hidden.device, torch.int64, non_blocking=True).contiguous()
    return _LinearLogprobs.apply(hidden, weight, targets, shard, tp_group, None if softcap is None else float(softcap),
                                 bool(with_entropy))


def _checked_inputs(hidden, weight, targets, world: int, vocab_size, softcap, with_entropy, chunk_columns) -> int:
    """ValueError naming the argument for bad input; returns the real vocabulary size."""
    for name, t, shape in (("hidden", hidden, "(rows, hidden)"), ("weight", weight, "(vocabulary shard, hidden)")):
        if not isinstance(t, Tensor) or t.dim() != 2:
            raise ValueError(f"{_NAME}: {name} must be a {shape} tensor, got shape {_shape(t)}")
        if t.dtype not in (*KERNEL_DTYPES, torch.float64):
            raise ValueError(f"{_NAME}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{_NAME}: hidden has {hidden.shape[1]} features, weight {weight.shape[1]}")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(f"{_NAME}: hidden ({hidden.dtype} on {hidden.device}) and weight ({weight.dtype} on "
                         f"{weight.device}) differ in dtype or device")
    if not isinstance(targets, Tensor) or targets.shape != (hidden.shape[0],):
        raise ValueError(f"{_NAME}: targets must have shape ({hidden.shape[0]},), one per row of hidden, "
                         f"got {_shape(targets)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"{_NAME}: targets must hold integer token ids, got {targets.dtype}")
    if targets.device not in (hidden.device, torch.device("cpu")):
        raise ValueError(f"{_NAME}: targets on {targets.device}, hidden on {hidden.device}")
    padded = weight.shape[0] * world
    if vocab_size is None:
        vocab_size = padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(f"{_NAME}: vocab_size must be an int in [1, {padded}] (the weight's {weight.shape[0]} rows "
                         f"times {world} tensor-parallel ranks), got {vocab_size!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{_NAME}: softcap must be positive or None, got {softcap!r}")
    if not isinstance(with_entropy, bool):
        raise ValueError(f"{_NAME}: with_entropy must be a bool, got {with_entropy!r}")
    if chunk_columns is not None and (isinstance(chunk_columns, bool) or not isinstance(chunk_columns, int)
                                      or chunk_columns < 1):
        raise ValueError(f"{_NAME}: chunk_columns must be a positive int or None, got {chunk_columns!r}")
    if targets.numel():
        low, high = torch.stack(torch.aminmax(targets)).tolist()  # one read (a wait, for targets on the device)
        if low < 0 or high >= vocab_size:
            padding = f" (ids from {vocab_size} on pad the vocabulary)" if vocab_size < padded else ""
            raise ValueError(f"{_NAME}: target id {low if low < 0 else high} is outside the vocabulary of "
                             f"{vocab_size}{padding}")
    return vocab_size


_NAME = "linear_logprobs_func"


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))
