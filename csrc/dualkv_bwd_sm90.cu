// Native Hopper (sm_90a) backward of DualKV attention for head dim 128: one dK/dV pass that also
// accumulates dQ, on wgmma tensor-core instructions fed by TMA.
//
// Work split (the same tables as the Triton kernels, megatron_dualkv/ops/dualkv_attn.py): one CTA
// per (key tile of 128 keys, query chunk, key/value head). The queries that see a key tile form
// one contiguous packed range [q_lo, q_hi) (a prompt tile: the rest of its prompt, then every
// response of its group; a response tile: the rest of its response), so in packed order a query
// i sees key j iff i >= j, and only blocks that cross the diagonal or the range ends need a mask.
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer: one warp streams (Q, dO) blocks of 64 queries,
// and their log-sum-exp and delta rows, into a 2-stage ring (TMA, mbarriers). Warpgroups 1 and 2
// each own 64 of the tile's keys and, per query block (all in registers except where noted):
//     S^T  = K_w Q^T                 (64 x 64, wgmma from shared memory)
//     dP^T = V_w dO^T
//     P^T  = 2^(S^T * scale_log2 - lse)            masked to 0 where invisible
//     dS^T = scale * P^T * (dP^T - delta)   (the softmax scale of dK and dQ, applied once here)
//     dV_w += P^T dO,  dK_w += dS^T Q  (P^T, dS^T stay in registers as the A operands: the wgmma
//                                       accumulator layout is the A-fragment layout)
//     dS^T -> shared memory; one step later (so that neither warpgroup waits for the other),
//     warpgroup w computes dQ[:, 64w:64w+64] = dS K[:, 64w:64w+64] over all 128 keys, stages it
//     in shared memory and adds it to an fp32 (T, Hq, 128) buffer with TMA bulk tensor
//     reductions: issued by one thread, run by the copy engine while the warpgroup goes on
//     (per-thread fp32 atomics cost 4.5 of 18.8 ms at 16x8192x1024; PERF_NOTES.md, session 4).
// That is 5 matmuls per (query block, key tile) against 7 for the Triton separate-dQ plan.
#include "dualkv_bwd_sm90.cuh"

namespace dualkv_sm90 {
namespace {

constexpr int HEAD_DIM = 128;
constexpr int PANELS = HEAD_DIM / 64;
constexpr int BLOCK_M = BWD_BLOCK_M;  // queries per step
constexpr int BLOCK_N = 128;          // keys per CTA: two consumer warpgroups of 64
constexpr int STAGES = 2;
constexpr int THREADS = 384;
constexpr int CONSUMER_THREADS = 256;

struct alignas(1024) SharedStorage {
  uint8_t k[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t v[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t q[STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t dout[STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t ds[3][BLOCK_N * ROW_BYTES];  // dS^T (key, query) of the last three steps
  uint8_t dq[2][2][BLOCK_M * ROW_BYTES];  // per warpgroup, two (64 queries, 32 fp32) swizzled boxes
  float lse[STAGES][BLOCK_M];
  float delta[STAGES][BLOCK_M];
  uint64_t kv_full;
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
  uint64_t ds_full[3];
};

// ------------------------------------------------------------------------------------ kernel
// Accumulator element e (0..3) of 8-column group i held by a thread: row offset, column.
//   rows 16 * warp + lane / 4 (+ 8 for e >= 2), columns 8 i + 2 (lane % 4) (+ 1 for odd e)
template <typename T, bool WINDOW>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_dq_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                   const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                   const __grid_constant__ CUtensorMap tm_dq, const BwdParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = aligned_shared<SharedStorage, true>(smem_raw);  // generic: see aligned_shared

  const BwdItem w = bwd_item(p, blockIdx.x, gridDim.x);
  const int hk = w.hk, k_start = w.k_start, k_end = w.k_end, q_lo = w.q_lo, q_hi = w.q_hi, slot = w.slot;
  const int group = w.group, q_blocks = w.q_blocks, steps = w.steps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 32);                      // every producer lane (lse, delta rows)
      mbar_init(&s.empty[i], CONSUMER_THREADS / 32);  // one lane per consumer warp
    }
    for (int i = 0; i < 3; ++i) mbar_init(&s.ds_full[i], CONSUMER_THREADS / 32);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // the first step's dQ matmul reads dS^T of "step -1" from ds[2]: zeros, so it adds nothing
  for (int i = threadIdx.x; i < BLOCK_N * ROW_BYTES / 16; i += THREADS)
    reinterpret_cast<uint4*>(s.ds[2])[i] = make_uint4(0, 0, 0, 0);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
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
      const int st = step % STAGES;
      const int h = hk * group + step / q_blocks;
      const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
      mbar_wait(&s.empty[st], ((step / STAGES) & 1) ^ 1);
      load_lse_delta(s.lse[st], s.delta[st], p, h, q0, lane);
      if (lane == 0) {
        mbar_arrive_expect_tx(&s.full[st], 2 * BLOCK_M * HEAD_DIM * sizeof(T));
        for (int pnl = 0; pnl < PANELS; ++pnl) {
          tma_load(s.q[st][pnl], &tm_q, &s.full[st], 64 * pnl, h, q0);
          tma_load(s.dout[st][pnl], &tm_do, &s.full[st], 64 * pnl, h, q0);
        }
      } else {
        mbar_arrive(&s.full[st]);
      }
    }
    return;
  }

  // -------------------------------------------------------------------------------- consumers
  setmaxnreg_inc<240>();
  const int wg = consumer_warpgroup();  // keys [64 wg, 64 wg + 64) of the tile
  const int wq = warp % 4;              // accumulator rows [16 wq, 16 wq + 16) of the warpgroup
  const int g = lane / 4, c = lane % 4;
  const bool dq_issuer = threadIdx.x % 128 == 0;
  const int key_rows = k_end - k_start;
  const int shift = WINDOW ? window_shift(p, q_lo, k_start) : 0;

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

  // dQ[:, 64 wg:64 wg + 64] of a step = dS K: A = dS^T read M-major, B = K panel wg read N-major,
  // k-steps of 16 keys; one commit group
  const auto issue_dq = [&](float (&dq)[32], const uint8_t* ds) {
    const uint64_t desc_ds = smem_desc(ds, BLOCK_N * ROW_BYTES, 1024), desc_k = smem_desc(s.k[wg], BLOCK_N * ROW_BYTES, 1024);
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      mma_64x64_ss<T, 1, 1>(dq, desc_advance(desc_ds, kk * 16 * ROW_BYTES), desc_advance(desc_k, kk * 16 * ROW_BYTES), kk);
    wgmma_commit();
  };
  // a finished dQ block -> two swizzled (64, 32) fp32 boxes (stage_dq), added to the buffer by
  // bulk reductions that issue_reduce starts in the next step, once dK is issued: the copy
  // engine's reads of the boxes then overlap the dV and dK wgmmas, which read one operand from
  // registers, not the S^T and dP^T wgmmas, which read both from shared memory at the port's full
  // rate (PERF_NOTES.md, runs CB-CJ: after the S^T wait -1%, after dK -2%, after dP^T or the dS^T
  // stores slower than not deferring). Masked queries have dS = 0, so the block's rows outside
  // [q_lo, q_hi) add exact zeros.
  const auto stage_block = [&](const float (&dq)[32]) {
    if (dq_issuer) bulk_wait_read();  // the previous block's boxes have been read
    warpgroup_sync(wg);
    stage_dq(dq, s.dq[wg], wq, g, c);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  };
  const auto issue_reduce = [&](int step) {  // of the block staged last, step's dQ
    warpgroup_sync(wg);
    if (dq_issuer) {
      const int h = hk * group + step / q_blocks, q0 = q_lo + (step % q_blocks) * BLOCK_M;
      tma_reduce_add(s.dq[wg][0], &tm_dq, 64 * wg, h, q0);
      tma_reduce_add(s.dq[wg][1], &tm_dq, 64 * wg + 32, h, q0);
    }
  };

  // dS^T of step j sits in ds[j % 3], and ds_full[j % 3] completes once every consumer warp has
  // written its rows; "step -1" is the zeroed ds[2], whose barrier reads as complete (parity 1 of
  // a fresh barrier)
  const auto wait_ds = [&](int j) { mbar_wait(&s.ds_full[(j + 3) % 3], ((j + 3) / 3 + 1) & 1); };

  // The dQ matmul of step i-1 is issued in step i behind dK: it runs while dS^T of step i is
  // written, and it never waits for the other warpgroup (its dS^T was written a step earlier),
  // where a barrier in the middle of the step held both warpgroups in lockstep. Three dS
  // buffers: a warpgroup writes ds[i % 3] after ds_full of step i-1, which the other warpgroup
  // arrives at only after its dQ of step i-3 (the last reader of ds[i % 3]) has completed.
  mbar_wait(&s.kv_full, 0);
  for (int step = 0; step < steps; ++step) {
    const int st = step % STAGES;
    const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
    mbar_wait(&s.full[st], (step / STAGES) & 1);

    // S^T = K_w Q^T and dP^T = V_w dO^T: A and B both K-major (rows of 64 head-dim elements)
    float sc[32], dp[32];
    wgmma_fence();
    mma_ss_head_dim<T, HEAD_DIM>(sc, s.k[0] + 64 * wg * ROW_BYTES, sizeof(s.k[0]), s.q[st][0], sizeof(s.q[st][0]));
    mma_ss_head_dim<T, HEAD_DIM>(dp, s.v[0] + 64 * wg * ROW_BYTES, sizeof(s.v[0]), s.dout[st][0], sizeof(s.dout[st][0]));
    wgmma_wait<1>();  // S^T
    fence_regs(sc);

    // P^T (lse and delta through shared-window addresses: the storage's generic pointer gives each
    // load a 64-bit address)
    const uint32_t lse_at = smem_u32(s.lse[st]) + 8 * c, delta_at = smem_u32(s.delta[st]) + 8 * c;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 lse = ld_shared_v2(lse_at + 32 * i);  // columns 8 i + 2 c, + 1
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[4 * i + e] = exp2_approx(sc[4 * i + e] * p.scale_log2 - (e & 1 ? lse.y : lse.x));
    }
    mask_invisible<WINDOW, BLOCK_N>(sc, 64 * wg + 16 * wq, g, c, k_start, key_rows, q0, q_hi, shift);
    // dV += P^T dO as soon as P is ready (B = dO is N-major: head dim contiguous; k-steps of 16
    // queries), so that dS is computed while it runs
    uint32_t pa[16];
    pack_fragments<T>(sc, pa);
    mma_rs<T, BLOCK_M / 16>(dv, pa, s.dout[st][0], BLOCK_M * ROW_BYTES);

    wgmma_wait<1>();  // dP^T (dV may still run)
    fence_regs(dp);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 delta = ld_shared_v2(delta_at + 32 * i);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[4 * i + e] = sc[4 * i + e] * p.sm_scale * (dp[4 * i + e] - (e & 1 ? delta.y : delta.x));
    }
    // dK += dS^T Q
    uint32_t da[16];
    pack_fragments<T>(dp, da);
    mma_rs<T, BLOCK_M / 16>(dk, da, s.q[st][0], BLOCK_M * ROW_BYTES);
    if (step > 0) issue_reduce(max(step - 2, 0));  // staged at the end of step - 1

    float dq[32];
    wait_ds(step - 1);
    wgmma_fence();
    issue_dq(dq, s.ds[(step + 2) % 3]);

    // dS^T to shared memory, for the next step's dQ matmul of both warpgroups
    store_ds_t(smem_u32(s.ds[step % 3]), 64 * wg + 16 * wq, da, lane);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(&s.ds_full[step % 3]);

    wgmma_wait<0>();  // dV, dK, dQ
    fence_regs(dq);
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(pa);
    fence_regs(da);
    __syncwarp();
    if (lane == 0) mbar_arrive(&s.empty[st]);  // this warp is done with the stage's Q and dO
    stage_block(dq);  // of step - 1; at step 0: zeros
  }
  if (steps > 0) {
    issue_reduce(max(steps - 2, 0));  // the block the loop staged last
    float dq[32];
    wait_ds(steps - 1);
    wgmma_fence();
    issue_dq(dq, s.ds[(steps - 1) % 3]);
    wgmma_wait<0>();
    fence_regs(dq);
    stage_block(dq);
    issue_reduce(steps - 1);
  }
  if (dq_issuer) bulk_wait();

  store_dkdv<T, HEAD_DIM, BLOCK_N>(dk, dv, p, hk, k_start, key_rows, slot, 64 * wg, 0);
}

// ------------------------------------------------------------------------------------ host
template <typename T, bool WINDOW>
void launch(const DkdvArgs& a, cudaStream_t stream) {
  const auto kernel = dkdv_dq_kernel<T, WINDOW>;
  constexpr int SMEM_BYTES = shared_bytes<SharedStorage>();
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  const BwdMaps m = bwd_maps<HEAD_DIM, BLOCK_N>(a);
  kernel<<<a.n_items * a.num_kv_heads, THREADS, SMEM_BYTES, stream>>>(m.q, m.k, m.v, m.dout, m.dq, bwd_params(a));
}

}  // namespace

void dkdv_dq(const DkdvArgs& args, void* stream) {
  if (args.n_items == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  launch_for_dtype(args.fp16, [&](auto t) {
    if (args.window > 0)
      launch<decltype(t), true>(args, s);
    else
      launch<decltype(t), false>(args, s);
  });
}

}  // namespace dualkv_sm90
