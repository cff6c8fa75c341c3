// Native Hopper (sm_90a) backward of DualKV attention for head dims 256 and 512: the dK/dV pass
// with fused dQ of dualkv_bwd_sm90.cu, reshaped so that a wide head fits in registers and shared
// memory: every CTA owns 256 head-dim columns, and at head dim 512 a cluster of two CTAs shares a
// key tile.
//
// Work split: the same tables as the Triton kernels with 64-key tiles (key_items with 64 keys and
// 64-query blocks): one cluster of SPLIT = D / 256 CTAs per (key tile, query chunk, key/value
// head); CTA r of the cluster owns head-dim columns [256 r, 256 r + 256). In packed order a query i
// sees key j iff i >= j inside the item's query range.
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer: one warp streams the CTA's columns of Q blocks
// (with their lse and delta rows) into a 2-stage ring and of dO blocks into a single stage (K and V
// take 64 KB, a Q or dO block 32 KB). Warpgroups 1 and 2 own columns [128 w, 128 w + 128) of the
// CTA's dK, dV and dQ.
// Both need the whole 64 x 64 S^T and dP^T (a 256-column head leaves no registers for a 128-key
// tile split by keys, as at head dim 128). The first (wg 0) computes S^T, the second (wg 1) dP^T,
// and they share them through shared memory (share_scores), so that no matmul runs twice:
//     S^T  = K Q^T (wg 0),  dP^T = V dO^T (wg 1)   (64 x 64 over 256 columns, from shared memory)
//     at D = 512: + the other CTA's partial over its 256 columns (below)
//     P^T  = 2^(S^T * scale_log2 - lse)            masked to 0 where invisible
//     dS^T = scale * P^T * (dP^T - delta)
//     dV_w += P^T dO_w,  dK_w += dS^T Q_w          (P^T, dS^T in registers as the A operands)
//     dS^T -> this warpgroup's shared buffer; dQ_w = dS K_w (64 x 128, two 64-column halves)
//     staged in shared memory and added to the fp32 (T, Hq, D) buffer by TMA bulk reductions.
// That is 5.2 MFLOP per warpgroup per step, 10.5 per CTA: every product once. (Both warpgroups
// computed S^T and dP^T before, 7.3 MFLOP each: PERF_NOTES.md, run DH.)
//
// Why a cluster at D = 512: dK and dV of 64 keys x 512 columns (256 KB of fp32) do not fit one
// SM's registers, and 32-key tiles would double the dQ reductions per FLOP, which already run
// near what the copy engine sustains (PERF_NOTES.md, session 6, run AF). The pair exchanges
// partial scores instead, through each other's shared memory (st.async, completing on the
// receiver's barrier): each warpgroup sends its product to its counterpart in the other CTA. Both
// CTAs add in the same order (a + b == b + a in fp32), so both see identical P and dS. The
// partials land in the dQ staging boxes, which are free from the end of one step (the copy engine
// has read them) until both warpgroups have read the scores in the next.
#include "dualkv_bwd_sm90.cuh"

namespace dualkv_sm90 {
namespace {

constexpr int COLS = 256;  // head-dim columns per CTA
constexpr int PANELS = COLS / 64;
constexpr int BLOCK_M = BWD_BLOCK_M;  // queries per step
constexpr int BLOCK_N = 64;  // keys per CTA
constexpr int THREADS = 384;
constexpr int CONSUMER_WARPS = 8;
constexpr uint32_t RECV_BYTES = 8 * 128 * sizeof(float4);  // one partial (S^T or dP^T) of a CTA pair

template <int SPLIT>  // CTAs per key tile
struct alignas(1024) SharedStorage {
  static constexpr int Q_STAGES = 2;
  uint8_t k[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t v[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t q[Q_STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t dout[PANELS][BLOCK_M * ROW_BYTES];
  uint8_t ds[2][BLOCK_N * ROW_BYTES];     // dS^T (key, query), one per warpgroup
  union {
    uint8_t dq[2][2][BLOCK_M * ROW_BYTES];  // per warpgroup, two (64 queries, 32 fp32) swizzled boxes
    // a step's S^T (which = 0) and dP^T (1), and at SPLIT 2 first the other CTA's partials of
    // them: float4 j of consumer thread t at (which * 8 + j) * 128 + t, so that a warp's accesses
    // hit consecutive banks
    float4 recv[2 * 8 * 128];
  };
  float lse[Q_STAGES][BLOCK_M];
  float delta[Q_STAGES][BLOCK_M];
  uint64_t kv_full;
  uint64_t q_full[Q_STAGES];
  uint64_t q_empty[Q_STAGES];
  uint64_t do_full;
  uint64_t do_empty;
  uint64_t recv_full[2];  // the other CTA's partial S^T (0) or dP^T (1) of this step has landed (SPLIT 2)
  uint64_t send_ok;       // the other CTA's dQ boxes are free: it has read the last partials sent
};

// This warpgroup's product x of a step (S^T at wg 0, dP^T at wg 1, over the CTA's columns),
// made whole and shared: at SPLIT 2 the other CTA's partial over its columns is added first (its
// counterpart warpgroup sends it), then each warpgroup publishes its scores in recv[wg] and both
// read S^T into sc and dP^T into dp. recv[wg] lies on the warpgroup's own dQ boxes. (A function,
// not a lambda: called with register arrays, a lambda was not always inlined and they went to
// local memory.)
template <int SPLIT, typename Smem>
__device__ __forceinline__ void share_scores(float (&x)[32], float (&sc)[32], float (&dp)[32], Smem& s, int rank,
                                             int wg, int step, int steps) {
  const int t = threadIdx.x % 128;
  float4* mine = s.recv + wg * 8 * 128 + t;
  if constexpr (SPLIT > 1) {
    const uint32_t peer = rank ^ 1;
    if (step > 0) mbar_wait<true>(&s.send_ok, (step - 1) & 1);  // the other CTA's boxes were read
    const uint32_t peer_bar = peer_shared(&s.recv_full[wg], peer);
#pragma unroll
    for (int j = 0; j < 8; ++j)  // x indexed by constants only: a register array stays in registers
      st_async_v4(peer_shared(mine + j * 128, peer), x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3], peer_bar);
    mbar_wait(&s.recv_full[wg], step & 1);
    // arm the next step's phase before the other CTA may send into it (send_ok, at the end of this
    // step), so that its bytes never land ahead of the expectation
    if (t == 0 && step + 1 < steps) mbar_arrive_expect_tx(&s.recv_full[wg], RECV_BYTES);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 r = mine[j * 128];
      x[4 * j] += r.x, x[4 * j + 1] += r.y, x[4 * j + 2] += r.z, x[4 * j + 3] += r.w;
    }
  } else {
    if (t == 0) bulk_wait_read();  // the copy engine has read this warpgroup's dQ boxes
    warpgroup_sync(wg);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) mine[j * 128] = make_float4(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]);
  consumers_sync();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float4 a = s.recv[j * 128 + t], b = s.recv[(8 + j) * 128 + t];
    sc[4 * j] = a.x, sc[4 * j + 1] = a.y, sc[4 * j + 2] = a.z, sc[4 * j + 3] = a.w;
    dp[4 * j] = b.x, dp[4 * j + 1] = b.y, dp[4 * j + 2] = b.z, dp[4 * j + 3] = b.w;
  }
  consumers_sync();  // both warpgroups have read the scores: the dQ boxes are free
}

// Accumulator element e (0..3) of 8-column group i held by a thread: row 16 * warp + lane / 4
// (+ 8 for e >= 2), column 8 i + 2 (lane % 4) (+ 1 for odd e)
template <typename T, int SPLIT, bool WINDOW>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_dq_cols_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                        const __grid_constant__ CUtensorMap tm_dq, const BwdParams p) {
  using Smem = SharedStorage<SPLIT>;
  constexpr int Q_STAGES = Smem::Q_STAGES;
  extern __shared__ uint8_t smem_raw[];
  Smem& s = aligned_shared<Smem>(smem_raw);

  // the SPLIT CTAs of a cluster are adjacent and share one item
  const int rank = blockIdx.x % SPLIT, col0 = COLS * rank;
  const BwdItem w = bwd_item(p, blockIdx.x / SPLIT, gridDim.x / SPLIT);
  const int hk = w.hk, k_start = w.k_start, k_end = w.k_end, q_lo = w.q_lo, q_hi = w.q_hi, slot = w.slot;
  const int group = w.group, q_blocks = w.q_blocks, steps = w.steps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < Q_STAGES; ++i) {
      mbar_init(&s.q_full[i], 32);  // every producer lane (lse, delta rows)
      mbar_init(&s.q_empty[i], SPLIT > 1 ? 2 : CONSUMER_WARPS);  // see the dQ staging
    }
    mbar_init(&s.do_full, 1);
    mbar_init(&s.do_empty, CONSUMER_WARPS);
    for (int i = 0; i < 2; ++i) {  // armed for step 0 (share_scores arms the next ones)
      mbar_init(&s.recv_full[i], 1);
      if (SPLIT > 1) mbar_arrive_expect_tx(&s.recv_full[i], RECV_BYTES);
    }
    mbar_init(&s.send_ok, 2);  // the dQ issuers of the other CTA's consumer warpgroups
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (SPLIT > 1)
    cluster_sync();  // both CTAs' barriers exist before either sends
  else
    __syncthreads();

  if (warp < 4) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<24>();
    if (warp == 0) {
      if (lane == 0) {
        mbar_arrive_expect_tx(&s.kv_full, 2 * BLOCK_N * COLS * sizeof(T));
        for (int pnl = 0; pnl < PANELS; ++pnl) {
          tma_load(s.k[pnl], &tm_k, &s.kv_full, col0 + 64 * pnl, hk, k_start);
          tma_load(s.v[pnl], &tm_v, &s.kv_full, col0 + 64 * pnl, hk, k_start);
        }
      }
      for (int step = 0; step < steps; ++step) {
        const int st = step % Q_STAGES;
        const int h = hk * group + step / q_blocks;
        const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
        mbar_wait(&s.q_empty[st], ((step / Q_STAGES) & 1) ^ 1);
        load_lse_delta(s.lse[st], s.delta[st], p, h, q0, lane);
        if (lane == 0) {
          mbar_arrive_expect_tx(&s.q_full[st], BLOCK_M * COLS * sizeof(T));
          for (int pnl = 0; pnl < PANELS; ++pnl)
            tma_load(s.q[st][pnl], &tm_q, &s.q_full[st], col0 + 64 * pnl, h, q0);
          mbar_wait(&s.do_empty, (step & 1) ^ 1);
          mbar_arrive_expect_tx(&s.do_full, BLOCK_M * COLS * sizeof(T));
          for (int pnl = 0; pnl < PANELS; ++pnl)
            tma_load(s.dout[pnl], &tm_do, &s.do_full, col0 + 64 * pnl, h, q0);
        } else {
          mbar_arrive(&s.q_full[st]);
        }
      }
    }
  } else {  // ------------------------------------------------------------------- consumers
    setmaxnreg_inc<240>();
    const int wg = consumer_warpgroup();  // the CTA's columns [128 wg, 128 wg + 128), panels 2 wg and 2 wg + 1
    const int wq = warp % 4;      // accumulator rows [16 wq, 16 wq + 16)
    const int g = lane / 4, c = lane % 4, t = threadIdx.x % 128;
    const bool dq_issuer = t == 0;
    const int key_rows = k_end - k_start;
    const int shift = WINDOW ? window_shift(p, q_lo, k_start) : 0;
    uint8_t* ds = s.ds[wg];

    float dk[64], dv[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

    // dQ columns [128 wg + 64 half, + 64) of the CTA's of a finished block -> two swizzled (64, 32)
    // fp32 boxes -> bulk reductions. Masked queries have dS = 0, so rows outside [q_lo, q_hi) add
    // exact zeros. At SPLIT 2 the second half goes to the step's Q stage instead of waiting for the
    // copy engine to read the first half: panels 2 wg and 2 wg + 1 (one box each), which only this
    // warpgroup's dK matmul read after wg 0's S^T (done: share_scores' first
    // consumers_sync). The stage is released to the producer once the copy engine has read them, at
    // the top of the next step (q_empty then counts the two dQ issuers).
    const auto add_dq = [&](const float (&dq)[32], int half, int h, int q0, int st) {
      uint8_t (*boxes)[BLOCK_M * ROW_BYTES] = SPLIT > 1 && half ? s.q[st] + 2 * wg : s.dq[wg];
      // half 0's boxes hold the scores, written once the copy engine had read them (share_scores); at
      // SPLIT 1 half 1 reuses them, so it waits for half 0's reads
      if (dq_issuer && SPLIT == 1 && half) bulk_wait_read();
      warpgroup_sync(wg);  // (for half 1: every warp's slice of the dK matmul has read the Q panels)
      stage_dq(dq, boxes);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      warpgroup_sync(wg);
      if (dq_issuer) {
        const int col = col0 + 128 * wg + 64 * half;
        tma_reduce_add(boxes[0], &tm_dq, col, h, q0);
        tma_reduce_add(boxes[1], &tm_dq, col + 32, h, q0);
      }
    };

    mbar_wait(&s.kv_full, 0);
    for (int step = 0; step < steps; ++step) {
      const int st = step % Q_STAGES;
      const int h = hk * group + step / q_blocks;
      const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
      mbar_wait(&s.q_full[st], (step / Q_STAGES) & 1);
      mbar_wait(&s.do_full, step & 1);
      if (SPLIT > 1 && dq_issuer && step > 0) {  // the previous step's Q stage holds no unread dQ
        bulk_wait_read();
        mbar_arrive(&s.q_empty[(step - 1) % Q_STAGES]);
      }

      // S^T = K Q^T (wg 0) or dP^T = V dO^T (wg 1) over the CTA's 256 columns: A and B both
      // K-major; then both warpgroups hold both
      float sc[32], dp[32];
      {
        float x[32];
        wgmma_fence();
        mma_ss_head_dim<T, COLS>(x, wg ? s.v[0] : s.k[0], sizeof(s.k[0]), wg ? s.dout[0] : s.q[st][0],
                                 sizeof(s.q[st][0]));
        wgmma_wait<0>();
        fence_regs(x);
        share_scores<SPLIT>(x, sc, dp, s, rank, wg, step, steps);
      }

      // P^T
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 lse = *reinterpret_cast<const float2*>(&s.lse[st][8 * i + 2 * c]);  // columns 2c, 2c + 1
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[4 * i + e] = exp2_approx(sc[4 * i + e] * p.scale_log2 - (e & 1 ? lse.y : lse.x));
      }
      mask_invisible<WINDOW, BLOCK_N>(sc, 16 * wq, g, c, k_start, key_rows, q0, q_hi, shift);
      // dV_w += P^T dO_w (B = dO panels 2 wg, 2 wg + 1, read N-major; k-steps of 16 queries)
      uint32_t pa[16];
      pack_fragments<T>(sc, pa);
      mma_rs<T, BLOCK_M / 16>(dv, pa, s.dout[2 * wg], sizeof(s.dout[0]));

#pragma unroll
      for (int i = 0; i < 8; ++i) {  // (while dV runs)
        const float2 delta = *reinterpret_cast<const float2*>(&s.delta[st][8 * i + 2 * c]);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[4 * i + e] = sc[4 * i + e] * p.sm_scale * (dp[4 * i + e] - (e & 1 ? delta.y : delta.x));
      }
      // dK_w += dS^T Q_w
      uint32_t da[16];
      pack_fragments<T>(dp, da);
      mma_rs<T, BLOCK_M / 16>(dk, da, s.q[st][2 * wg], sizeof(s.q[st][0]));

      // dS^T to this warpgroup's buffer; its last reader, the previous step's dQ matmul, has completed
      store_ds_t(smem_u32(ds), 16 * wq, da, lane);
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
        if (SPLIT == 1) mbar_arrive(&s.q_empty[st]);
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
      add_dq(dq0, 0, h, q0, st);
      wgmma_wait<0>();
      fence_regs(dq1);
      add_dq(dq1, 1, h, q0, st);
      // the other CTA may send the next partials into the boxes once the copy engine has read them
      // (after the last step nothing more is sent, and the other CTA may have finished): the first
      // half's two bulk groups, not the second's, which are in the Q stage
      if (SPLIT > 1 && dq_issuer && step + 1 < steps) {
        bulk_wait_read<2>();
        mbar_arrive_cluster(peer_shared(&s.send_ok, rank ^ 1));
      }
    }
    if (dq_issuer) bulk_wait();

    store_dkdv<T, COLS * SPLIT, BLOCK_N>(dk, dv, p, hk, k_start, key_rows, slot, 0, col0 + 128 * wg);
  }
  // a CTA's shared memory must outlive the other's sends into it
  if constexpr (SPLIT > 1) cluster_sync();
}

// ------------------------------------------------------------------------------------ host
template <typename T, int SPLIT, bool WINDOW>
void launch(const DkdvArgs& a, cudaStream_t stream) {
  static_assert(!WINDOW || SPLIT == 1, "windows: head dim 256 only (Gemma's sliding layers)");
  const auto kernel = dkdv_dq_cols_kernel<T, SPLIT, WINDOW>;
  constexpr int SMEM_BYTES = shared_bytes<SharedStorage<SPLIT>>();
  static_assert(SMEM_BYTES <= 227 * 1024, "over the shared memory of an sm_90 CTA");
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  const BwdMaps m = bwd_maps<COLS * SPLIT, BLOCK_N>(a);
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {SPLIT, 1, 1};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(a.n_items * a.num_kv_heads * SPLIT);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = SMEM_BYTES;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, m.q, m.k, m.v, m.dout, m.dq, bwd_params(a));
}

}  // namespace

void dkdv_dq_cols(const DkdvArgs& args, void* stream) {
  if (args.n_items == 0) return;
  launch_for_dtype(args.fp16, [&](auto t) {
    using T = decltype(t);
    const auto s = static_cast<cudaStream_t>(stream);
    if (args.head_dim == 512)
      launch<T, 2, false>(args, s);
    else if (args.window > 0)
      launch<T, 1, true>(args, s);
    else
      launch<T, 1, false>(args, s);
  });
}

}  // namespace dualkv_sm90
