// torch binding of the native Hopper DualKV kernels (csrc/dualkv_bwd_sm90.cu).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "dualkv_sm90.h"

namespace {

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 3 && t.size(2) == 128 && t.stride(2) == 1, name,
              " must be a CUDA (T, H, 128) tensor with unit last stride, got ", t.sizes(), " strides ", t.strides());
}

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous CUDA float32 tensor");
}

void dkdv_dq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
             const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& items, const at::Tensor& dk,
             const at::Tensor& dv, const at::Tensor& partial_dk, const at::Tensor& partial_dv, const at::Tensor& dq_acc,
             double sm_scale) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  check_heads(dout, "dout");
  check_heads(dk, "dk");
  check_heads(dv, "dv");
  for (const auto* t : {&lse, &delta, &partial_dk, &partial_dv, &dq_acc}) check_fp32(*t, "lse, delta, partials and dq_acc");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "q must be bfloat16 or float16, got ", dtype);
  for (const auto* t : {&k, &v, &dout, &dk, &dv}) TORCH_CHECK(t->scalar_type() == dtype, "q, k, v, dout, dk, dv must share one dtype");
  TORCH_CHECK(items.is_cuda() && items.scalar_type() == at::kInt && items.dim() == 2 && items.size(1) == 5 &&
                  items.is_contiguous(), "items must be a contiguous CUDA (n, 5) int32 tensor");
  const int T = q.size(0), Hq = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.sizes() == k.sizes() && dout.sizes() == q.sizes() && Hq % Hkv == 0,
              "shapes: q/dout (T, Hq, 128), k/v (T, Hkv, 128) with Hkv dividing Hq");
  TORCH_CHECK(dq_acc.sizes() == q.sizes() && lse.numel() == int64_t(Hq) * T && delta.numel() == lse.numel(),
              "dq_acc (T, Hq, 128), lse and delta (Hq, T)");

  const c10::cuda::CUDAGuard guard(q.device());
  dualkv_sm90::DkdvArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.dout = dout.data_ptr();
  a.q_stride_t = q.stride(0), a.q_stride_h = q.stride(1);
  a.k_stride_t = k.stride(0), a.k_stride_h = k.stride(1);
  a.v_stride_t = v.stride(0), a.v_stride_h = v.stride(1);
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
  a.sm_scale = float(sm_scale);
  a.scale_log2 = float(sm_scale * 1.4426950408889634);
  a.fp16 = dtype == at::kHalf;
  dualkv_sm90::dkdv_dq(a, c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dkdv_dq", &dkdv_dq, "DualKV dK/dV pass with fused dQ, head dim 128, sm_90a");
}
