// Host interface of the native Hopper (sm_90a) DualKV kernels: plain pointers and sizes, so the
// CUDA sources compile without torch headers and the torch binding compiles without nvcc.
#pragma once
#include <cstdint>

namespace dualkv_sm90 {

// q (T, Hq, D), k and v (T, Hkv, D): base pointers and element strides of the token and head dims
struct QKV {
  const void* q; const void* k; const void* v;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h;
};

// Forward, head dim 128, 256 or 512. One program per (tiles row, query head): tiles as built by
// megatron_dualkv.ops.dualkv_attn.query_tiles with 128-row tiles (64-row at D = 512): (n_tiles, 5)
// int32 rows (q_start, q_end, seg_start, prefix_start, prefix_len) of a single-range layout (depth
// 1), or with `pieces` (n_tiles, 6) rows (q_start, q_end, seg_start, seg_pos, piece_lo, piece_hi)
// of a multi-range one (prefix trees), over its piece_table.
struct FwdArgs {
  QKV qkv;
  int head_dim;
  const int32_t* tiles;
  int n_tiles;
  const int32_t* pieces;  // (n_pieces, 3) int32 rows (start, length, position); nullptr: 5-int tiles
  void* out;  // (T, Hq, D)
  int64_t out_stride_t, out_stride_h;
  float* lse;  // (Hq, T), log2 units
  int T, num_heads, num_kv_heads;
  double sm_scale;  // softmax scale
  bool fp16;        // else bf16
  int window;       // left window in logical positions (a query sees keys with pos_q - pos_k < window); 0: none.
                    // Head dims 128 and 256.
};

void fwd(const FwdArgs& args, void* stream);

// dK/dV pass with fused dQ. Tensors are (T, H, D) with unit last stride; strides in elements. One
// program per (items row, key/value head): items (n_items, 5) int32 rows (k_start, k_end, q_lo,
// q_hi, slot) as built by megatron_dualkv.ops.dualkv_attn.key_items with N-key tiles and 64-query
// blocks; N = 128 at D = 128 (dkdv_dq), 64 at D = 256 and 512 (dkdv_dq_cols).
struct DkdvArgs {
  QKV qkv;
  int head_dim;
  const void* dout;
  int64_t do_stride_t, do_stride_h;
  const float* lse;    // (Hq, T), log2 units
  const float* delta;  // (Hq, T)
  const int32_t* items;
  int n_items;
  void* dk; void* dv;  // (T, Hkv, D), written where slot < 0
  int64_t dk_stride_t, dk_stride_h, dv_stride_t, dv_stride_h;
  float* partial_dk; float* partial_dv;  // (slots * N, Hkv, D) fp32, written where slot >= 0
  float* dq_acc;                        // (T, Hq, D) fp32, zeroed by the caller; receives dQ (scaled)
  int T, num_heads, num_kv_heads;
  double sm_scale;     // softmax scale
  bool fp16;           // else bf16
  int window;          // as FwdArgs::window (head dims 128 and 256); then the items come from
                       // key_items with that window, whose query ranges are runs of consecutive positions
  const int64_t* positions;  // (T,) logical positions, read where window > 0
};

void dkdv_dq(const DkdvArgs& args, void* stream);       // D = 128
void dkdv_dq_cols(const DkdvArgs& args, void* stream);  // D = 256, 512

}  // namespace dualkv_sm90
