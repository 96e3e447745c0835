// The lean forward's elementwise glue in one pass each: at decode sizes these ops cost their dispatch, not their
// arithmetic (an RMSNorm is six torch ops on a [1, 576] row). float32, contiguous last dimension.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

// transformers' RMSNorm: x * rsqrt(mean(x²) + eps), then times the weight; x [..., H], weight [H].
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const auto x = x_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight does not match the last dimension");
  const auto w = weight.contiguous();
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      float ss = 0.f;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      #pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// silu(gate) * up for gate_up [..., 2I] holding gate then up → [..., I].
torch::Tensor silu_mul(const torch::Tensor& gu_in) {
  TORCH_CHECK(gu_in.scalar_type() == at::kFloat && gu_in.size(-1) % 2 == 0, "silu_mul: float32 [..., 2I] only");
  const auto gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2, rows = gu.numel() / (2 * I);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* o = op + r * I;
      #pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdraft, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
