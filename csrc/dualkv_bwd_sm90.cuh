// What the native Hopper backward kernels share: dualkv_bwd_sm90.cu (head dim 128, the consumer
// warpgroups split the keys of a tile) and dualkv_bwd_cols_sm90.cu (head dims 256 and 512, they
// split the head-dim columns). Both run one fused dK/dV + dQ pass per (key tile, query chunk, key/value
// head) over the Triton kernels' work tables, in steps of 64 queries.
//
// Shared: the parameters, the host setup, a CTA's work item, the producer's lse/delta rows, the
// dQ staging and the once-per-CTA dK/dV store. The rest of the per-step consumer code stays
// written out in each kernel: factoring it into helpers here left the SASS's matmuls and barriers
// unchanged but cost 1.1 ms of 21.3 at D = 128 (PERF_NOTES.md, run AE), and the P^T loop alone
// 1.3 ms (run AT). With the helpers below, the kernels compile to the same instructions as
// without them (checked with cuobjdump when they were factored out).
#pragma once
#include "dualkv_sm90.h"
#include "sm90_ptx.cuh"

namespace dualkv_sm90 {

constexpr int BWD_BLOCK_M = 64;  // queries per step

struct BwdParams {
  const float* lse;
  const float* delta;
  const int32_t* items;
  void* dk;
  void* dv;
  int64_t dk_stride_t, dk_stride_h, dv_stride_t, dv_stride_h;
  float* partial_dk;
  float* partial_dv;
  int T, num_heads, num_kv_heads;
  float sm_scale, scale_log2;
  int window;
  const int64_t* positions;
};

// A CTA's work: one row of the key_items table (dualkv_attn.py) and one key/value head. `cta` and
// `n_ctas` count clusters where a cluster shares an item. Heads vary slowest, so that the CTAs
// running at once take one head's items, which the table lists query chunk by query chunk: they
// share Q, dO and dQ rows in L2 (PERF_NOTES.md, session 7, run AK).
struct BwdItem {
  int hk, k_start, k_end, q_lo, q_hi, slot;
  int group;     // query heads per key/value head
  int q_blocks;  // 64-query blocks in [q_lo, q_hi)
  int steps;     // (query head of the group, query block), head-major
};

__device__ __forceinline__ BwdItem bwd_item(const BwdParams& p, unsigned cta, unsigned n_ctas) {
  const int n_items = n_ctas / p.num_kv_heads;
  const int32_t* item = p.items + (cta % n_items) * 5;
  BwdItem w;
  w.hk = cta / n_items;
  w.k_start = item[0], w.k_end = item[1], w.q_lo = item[2], w.q_hi = item[3], w.slot = item[4];
  w.group = p.num_heads / p.num_kv_heads;
  w.q_blocks = (w.q_hi - w.q_lo + BWD_BLOCK_M - 1) / BWD_BLOCK_M;
  w.steps = w.group * w.q_blocks;
  return w;
}

// With a window, a pair (query, key) of an item is visible iff query - key < window_shift (packed
// indices; the causal query >= key as without one). An item's query range and its key tile are
// each a run of consecutive positions (key_items keeps windowed ranges so), so pos_q - pos_k <
// window moves to packed indices with one offset per run.
__device__ __forceinline__ int window_shift(const BwdParams& p, int q_lo, int k_start) {
  return p.window - int(p.positions[q_lo] - q_lo) + int(p.positions[k_start] - k_start);
}

// lse and delta of a step's 64 queries into shared memory, by the 32 lanes of the producer warp
// (zeros past T; rows past the item's q_hi are masked by the consumers)
__device__ __forceinline__ void load_lse_delta(float* lse, float* delta, const BwdParams& p, int h, int q0, int lane) {
  for (int r = lane; r < BWD_BLOCK_M; r += 32) {
    const bool ok = q0 + r < p.T;
    const int64_t at = int64_t(h) * p.T + q0 + r;
    lse[r] = ok ? p.lse[at] : 0.f;
    delta[r] = ok ? p.delta[at] : 0.f;
  }
}

// P^T of a step (keys are rows, queries columns; accumulator layout, rows from tile row `row0`) with
// its invisible pairs set to 0: a key past the tile, a query past the item's range, a query before
// the key (packed order) or, with a window, too far after it. Most steps have none, so the test
// runs once a step and the pairs' test is a branch of its own: written inside the exp2 loop,
// ptxas predicated it into every step (160 of the D = 128 loop's 1,044 instructions; PERF_NOTES.md,
// session 32).
template <bool WINDOW, int BLOCK_N>
__device__ __forceinline__ void mask_invisible(float (&sc)[32], int row0, int g, int c, int k_start, int key_rows,
                                               int q0, int q_hi, int shift) {
  const int k_end = k_start + key_rows;
  if (!(q0 < k_end - 1 || q0 + BWD_BLOCK_M > q_hi || key_rows < BLOCK_N ||
        (WINDOW && q0 + BWD_BLOCK_M - 1 - k_start >= shift)))
    return;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + 8 * (e >> 1), key = k_start + row, query = q0 + 8 * i + 2 * c + (e & 1);
      if (row >= key_rows || query >= q_hi || query < key || (WINDOW && query - key >= shift)) sc[4 * i + e] = 0.f;
    }
  }
}

// A warp's 16 x 64 block of dS^T (packed A fragments: da[2 i + h] holds rows g + 8 h, columns
// 8 i + 2 c, + 1) into a (key, 64 queries) tile in TMA's 128-byte swizzle, rows from `row0`: four
// stmatrix, each four 8 x 8 blocks (rows 8 h, query chunk 2 q + j / 2 for lane block j, h = j % 2),
// where 4-byte stores took sixteen, each with its own address
__device__ __forceinline__ void store_ds_t(uint32_t tile, int row0, const uint32_t (&da)[16], int lane) {
  const uint32_t row = tile + (row0 + 8 * (lane / 8 % 2) + lane % 8) * ROW_BYTES;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    stmatrix_x4(row + (((2 * q + lane / 16) ^ (lane % 8)) << 4), da[4 * q], da[4 * q + 1], da[4 * q + 2], da[4 * q + 3]);
}

// A warpgroup's 64 x 64 fp32 dQ block (accumulator layout) -> two (64 queries, 32 fp32) boxes in
// TMA's 128-byte swizzle (16-byte position k of row r at k ^ r % 8), ready for bulk reductions,
// with the 16-byte chunks of each row permuted: chunk j (columns 4j..4j+3 of the box) at position
// 4 (j % 2) + j / 2, so that the fp32 dQ buffer holds dQ in that order (dq_in_head_dim_order in
// dualkv_attn_sm90.py undoes it). Lane (g, c) stores columns 8 i + 2 c, + 1 of group i, chunk
// j = 2 (i % 4) + c / 2, at position 4 (c / 2) + i % 4: a half-warp's 16 eight-byte stores hit 8
// positions x 2 halves, one wavefront. In plain order they hit 4 positions, two wavefronts (ncu:
// run AN in PERF_NOTES.md); a per-lane choice of registers fixed that at 2 selects per store.
// wq, g, c: the thread's warp in its warpgroup, lane / 4 and lane % 4 (the D = 128 kernel passes
// its own, which keeps its SASS as measured).
__device__ __forceinline__ void stage_dq(const float (&dq)[32], uint8_t (*boxes)[BWD_BLOCK_M * ROW_BYTES],
                                         int wq = threadIdx.x / 32 % 4, int g = threadIdx.x % 32 / 4,
                                         int c = threadIdx.x % 4) {
  // shared-window addresses: a generic pointer (the D = 128 kernel's storage) costs each store a
  // 64-bit address
  const uint32_t base = smem_u32(boxes[0]);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * wq + g + 8 * r;  // row % 8 == g
      st_shared_v2(base + (i / 4) * BWD_BLOCK_M * ROW_BYTES + row * ROW_BYTES + (((4 * (c / 2) + i % 4) ^ g) << 4) +
                       8 * (c % 2),
                   dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
    }
  }
}

// A warpgroup's dK and dV (64 x 128 accumulators: keys from tile row `row0`, columns from `col0`),
// 2 adjacent columns per store: bf16/fp16 rows of an unsplit tile (slot < 0), else fp32 rows of
// the query chunk's partial, slot * BLOCK_N + row, summed later in chunk order
template <typename T, int D, int BLOCK_N>
__device__ __forceinline__ void store_dkdv(const float (&dk)[64], const float (&dv)[64], const BwdParams& p, int hk,
                                           int k_start, int key_rows, int slot, int row0, int col0) {
  const int wq = threadIdx.x / 32 % 4, g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 16 * wq + g + 8 * r, col = col0 + 8 * i + 2 * c;
      const float k0 = dk[4 * i + 2 * r], k1 = dk[4 * i + 2 * r + 1];
      const float v0 = dv[4 * i + 2 * r], v1 = dv[4 * i + 2 * r + 1];
      if (slot < 0) {
        if (row < key_rows) {
          const int64_t t = k_start + row;
          T* dk_out = static_cast<T*>(p.dk) + t * p.dk_stride_t + hk * p.dk_stride_h + col;
          T* dv_out = static_cast<T*>(p.dv) + t * p.dv_stride_t + hk * p.dv_stride_h + col;
          *reinterpret_cast<uint32_t*>(dk_out) = pack2<T>(k0, k1);
          *reinterpret_cast<uint32_t*>(dv_out) = pack2<T>(v0, v1);
        }
      } else {
        const int64_t at = ((int64_t(slot) * BLOCK_N + row) * p.num_kv_heads + hk) * D + col;
        *reinterpret_cast<float2*>(p.partial_dk + at) = make_float2(k0, k1);
        *reinterpret_cast<float2*>(p.partial_dv + at) = make_float2(v0, v1);
      }
    }
  }
}

// ------------------------------------------------------------------------------------ host
// Tensor maps of q, k, v, dout (64-column boxes of 64 query or BLOCK_N key rows) and of the fp32
// dQ buffer (32-column boxes), and the kernel parameters
struct BwdMaps {
  CUtensorMap q, k, v, dout, dq;
};

template <int D, int BLOCK_N>
BwdMaps bwd_maps(const DkdvArgs& a) {
  const auto dtype = a.fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int Hq = a.num_heads, Hkv = a.num_kv_heads;
  return {head_tile_map(a.qkv.q, dtype, 2, a.T, Hq, D, a.qkv.q_stride_t, a.qkv.q_stride_h, BWD_BLOCK_M),
          head_tile_map(a.qkv.k, dtype, 2, a.T, Hkv, D, a.qkv.k_stride_t, a.qkv.k_stride_h, BLOCK_N),
          head_tile_map(a.qkv.v, dtype, 2, a.T, Hkv, D, a.qkv.v_stride_t, a.qkv.v_stride_h, BLOCK_N),
          head_tile_map(a.dout, dtype, 2, a.T, Hq, D, a.do_stride_t, a.do_stride_h, BWD_BLOCK_M),
          head_tile_map(a.dq_acc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.T, Hq, D, int64_t(Hq) * D, D, BWD_BLOCK_M)};
}

inline BwdParams bwd_params(const DkdvArgs& a) {
  return {a.lse, a.delta, a.items, a.dk, a.dv, a.dk_stride_t, a.dk_stride_h, a.dv_stride_t, a.dv_stride_h,
          a.partial_dk, a.partial_dv, a.T, a.num_heads, a.num_kv_heads, float(a.sm_scale),
          float(a.sm_scale * LOG2E), a.window, a.positions};
}

}  // namespace dualkv_sm90
