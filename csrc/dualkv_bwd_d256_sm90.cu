// Native Hopper (sm_90a) backward of DualKV attention for head dim 256: the dK/dV pass with fused
// dQ of dualkv_bwd_sm90.cu, reshaped so that a 256-wide head fits in registers and shared memory.
//
// Work split: the same tables as the Triton kernels with 64-key tiles (key_items with 64 keys and
// 64-query blocks): one CTA per (key tile, query chunk, key/value head); in packed order a query i
// sees key j iff i >= j inside the item's query range.
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer: one warp streams Q blocks (with their lse and
// delta rows) into a 2-stage ring and dO blocks into a single stage (a second one does not fit:
// K and V take 64 KB, a Q or dO block 32 KB). Warpgroups 1 and 2 own head-dim columns
// [128 w, 128 w + 128) of dK, dV and dQ. Both compute the whole 64 x 64 S^T and dP^T (a head dim
// of 256 leaves no registers for a 128-key tile split by keys, as at head dim 128), so that
// neither waits for the other:
//     S^T  = K Q^T,  dP^T = V dO^T                 (64 x 64 over 256 columns, from shared memory)
//     P^T  = 2^(S^T * scale_log2 - lse)            masked to 0 where invisible
//     dS^T = scale * P^T * (dP^T - delta)
//     dV_w += P^T dO_w,  dK_w += dS^T Q_w          (P^T, dS^T in registers as the A operands)
//     dS^T -> this warpgroup's shared buffer; dQ_w = dS K_w (64 x 128, two 64-column halves)
//     staged in shared memory and added to the fp32 (T, Hq, 256) buffer by TMA bulk reductions.
// That is 7.3 MFLOP per warpgroup per step for 10.5 useful per CTA: S^T and dP^T run twice.
#include "dualkv_bwd_sm90.cuh"

namespace dualkv_sm90 {
namespace {

constexpr int HEAD_DIM = 256;
constexpr int PANELS = HEAD_DIM / 64;
constexpr int BLOCK_M = BWD_BLOCK_M;  // queries per step
constexpr int BLOCK_N = 64;  // keys per CTA
constexpr int Q_STAGES = 2;
constexpr int THREADS = 384;
constexpr int CONSUMER_WARPS = 8;

struct alignas(1024) SharedStorage {
  uint8_t k[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t v[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t q[Q_STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t dout[PANELS][BLOCK_M * ROW_BYTES];
  uint8_t ds[2][BLOCK_N * ROW_BYTES];     // dS^T (key, query), one per warpgroup
  uint8_t dq[2][2][BLOCK_M * ROW_BYTES];  // per warpgroup, two (64 queries, 32 fp32) swizzled boxes
  float lse[Q_STAGES][BLOCK_M];
  float delta[Q_STAGES][BLOCK_M];
  uint64_t kv_full;
  uint64_t q_full[Q_STAGES];
  uint64_t q_empty[Q_STAGES];
  uint64_t do_full;
  uint64_t do_empty;
};

// Accumulator element e (0..3) of 8-column group i held by a thread: row 16 * warp + lane / 4
// (+ 8 for e >= 2), column 8 i + 2 (lane % 4) (+ 1 for odd e)
template <typename T>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_dq_d256_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                        const __grid_constant__ CUtensorMap tm_dq, const BwdParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = aligned_shared<SharedStorage>(smem_raw);

  // heads vary fastest, so the heaviest items (tables are sorted heaviest first) start first
  const int hk = blockIdx.x % p.num_kv_heads;
  const int32_t* item = p.items + (blockIdx.x / p.num_kv_heads) * 5;
  const int k_start = item[0], k_end = item[1], q_lo = item[2], q_hi = item[3], slot = item[4];
  const int group = p.num_heads / p.num_kv_heads;
  const int q_blocks = (q_hi - q_lo + BLOCK_M - 1) / BLOCK_M;
  const int steps = group * q_blocks;  // (query head of the group, query block), head-major
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < Q_STAGES; ++i) {
      mbar_init(&s.q_full[i], 32);  // every producer lane (lse, delta rows)
      mbar_init(&s.q_empty[i], CONSUMER_WARPS);
    }
    mbar_init(&s.do_full, 1);
    mbar_init(&s.do_empty, CONSUMER_WARPS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<24>();
    if (warp != 0) return;
    if (lane == 0) {
      mbar_arrive_expect_tx(&s.kv_full, 2 * BLOCK_N * HEAD_DIM * sizeof(T));
      for (int pnl = 0; pnl < PANELS; ++pnl) {
        tma_load(s.k[pnl], &tm_k, &s.kv_full, 64 * pnl, hk, k_start);
        tma_load(s.v[pnl], &tm_v, &s.kv_full, 64 * pnl, hk, k_start);
      }
    }
    for (int step = 0; step < steps; ++step) {
      const int st = step % Q_STAGES;
      const int h = hk * group + step / q_blocks;
      const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
      mbar_wait(&s.q_empty[st], ((step / Q_STAGES) & 1) ^ 1);
      load_lse_delta(s.lse[st], s.delta[st], p, h, q0, lane);
      if (lane == 0) {
        mbar_arrive_expect_tx(&s.q_full[st], BLOCK_M * HEAD_DIM * sizeof(T));
        for (int pnl = 0; pnl < PANELS; ++pnl) tma_load(s.q[st][pnl], &tm_q, &s.q_full[st], 64 * pnl, h, q0);
        mbar_wait(&s.do_empty, (step & 1) ^ 1);
        mbar_arrive_expect_tx(&s.do_full, BLOCK_M * HEAD_DIM * sizeof(T));
        for (int pnl = 0; pnl < PANELS; ++pnl) tma_load(s.dout[pnl], &tm_do, &s.do_full, 64 * pnl, h, q0);
      } else {
        mbar_arrive(&s.q_full[st]);
      }
    }
    return;
  }

  // -------------------------------------------------------------------------------- consumers
  setmaxnreg_inc<240>();
  const int wg = warp / 4 - 1;  // head-dim columns [128 wg, 128 wg + 128), panels 2 wg and 2 wg + 1
  const int wq = warp % 4;      // accumulator rows [16 wq, 16 wq + 16)
  const int g = lane / 4, c = lane % 4;
  const bool dq_issuer = threadIdx.x % 128 == 0;
  const int key_rows = k_end - k_start;
  uint8_t* ds = s.ds[wg];

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

  // dQ columns [128 wg + 64 half, + 64) of a finished block -> two swizzled (64, 32) fp32 boxes
  // -> bulk reductions. Masked queries have dS = 0, so rows outside [q_lo, q_hi) add exact zeros.
  const auto add_dq = [&](const float (&dq)[32], int half, int h, int q0) {
    if (dq_issuer) bulk_wait_read();  // the boxes' previous contents have been read
    warpgroup_sync(wg);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * wq + g + 8 * r;  // row % 8 == g
        *reinterpret_cast<float2*>(s.dq[wg][i / 4] + row * ROW_BYTES + (((2 * (i % 4) + c / 2) ^ g) << 4) +
                                   8 * (c % 2)) = make_float2(dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    warpgroup_sync(wg);
    if (dq_issuer) {
      const int col = 128 * wg + 64 * half;
      tma_reduce_add(s.dq[wg][0], &tm_dq, col, h, q0);
      tma_reduce_add(s.dq[wg][1], &tm_dq, col + 32, h, q0);
    }
  };

  mbar_wait(&s.kv_full, 0);
  for (int step = 0; step < steps; ++step) {
    const int st = step % Q_STAGES;
    const int h = hk * group + step / q_blocks;
    const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
    mbar_wait(&s.q_full[st], (step / Q_STAGES) & 1);
    mbar_wait(&s.do_full, step & 1);

    // S^T = K Q^T and dP^T = V dO^T over all 256 columns: A and B both K-major
    float sc[32], dp[32];
    wgmma_fence();
    mma_ss_head_dim<T, HEAD_DIM>(sc, s.k[0], sizeof(s.k[0]), s.q[st][0], sizeof(s.q[st][0]));
    mma_ss_head_dim<T, HEAD_DIM>(dp, s.v[0], sizeof(s.v[0]), s.dout[0], sizeof(s.dout[0]));
    wgmma_wait<1>();  // S^T
    fence_regs(sc);

    // P^T: keys are rows, queries columns; a key past the tile, a query past the range, or a
    // query before the key (packed order) is invisible
    const bool masked = q0 < k_end - 1 || q0 + BLOCK_M > q_hi || key_rows < BLOCK_N;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * wq + g + 8 * (e >> 1), col = 8 * i + 2 * c + (e & 1);
        float x = exp2_approx(sc[4 * i + e] * p.scale_log2 - s.lse[st][col]);
        if (masked) {
          const int key = k_start + row, query = q0 + col;
          if (row >= key_rows || query >= q_hi || query < key) x = 0.f;
        }
        sc[4 * i + e] = x;
      }
    }
    // dV_w += P^T dO_w (B = dO panels 2 wg, 2 wg + 1, read N-major; k-steps of 16 queries)
    uint32_t pa[16];
    pack_fragments<T>(sc, pa);
    mma_rs<T, BLOCK_M / 16>(dv, pa, s.dout[2 * wg], sizeof(s.dout[0]));

    wgmma_wait<1>();  // dP^T (dV may still run)
    fence_regs(dp);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[4 * i + e] = sc[4 * i + e] * p.sm_scale * (dp[4 * i + e] - s.delta[st][8 * i + 2 * c + (e & 1)]);
    }
    // dK_w += dS^T Q_w
    uint32_t da[16];
    pack_fragments<T>(dp, da);
    mma_rs<T, BLOCK_M / 16>(dk, da, s.q[st][2 * wg], sizeof(s.q[st][0]));

    // dS^T to this warpgroup's buffer (one 128-byte swizzled row per key); its last reader, the
    // previous step's dQ matmul, has completed
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * wq + g + 8 * r;
        *reinterpret_cast<uint32_t*>(ds + row * ROW_BYTES + ((i ^ (row & 7)) << 4) + 4 * c) = da[2 * i + r];
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    warpgroup_sync(wg);

    wgmma_wait<0>();  // dV and dK: the stage's Q and dO are no longer read
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(pa);
    fence_regs(da);
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(&s.do_empty);
      mbar_arrive(&s.q_empty[st]);
    }

    // dQ_w = dS K_w in two 64-column halves: A = dS^T read M-major, B = K panel read N-major,
    // k-steps of 16 keys; half 1 runs while half 0 is staged
    float dq0[32], dq1[32];
    wgmma_fence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        mma_64x64_ss<T, 1, 1>(half ? dq1 : dq0, smem_desc(ds + kk * 16 * ROW_BYTES, BLOCK_N * ROW_BYTES, 1024),
                              smem_desc(s.k[2 * wg + half] + kk * 16 * ROW_BYTES, BLOCK_N * ROW_BYTES, 1024), kk);
      wgmma_commit();
    }
    wgmma_wait<1>();
    fence_regs(dq0);
    add_dq(dq0, 0, h, q0);
    wgmma_wait<0>();
    fence_regs(dq1);
    add_dq(dq1, 1, h, q0);
  }
  if (dq_issuer) bulk_wait();

  store_dkdv<T, HEAD_DIM, BLOCK_N>(dk, dv, p, hk, k_start, key_rows, slot, 0, 128 * wg);
}

// ------------------------------------------------------------------------------------ host
template <typename T>
void launch(const DkdvArgs& a, cudaStream_t stream) {
  const auto kernel = dkdv_dq_d256_kernel<T>;
  constexpr int SMEM_BYTES = shared_bytes<SharedStorage>();
  static_assert(SMEM_BYTES <= 227 * 1024, "over the shared memory of an sm_90 CTA");
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  const BwdMaps m = bwd_maps<HEAD_DIM, BLOCK_N>(a);
  kernel<<<a.n_items * a.num_kv_heads, THREADS, SMEM_BYTES, stream>>>(m.q, m.k, m.v, m.dout, m.dq, bwd_params(a));
}

}  // namespace

void dkdv_dq_d256(const DkdvArgs& args, void* stream) {
  if (args.n_items == 0) return;
  launch_for_dtype(args.fp16, [&](auto t) { launch<decltype(t)>(args, static_cast<cudaStream_t>(stream)); });
}

}  // namespace dualkv_sm90
