// The parameters and host setup shared by the native Hopper backward kernels: dualkv_bwd_sm90.cu
// (head dim 128, the consumer warpgroups split the keys of a tile) and dualkv_bwd_d256_sm90.cu
// (head dim 256, they split the head-dim columns). Both run one fused dK/dV + dQ pass per (key
// tile, query chunk, key/value head) over the Triton kernels' work tables, in steps of 64 queries.
//
// Their device code stays written out in each kernel: factoring the shared per-step code into
// helpers here left the SASS's matmuls and barriers unchanged but cost 1.1 ms of 21.3 at D = 128
// (PERF_NOTES.md, session 5, run AE).
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
};

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
          float(a.sm_scale * LOG2E)};
}

}  // namespace dualkv_sm90
