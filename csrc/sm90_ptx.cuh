// PTX wrappers and host helpers shared by the native Hopper (sm_90a) DualKV kernels.
//
// Shared-memory tiles are (rows, 64) panels of 16-bit elements (or (rows, 32) of fp32) with the
// 128-byte swizzle, as TMA writes them: the 16-byte chunk k of row r sits at chunk k ^ (r % 8),
// so a tile must start on a 1024-byte boundary.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace dualkv_sm90 {

constexpr int ROW_BYTES = 128;  // one swizzled row: 64 16-bit elements: a head dim of D is D / 64 panels

// ------------------------------------------------------------------------------------ device
#define DUALKV_ACC16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define DUALKV_ACC16_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
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

// Wait until the phase of `bar` with this parity has completed. CLUSTER: a barrier that other CTAs
// of the cluster arrive on (acquire at cluster scope).
#define DUALKV_MBAR_WAIT(SEM) \
  "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity" SEM ".shared::cta.b64 done, [%0], %1;\n" \
  "@!done bra WAIT;\n}\n"
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if constexpr (CLUSTER)
    asm volatile(DUALKV_MBAR_WAIT(".acquire.cluster")::"r"(smem_u32(bar)), "r"(parity) : "memory");
  else
    asm volatile(DUALKV_MBAR_WAIT("")::"r"(smem_u32(bar)), "r"(parity) : "memory");
}

// --- clusters: the CTAs of a cluster write into each other's shared memory
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// the address of `p`'s counterpart in the shared memory of cluster CTA `rank`
__device__ __forceinline__ uint32_t peer_shared(const void* p, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}

// 16 bytes into another CTA's shared memory, counted on its barrier `bar` (a peer_shared address)
__device__ __forceinline__ void st_async_v4(uint32_t dst, float a, float b, float c, float d, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
               : "memory");
}

// arrive on another CTA's barrier (a peer_shared address), after this thread's earlier accesses
// to its own CTA's shared memory (a CTA-scope fence: a release at cluster scope compiles to a
// GPU-wide memory barrier)
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar) {
  asm volatile("fence.acq_rel.cta;\nmbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
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

// Turns of the two consumer warpgroups (named barriers 4 and 5): warpgroup wg waits for its turn,
// then passes the turn to the other one. Barrier 4 + w completes when warpgroup w waits and the
// other warpgroup has passed.
__device__ __forceinline__ void turn_wait(int wg) { asm volatile("bar.sync %0, 256;" ::"r"(4 + wg) : "memory"); }
__device__ __forceinline__ void turn_pass(int wg) { asm volatile("bar.arrive %0, 256;" ::"r"(5 - wg) : "memory"); }

// both consumer warpgroups (named barrier 1)
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// one consumer warpgroup (named barriers 2 and 3)
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

// the copy engine has read (not necessarily written) every bulk reduction this thread issued but the
// PENDING most recent bulk groups (one per tma_reduce_add)
template <int PENDING = 0>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}
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

// `desc` moved `bytes` further into shared memory. The address field (bits 0-13, 16-byte units) of
// a shared address, which is below 256 KiB, never carries into the next field, so one 32-bit add
// on the low word does it: building every k-step's descriptor anew from its pointer cost about 12
// instructions a wgmma (PERF_NOTES.md, session 32)
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & ~0xFFFFFFFFull) | (uint32_t(desc) + (bytes >> 4));
}

// This thread's consumer warpgroup (warps 4-7: 0, warps 8-11: 1), read from lane 0 so that ptxas
// knows it is warp-uniform: the descriptors built from it then stay in uniform registers, and
// each k-step is one uniform add instead of moves to them (PERF_NOTES.md, session 32)
__device__ __forceinline__ int consumer_warpgroup() { return __shfl_sync(0xffffffff, int(threadIdx.x / 128) - 1, 0); }

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

// One wgmma.mma_async for bf16 or fp16 operands (the element type is part of the opcode, so one asm
// statement per type): PRED sets the scale-d predicate p, SHAPE is "m64nNk16", ACC the accumulator
// list, ARGS the operands after it; the rest are the asm outputs and inputs.
#define DUALKV_WGMMA(T, PRED, SHAPE, ACC, ARGS, ...)                                                       \
  if constexpr (std::is_same_v<T, __nv_bfloat16>)                                                        \
    asm volatile("{\n.reg .pred p;\n" PRED "\nwgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 " ACC \
                 ARGS "\n}\n" : __VA_ARGS__);                                                             \
  else                                                                                                   \
    asm volatile("{\n.reg .pred p;\n" PRED "\nwgmma.mma_async.sync.aligned." SHAPE ".f32.f16.f16 " ACC   \
                 ARGS "\n}\n" : __VA_ARGS__)

// D (64 x 32, fp32) (+)= A (64 x 16) B (16 x 32), both K-major in shared memory
template <typename T>
__device__ __forceinline__ void mma_64x32_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  DUALKV_WGMMA(T, "setp.ne.b32 p, %18, 0;", "m64n32k16", DUALKV_ACC16, ", %16, %17, p, 1, 1, 0, 0;",
               DUALKV_ACC16_OPERANDS(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64 x 64, fp32) (+)= A (64 x 16) B (16 x 64), both from shared memory
template <typename T, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void mma_64x64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  DUALKV_WGMMA(T, "setp.ne.b32 p, %34, 0;", "m64n64k16", DUALKV_ACC32, ", %32, %33, p, 1, 1, %35, %36;",
               DUALKV_ACC32_OPERANDS(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

// D (64 x 128, fp32) (+)= A (64 x 16) B (16 x 128), both K-major in shared memory
template <typename T>
__device__ __forceinline__ void mma_64x128_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  DUALKV_WGMMA(T, "setp.ne.b32 p, %66, 0;", "m64n128k16", DUALKV_ACC64, ", %64, %65, p, 1, 1, 0, 0;",
               DUALKV_ACC64_OPERANDS(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64 x 128, fp32) += A (64 x 16, registers) B (16 x 128, shared memory, N-major)
template <typename T>
__device__ __forceinline__ void mma_64x128_rs(float (&d)[64], const uint32_t* a, uint64_t desc_b) {
  DUALKV_WGMMA(T, "setp.ne.b32 p, 1, 0;", "m64n128k16", DUALKV_ACC64, ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;",
               DUALKV_ACC64_OPERANDS(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ float2 ld_shared_v2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_shared_v2(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// Four 8 x 8 16-bit matrices from registers to shared memory in one instruction: register j holds
// row lane / 4, columns 2 (lane % 4) and + 1 of matrix j (an mma accumulator's pair, packed), and
// lane 8 j + r gives the shared address of row r of matrix j
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
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

// acc (64 x N) = A B^T over head dim D, both K-major (head dim contiguous): A = 64 rows at `a`,
// B = N rows at `b`, each in 64-column panels `*_panel_bytes` apart; k-steps of 16 columns, one
// commit group. The caller issues wgmma_fence() first (once for several back-to-back products).
template <typename T, int D, int REGS>
__device__ __forceinline__ void mma_ss_head_dim(float (&acc)[REGS], const uint8_t* a, uint32_t a_panel_bytes,
                                                const uint8_t* b, uint32_t b_panel_bytes) {
  static_assert(REGS == 16 || REGS == 32 || REGS == 64, "64 x 32, 64 x 64 or 64 x 128 accumulators");
  const uint64_t desc_a0 = smem_desc(a, 16, 1024), desc_b0 = smem_desc(b, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t pnl = kk / 4, col = (kk % 4) * 32;
    const uint64_t desc_a = desc_advance(desc_a0, pnl * a_panel_bytes + col);
    const uint64_t desc_b = desc_advance(desc_b0, pnl * b_panel_bytes + col);
    if constexpr (REGS == 16)
      mma_64x32_ss<T>(acc, desc_a, desc_b, kk);
    else if constexpr (REGS == 32)
      mma_64x64_ss<T, 0, 0>(acc, desc_a, desc_b, kk);
    else
      mma_64x128_ss<T>(acc, desc_a, desc_b, kk);
  }
  wgmma_commit();
}

// The dynamic shared memory as S, its base rounded up to 1024 bytes (the swizzle atom of the
// tiles); launch with shared_bytes<S>() of dynamic shared memory. The offset is added to `raw`
// itself, so that accesses through S compile to shared loads and stores. GENERIC rebuilds the
// pointer from an integer instead, which loses the state space: every access becomes a generic
// load or store. The head-dim-128 backward keeps that: with shared accesses its forward + backward
// ran 3% slower, where the head-dim-256 one ran 4% faster (PERF_NOTES.md, session 6, run AG).
template <typename S, bool GENERIC = false>
__device__ __forceinline__ S& aligned_shared(uint8_t* raw) {
  if constexpr (GENERIC)
    return *reinterpret_cast<S*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  else
    return *reinterpret_cast<S*>(raw + ((1024 - (smem_u32(raw) & 1023)) & 1023));
}

template <typename S>
constexpr int shared_bytes() {
  return sizeof(S) + 1024;
}

// A fragments of an RS wgmma from an fp32 accumulator: pair j is elements 2j, 2j+1 (same row,
// adjacent columns), so the accumulator layout of a 64 x N wgmma is the A layout of the next one
template <typename T, int N>
__device__ __forceinline__ void pack_fragments(const float (&x)[2 * N], uint32_t (&a)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] = pack2<T>(x[2 * j], x[2 * j + 1]);
}

// acc (64 x 128) += A B over K_STEPS k-steps of 16: A from registers (4 per step), B read N-major
// from 16-row steps of the swizzled panels at `b` (`panel_bytes` apart); one commit group
template <typename T, int K_STEPS>
__device__ __forceinline__ void mma_rs(float (&acc)[64], const uint32_t* a, const uint8_t* b, uint32_t panel_bytes) {
  fence_regs(acc);
  wgmma_fence();
  const uint64_t desc_b = smem_desc(b, panel_bytes, 1024);
#pragma unroll
  for (int j = 0; j < K_STEPS; ++j) mma_64x128_rs<T>(acc, a + 4 * j, desc_advance(desc_b, j * 16 * ROW_BYTES));
  wgmma_commit();
}

// ------------------------------------------------------------------------------------ host
constexpr double LOG2E = 1.4426950408889634;  // scores go through exp2: scale_log2 = softmax scale * LOG2E

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
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

// (128 bytes of columns, 1 head, rows) boxes of a (T, H, head_dim) tensor, 128-byte swizzle, zero fill past T
inline CUtensorMap head_tile_map(const void* ptr, CUtensorMapDataType dtype, int elem_bytes, int T, int H, int head_dim,
                                 int64_t stride_t, int64_t stride_h, int rows) {
  CUtensorMap map;
  cuuint64_t dims[3] = {cuuint64_t(head_dim), cuuint64_t(H), cuuint64_t(T)};
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

// call launch with a value of the element type (bf16 or fp16), then check the kernel launch
template <typename Launch>
void launch_for_dtype(bool fp16, Launch&& launch) {
  if (fp16)
    launch(__half{});
  else
    launch(__nv_bfloat16{});
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("dualkv_sm90: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dualkv_sm90
