// torch binding of the native Hopper DualKV kernels (csrc/dualkv_*_sm90.cu).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "dualkv_sm90.h"

namespace {

void check_heads(const at::Tensor& t, const char* name, int64_t head_dim) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 3 && t.size(2) == head_dim && t.stride(2) == 1, name, " must be a CUDA (T, H, ",
              head_dim, ") tensor with unit last stride, got ", t.sizes(), " strides ", t.strides());
}

// q's dtype (bf16 or fp16), shared by every tensor of `same`
void check_dtype(const at::Tensor& q, std::initializer_list<const at::Tensor*> same, const char* names) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "q must be bfloat16 or float16, got ", dtype);
  for (const auto* t : same) TORCH_CHECK(t->scalar_type() == dtype, names, " must share one dtype");
}

void check_table(const at::Tensor& t, const char* name, int64_t width = 5) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.dim() == 2 && t.size(1) == width && t.is_contiguous(),
              name, " must be a contiguous CUDA (n, ", width, ") int32 tensor");
}

dualkv_sm90::QKV qkv_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return {q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
          v.stride(1)};
}

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous CUDA float32 tensor");
}

// The head dim D of q (T, Hq, D), k and v (T, Hkv, D), checked: a head dim the kernels of `pass`
// take, and Hkv dividing Hq
int64_t checked_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* pass) {
  const int64_t D = q.dim() == 3 ? q.size(2) : 0;
  TORCH_CHECK(D == 128 || D == 256 || D == 512, "the native ", pass, " takes head dim 128, 256 or 512, got q of shape ",
              q.sizes());
  check_heads(q, "q", D);
  check_heads(k, "k", D);
  check_heads(v, "v", D);
  TORCH_CHECK(k.size(0) == q.size(0) && v.sizes() == k.sizes() && q.size(1) % k.size(1) == 0,
              "shapes: q (T, Hq, D), k/v (T, Hkv, D) with Hkv dividing Hq");
  return D;
}

// window: 0 for none, else the left window in logical positions, which the kernels take at head
// dims 128 and 256
void check_window(int64_t window, int64_t D) {
  TORCH_CHECK(window >= 0 && window < (int64_t(1) << 30), "window must be 0 (none) or a positive int32, got ", window);
  TORCH_CHECK(window == 0 || D == 128 || D == 256, "the native kernels take a window at head dims 128 and 256, got ", D);
}

void dkdv_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& items, const at::Tensor& dk,
             const at::Tensor& dv, const at::Tensor& partial_dk, const at::Tensor& partial_dv, const at::Tensor& dq_acc,
             double sm_scale, int64_t window, const at::Tensor& positions) {
  const int64_t D = checked_head_dim(q, k, v, "dK/dV pass");
  check_window(window, D);
  TORCH_CHECK(positions.is_cuda() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == q.size(0) && positions.is_contiguous(),
              "positions must be a contiguous CUDA (T,) int64 tensor");
  check_heads(dout, "dout", D);
  check_heads(dk, "dk", D);
  check_heads(dv, "dv", D);
  for (const auto* t : {&lse, &delta, &partial_dk, &partial_dv, &dq_acc}) check_fp32(*t, "lse, delta, partials and dq_acc");
  check_dtype(q, {&k, &v, &dout, &dk, &dv}, "q, k, v, dout, dk, dv");
  check_table(items, "items");
  const int T = q.size(0), Hq = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(dout.sizes() == q.sizes() && dq_acc.sizes() == q.sizes() && lse.numel() == int64_t(Hq) * T &&
                  delta.numel() == lse.numel(),
              "dout and dq_acc (T, Hq, D), lse and delta (Hq, T)");

  const c10::cuda::CUDAGuard guard(q.device());
  dualkv_sm90::DkdvArgs a{};
  a.qkv = qkv_of(q, k, v);
  a.head_dim = D;
  a.dout = dout.data_ptr();
  a.do_stride_t = dout.stride(0), a.do_stride_h = dout.stride(1);
  a.lse = lse.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  a.items = items.data_ptr<int32_t>();
  a.n_items = items.size(0);
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.dk_stride_t = dk.stride(0), a.dk_stride_h = dk.stride(1);
  a.dv_stride_t = dv.stride(0), a.dv_stride_h = dv.stride(1);
  a.partial_dk = partial_dk.data_ptr<float>();
  a.partial_dv = partial_dv.data_ptr<float>();
  a.dq_acc = dq_acc.data_ptr<float>();
  a.T = T, a.num_heads = Hq, a.num_kv_heads = Hkv;
  a.sm_scale = sm_scale;
  a.fp16 = q.scalar_type() == at::kHalf;
  a.window = int(window);
  a.positions = positions.data_ptr<int64_t>();
  (D == 128 ? dualkv_sm90::dkdv_dq : dualkv_sm90::dkdv_dq_cols)(a, c10::cuda::getCurrentCUDAStream().stream());
}

// pieces: nullptr for single-range tiles (n, 5), else the (m, 3) piece table that multi-range tiles (n, 6) index
void run_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tiles,
             const at::Tensor* pieces, const at::Tensor& out, const at::Tensor& lse, double sm_scale, int64_t window) {
  const int64_t D = checked_head_dim(q, k, v, "forward");
  check_window(window, D);
  check_heads(out, "out", D);
  check_fp32(lse, "lse");
  check_dtype(q, {&k, &v, &out}, "q, k, v, out");
  check_table(tiles, "tiles", pieces ? 6 : 5);
  if (pieces) {
    check_table(*pieces, "pieces", 3);
    // (an empty table has no data pointer, which the kernels take for single-range tiles)
    TORCH_CHECK(pieces->size(0) > 0, "pieces must hold the rows that the multi-range tiles index, got none");
  }
  const int T = q.size(0), Hq = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes() && lse.numel() == int64_t(Hq) * T, "shapes: out (T, Hq, D), lse (Hq, T)");

  const c10::cuda::CUDAGuard guard(q.device());
  dualkv_sm90::FwdArgs a{};
  a.qkv = qkv_of(q, k, v);
  a.head_dim = D;
  a.tiles = tiles.data_ptr<int32_t>();
  a.n_tiles = tiles.size(0);
  a.pieces = pieces ? pieces->data_ptr<int32_t>() : nullptr;
  a.out = out.data_ptr();
  a.out_stride_t = out.stride(0), a.out_stride_h = out.stride(1);
  a.lse = lse.data_ptr<float>();
  a.T = T, a.num_heads = Hq, a.num_kv_heads = Hkv;
  a.sm_scale = sm_scale;
  a.fp16 = q.scalar_type() == at::kHalf;
  a.window = int(window);
  dualkv_sm90::fwd(a, c10::cuda::getCurrentCUDAStream().stream());
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tiles, const at::Tensor& out,
         const at::Tensor& lse, double sm_scale, int64_t window) {
  run_fwd(q, k, v, tiles, nullptr, out, lse, sm_scale, window);
}

void fwd_pieces(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tiles,
                const at::Tensor& pieces, const at::Tensor& out, const at::Tensor& lse, double sm_scale, int64_t window) {
  run_fwd(q, k, v, tiles, &pieces, out, lse, sm_scale, window);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &fwd, "DualKV forward, head dim 128, 256 or 512 (a window: 128, 256), sm_90a");
  m.def("fwd_pieces", &fwd_pieces, "DualKV forward on multi-range tiles (prefix trees) and their piece table");
  m.def("dkdv_dq", &dkdv_dq, "DualKV dK/dV pass with fused dQ, head dim 128, 256 or 512 (a window: 128, 256), sm_90a");
}
