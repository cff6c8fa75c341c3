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
//     dS^T = P^T * (dP^T - delta)
//     dV_w += P^T dO,  dK_w += dS^T Q  (P^T, dS^T stay in registers as the A operands: the wgmma
//                                       accumulator layout is the A-fragment layout)
//     dS^T -> shared memory; both warpgroups meet at a named barrier; then warpgroup w computes
//     dQ[:, 64w:64w+64] = dS K[:, 64w:64w+64] over all 128 keys, stages it in shared memory and
//     adds it to an fp32 (T, Hq, 128) buffer with TMA bulk tensor reductions: issued by one
//     thread, run by the copy engine while the warpgroup goes on (per-thread fp32 atomics cost
//     4.5 of 18.8 ms at 16x8192x1024; PERF_NOTES.md, session 4).
// That is 5 matmuls per (query block, key tile) against 7 for the Triton separate-dQ plan.
//
// Shared-memory tiles are (rows, 64) panels with the 128-byte swizzle, as TMA writes them:
// element (r, c) of a panel sits at r*128 + ((c/8) ^ (r%8))*16 + (c%8)*2 bytes.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dualkv_sm90.h"

namespace dualkv_sm90 {
namespace {

constexpr int HEAD_DIM = 128;
constexpr int BLOCK_M = 64;    // queries per step
constexpr int BLOCK_N = 128;   // keys per CTA: two consumer warpgroups of 64
constexpr int STAGES = 2;
constexpr int PANELS = HEAD_DIM / 64;
constexpr int ROW_BYTES = 128;  // one swizzled row: 64 16-bit elements
constexpr int THREADS = 384;
constexpr int CONSUMER_THREADS = 256;

struct alignas(1024) SharedStorage {
  uint8_t k[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t v[PANELS][BLOCK_N * ROW_BYTES];
  uint8_t q[STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t dout[STAGES][PANELS][BLOCK_M * ROW_BYTES];
  uint8_t ds[2][BLOCK_N * ROW_BYTES];  // dS^T (key, query), double-buffered across steps
  uint8_t dq[2][2][BLOCK_M * ROW_BYTES];  // per warpgroup, two (64 queries, 32 fp32) swizzled boxes
  float lse[STAGES][BLOCK_M];
  float delta[STAGES][BLOCK_M];
  uint64_t kv_full;
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};
constexpr int SMEM_BYTES = sizeof(SharedStorage) + 1024;  // + room to align the dynamic base

#define DUALKV_ACC32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define DUALKV_ACC32_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DUALKV_ACC64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define DUALKV_ACC64_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// ------------------------------------------------------------------------------------ PTX
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// (64 columns, 1 head, rows) box of a (T, H, D) tensor into a swizzled panel
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int head, int row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(col), "r"(head), "r"(row)
      : "memory");
}

template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_THREADS) : "memory");
}

__device__ __forceinline__ void warpgroup_sync(int wg) {
  asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");
}

// Add a (64 rows, 1 head, 32 fp32 columns) box of shared memory onto a (T, H, 128) fp32 tensor;
// rows past T are dropped by the copy engine
__device__ __forceinline__ void tma_reduce_add(const void* src, const CUtensorMap* map, int col, int head, int row) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(col), "r"(head), "r"(row)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// the copy engine has read (not necessarily written) every bulk reduction this thread issued
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands ignore `leading` (the K
// extent of one wgmma, 16 elements, stays inside a swizzled row); MN-major operands use it for
// the distance between 64-element panels. `stride` is the distance between 8-row groups.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t leading, uint32_t stride) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((leading >> 4) & 0x3FFF) << 16) |
         (uint64_t((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keep the compiler from moving accumulator reads or writes across wgmma issue and wait, and from
// reusing the registers of A operands that an issued wgmma still reads.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// D (64 x 64, fp32) (+)= A (64 x 16) B (16 x 64), both from shared memory
template <typename T, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void mma_64x64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DUALKV_ACC32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : DUALKV_ACC32_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DUALKV_ACC32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : DUALKV_ACC32_OPERANDS(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
  }
}

// D (64 x 128, fp32) += A (64 x 16, registers) B (16 x 128, shared memory, N-major)
template <typename T>
__device__ __forceinline__ void mma_64x128_rs(float (&d)[64], const uint32_t* a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DUALKV_ACC64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DUALKV_ACC64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DUALKV_ACC64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DUALKV_ACC64_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// ------------------------------------------------------------------------------------ kernel
struct KernelParams {
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
};

// Accumulator element e (0..3) of 8-column group i held by a thread: row offset, column.
//   rows 16 * warp + lane / 4 (+ 8 for e >= 2), columns 8 i + 2 (lane % 4) (+ 1 for odd e)
template <typename T>
__global__ void __launch_bounds__(THREADS, 1)
    dkdv_dq_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                   const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                   const __grid_constant__ CUtensorMap tm_dq, const KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

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
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 32);                      // every producer lane (lse, delta rows)
      mbar_init(&s.empty[i], CONSUMER_THREADS / 32);  // one lane per consumer warp
    }
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
      const int st = step % STAGES;
      const int h = hk * group + step / q_blocks;
      const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
      mbar_wait(&s.empty[st], ((step / STAGES) & 1) ^ 1);
      for (int r = lane; r < BLOCK_M; r += 32) {
        const bool ok = q0 + r < p.T;  // rows past q_hi are masked by the consumers
        const int64_t at = int64_t(h) * p.T + q0 + r;
        s.lse[st][r] = ok ? p.lse[at] : 0.f;
        s.delta[st][r] = ok ? p.delta[at] : 0.f;
      }
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
  const int wg = warp / 4 - 1;          // keys [64 wg, 64 wg + 64) of the tile
  const int wq = warp % 4;              // accumulator rows [16 wq, 16 wq + 16) of the warpgroup
  const int g = lane / 4, c = lane % 4;
  const bool dq_issuer = threadIdx.x % 128 == 0;
  const int key_rows = k_end - k_start;

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

  mbar_wait(&s.kv_full, 0);
  for (int step = 0; step < steps; ++step) {
    const int st = step % STAGES;
    const int h = hk * group + step / q_blocks;
    const int q0 = q_lo + (step % q_blocks) * BLOCK_M;
    mbar_wait(&s.full[st], (step / STAGES) & 1);

    // S^T = K_w Q^T and dP^T = V_w dO^T: A and B both K-major (rows of 64 head-dim elements)
    float sc[32], dp[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      const int pnl = kk / 4, col = (kk % 4) * 32;
      mma_64x64_ss<T, 0, 0>(sc, smem_desc(s.k[pnl] + 64 * wg * ROW_BYTES + col, 16, 1024),
                            smem_desc(s.q[st][pnl] + col, 16, 1024), kk);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      const int pnl = kk / 4, col = (kk % 4) * 32;
      mma_64x64_ss<T, 0, 0>(dp, smem_desc(s.v[pnl] + 64 * wg * ROW_BYTES + col, 16, 1024),
                            smem_desc(s.dout[st][pnl] + col, 16, 1024), kk);
    }
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(sc);

    // P^T: keys are rows, queries columns; a key past the tile, a query past the range, or a
    // query before the key (packed order) is invisible
    const bool masked = q0 < k_end - 1 || q0 + BLOCK_M > q_hi || key_rows < BLOCK_N;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 64 * wg + 16 * wq + g + 8 * (e >> 1), col = 8 * i + 2 * c + (e & 1);
        float x = exp2_approx(sc[4 * i + e] * p.scale_log2 - s.lse[st][col]);
        if (masked) {
          const int key = k_start + row, query = q0 + col;
          if (row >= key_rows || query >= q_hi || query < key) x = 0.f;
        }
        sc[4 * i + e] = x;
      }
    }
    wgmma_wait<0>();
    fence_regs(dp);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * i + e] = sc[4 * i + e] * (dp[4 * i + e] - s.delta[st][8 * i + 2 * c + (e & 1)]);
    }

    // A fragments: pair j covers accumulator elements 2j, 2j+1 (same row, adjacent columns)
    uint32_t pa[16], da[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      pa[j] = pack2<T>(sc[2 * j], sc[2 * j + 1]);
      da[j] = pack2<T>(dp[2 * j], dp[2 * j + 1]);
    }

    // dV += P^T dO, dK += dS^T Q: B is N-major (head dim contiguous), k-steps of 16 query rows
    fence_regs(dv);
    fence_regs(dk);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < BLOCK_M / 16; ++j)
      mma_64x128_rs<T>(dv, pa + 4 * j, smem_desc(s.dout[st][0] + j * 16 * ROW_BYTES, BLOCK_M * ROW_BYTES, 1024));
#pragma unroll
    for (int j = 0; j < BLOCK_M / 16; ++j)
      mma_64x128_rs<T>(dk, da + 4 * j, smem_desc(s.q[st][0] + j * 16 * ROW_BYTES, BLOCK_M * ROW_BYTES, 1024));
    wgmma_commit();

    // dS^T to shared memory (one 128-byte swizzled row per key), for the dQ matmul of both warpgroups
    uint8_t* ds = s.ds[step & 1];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 64 * wg + 16 * wq + g + 8 * half;
        *reinterpret_cast<uint32_t*>(ds + row * ROW_BYTES + ((i ^ (row & 7)) << 4) + 4 * c) = da[2 * i + half];
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    consumers_sync();

    // dQ[:, 64 wg:64 wg + 64] = dS K: A = dS^T read M-major, B = K panel wg read N-major,
    // k-steps of 16 keys
    float dq[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      mma_64x64_ss<T, 1, 1>(dq, smem_desc(ds + kk * 16 * ROW_BYTES, BLOCK_N * ROW_BYTES, 1024),
                            smem_desc(s.k[wg] + kk * 16 * ROW_BYTES, BLOCK_N * ROW_BYTES, 1024), kk);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dq);
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(pa);
    fence_regs(da);
    __syncwarp();
    if (lane == 0) mbar_arrive(&s.empty[st]);  // this warp is done with the stage's Q and dO

    // dQ block -> two swizzled (64, 32) fp32 boxes -> bulk reductions. Masked queries have dS = 0,
    // so the block's rows outside [q_lo, q_hi) add exact zeros.
    if (dq_issuer) bulk_wait_read();  // the previous block's boxes have been read
    warpgroup_sync(wg);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 16 * wq + g + 8 * half;  // row % 8 == g
        uint8_t* box = s.dq[wg][i / 4];
        *reinterpret_cast<float2*>(box + row * ROW_BYTES + (((2 * (i % 4) + c / 2) ^ g) << 4) + 8 * (c % 2)) =
            make_float2(dq[4 * i + 2 * half], dq[4 * i + 2 * half + 1]);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    warpgroup_sync(wg);
    if (dq_issuer) {
      tma_reduce_add(s.dq[wg][0], &tm_dq, 64 * wg, h, q0);
      tma_reduce_add(s.dq[wg][1], &tm_dq, 64 * wg + 32, h, q0);
    }
  }
  if (dq_issuer) bulk_wait();

  // dK (scaled) and dV: rows of this warpgroup's keys, 2 adjacent columns per store
#pragma unroll
  for (int i = 0; i < 16; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 64 * wg + 16 * wq + g + 8 * half, col = 8 * i + 2 * c;
      const float k0 = dk[4 * i + 2 * half] * p.sm_scale, k1 = dk[4 * i + 2 * half + 1] * p.sm_scale;
      const float v0 = dv[4 * i + 2 * half], v1 = dv[4 * i + 2 * half + 1];
      if (slot < 0) {
        if (row < key_rows) {
          const int64_t t = k_start + row;
          T* dk_out = static_cast<T*>(p.dk) + t * p.dk_stride_t + hk * p.dk_stride_h + col;
          T* dv_out = static_cast<T*>(p.dv) + t * p.dv_stride_t + hk * p.dv_stride_h + col;
          *reinterpret_cast<uint32_t*>(dk_out) = pack2<T>(k0, k1);
          *reinterpret_cast<uint32_t*>(dv_out) = pack2<T>(v0, v1);
        }
      } else {
        const int64_t at = ((int64_t(slot) * BLOCK_N + row) * p.num_kv_heads + hk) * HEAD_DIM + col;
        *reinterpret_cast<float2*>(p.partial_dk + at) = make_float2(k0, k1);
        *reinterpret_cast<float2*>(p.partial_dv + at) = make_float2(v0, v1);
      }
    }
  }
}

// ------------------------------------------------------------------------------------ host
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      throw std::runtime_error("dualkv_sm90: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// (128 bytes of columns, 1 head, rows) boxes of a (T, H, 128) tensor, 128-byte swizzle, zero fill past T
CUtensorMap head_tile_map(const void* ptr, CUtensorMapDataType dtype, int elem_bytes, int T, int H, int64_t stride_t,
                          int64_t stride_h, int rows) {
  CUtensorMap map;
  cuuint64_t dims[3] = {HEAD_DIM, cuuint64_t(H), cuuint64_t(T)};
  cuuint64_t strides[2] = {cuuint64_t(stride_h) * elem_bytes, cuuint64_t(stride_t) * elem_bytes};
  cuuint32_t box[3] = {cuuint32_t(ROW_BYTES / elem_bytes), 1, cuuint32_t(rows)};
  cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, dtype, 3, const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("dualkv_sm90: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) +
                             "); base and strides must be 16-byte aligned");
  return map;
}

template <typename T>
void launch(const DkdvArgs& a, cudaStream_t stream) {
  const auto kernel = dkdv_dq_kernel<T>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  const auto dtype = a.fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUtensorMap tm_q = head_tile_map(a.q, dtype, 2, a.T, a.num_heads, a.q_stride_t, a.q_stride_h, BLOCK_M);
  const CUtensorMap tm_do = head_tile_map(a.dout, dtype, 2, a.T, a.num_heads, a.do_stride_t, a.do_stride_h, BLOCK_M);
  const CUtensorMap tm_k = head_tile_map(a.k, dtype, 2, a.T, a.num_kv_heads, a.k_stride_t, a.k_stride_h, BLOCK_N);
  const CUtensorMap tm_v = head_tile_map(a.v, dtype, 2, a.T, a.num_kv_heads, a.v_stride_t, a.v_stride_h, BLOCK_N);
  const CUtensorMap tm_dq = head_tile_map(a.dq_acc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.T, a.num_heads,
                                          int64_t(a.num_heads) * HEAD_DIM, HEAD_DIM, BLOCK_M);
  const KernelParams p{a.lse, a.delta, a.items, a.dk, a.dv, a.dk_stride_t, a.dk_stride_h, a.dv_stride_t,
                       a.dv_stride_h, a.partial_dk, a.partial_dv, a.T, a.num_heads, a.num_kv_heads,
                       a.sm_scale, a.scale_log2};
  kernel<<<a.n_items * a.num_kv_heads, THREADS, SMEM_BYTES, stream>>>(tm_q, tm_k, tm_v, tm_do, tm_dq, p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("dualkv_sm90: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace

void dkdv_dq(const DkdvArgs& args, void* stream) {
  if (args.n_items == 0) return;
  if (args.fp16)
    launch<__half>(args, static_cast<cudaStream_t>(stream));
  else
    launch<__nv_bfloat16>(args, static_cast<cudaStream_t>(stream));
}

}  // namespace dualkv_sm90
