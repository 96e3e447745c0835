// Decode-sized float32 matmul x [M, K] @ W.T for a weight packed once into blocks of 64 output columns.
//
// A decode step or a block verify multiplies 1-16 rows by every weight of the model, so it is a stream through
// memory: what counts is reading each weight once, sequentially, at full bandwidth. oneDNN's packed matmul reaches
// ~20 GB/s at those row counts on a 2-core AVX-512 machine whose memory streams at ~32; this reaches ~30
// (docs/performance.md). With more rows, a tile of 6 rows × 64 columns keeps its 24 accumulators in registers
// and feeds them from 4 weight loads per k (270-340 GFLOP/s on 2 AVX-512 cores with the weights in cache).
// Written with GCC vector extensions and built with -march=native, so the same source runs on AVX-512, AVX2 or
// NEON. Every output is one chain of fused multiply-adds over k in order, starting
// from zero, whatever the row count and blocking: a row's result does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;       // floats per vector value (one zmm, two ymm or four NEON registers)
constexpr int64_t kCols = 4 * kLanes;  // output columns per packed block
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float uvec __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float)), may_alias));

// Rows m..m+MB of x against NB packed blocks starting at wb (each [K, kCols]) → out[m.., n..]. Accumulators and
// weights are whole vector values indexed by constants once the loops unroll, so they live in registers: no
// address of them may escape (a memcpy would spill every one to the stack each k).
template <int MB, int NB>
inline void tile(const float* __restrict wb, const float* __restrict x, float* __restrict out, int64_t K,
                 int64_t N, int64_t n, int64_t m) {
  vec acc[4 * NB][MB];
#pragma GCC unroll 64
  for (int a = 0; a < 4 * NB; ++a)
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) acc[a][b] = vec{};
  const float* xm = x + m * K;
  for (int64_t k = 0; k < K; ++k) {
    vec w[4 * NB];
#pragma GCC unroll 16
    for (int c = 0; c < NB; ++c) {
      const float* wk = wb + (c * K + k) * kCols;
      // all four lines of the k-row 16 ahead: with only the hardware's prefetch, 4-8 rows streamed at 16-20 GB/s
#pragma GCC unroll 4
      for (int a = 0; a < 4; ++a) __builtin_prefetch(wk + 16 * kCols + a * kLanes);
#pragma GCC unroll 4
      for (int a = 0; a < 4; ++a) w[c * 4 + a] = *reinterpret_cast<const uvec*>(wk + a * kLanes);
    }
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) {
      const float xb = xm[b * K + k];
#pragma GCC unroll 64
      for (int a = 0; a < 4 * NB; ++a) acc[a][b] += w[a] * xb;
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < MB; ++b)
#pragma GCC unroll 64
    for (int a = 0; a < 4 * NB; ++a) {
      const int64_t col = n + a * kLanes, left = std::min<int64_t>(N - col, kLanes);
      float* o = out + (m + b) * N + col;
      if (left == kLanes) {
        *reinterpret_cast<uvec*>(o) = acc[a][b];
      } else if (left > 0) {
        float part[kLanes];
        *reinterpret_cast<uvec*>(part) = acc[a][b];
        std::memcpy(o, part, left * sizeof(float));
      }
    }
}

// All M rows against NB blocks: six rows at a time, then the rest.
template <int NB>
void rows(const float* wb, const float* x, float* out, int64_t K, int64_t N, int64_t M, int64_t n) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile<6, NB>(wb, x, out, K, N, n, m);
  switch (M - m) {
    case 5: tile<5, NB>(wb, x, out, K, N, n, m); break;
    case 4: tile<4, NB>(wb, x, out, K, N, n, m); break;
    case 3: tile<3, NB>(wb, x, out, K, N, n, m); break;
    case 2: tile<2, NB>(wb, x, out, K, N, n, m); break;
    case 1: tile<1, NB>(wb, x, out, K, N, n, m); break;
  }
}

torch::Tensor matvec(const torch::Tensor& x_in, const torch::Tensor& wp, int64_t n_out) {
  TORCH_CHECK(x_in.dim() == 2 && wp.dim() == 3 && wp.size(2) == kCols && x_in.size(1) == wp.size(1),
              "matvec: x [M, K] and a packed weight [blocks, K, 64] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && wp.is_contiguous(),
              "matvec: float32 only");
  TORCH_CHECK(n_out > (wp.size(0) - 1) * kCols && n_out <= wp.size(0) * kCols, "matvec: n_out does not fit the blocks");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0);
  auto out = torch::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M <= 2) {  // memory-bound: two blocks per pass give eight independent chains to hide FMA latency
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t b = 2 * p0; b < std::min(2 * p1, blocks); b += 2) {
        if (b + 1 < blocks) rows<2>(w + b * K * kCols, xp, op, K, n_out, M, b * kCols);
        else rows<1>(w + b * K * kCols, xp, op, K, n_out, M, b * kCols);
      }
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) rows<1>(w + b * K * kCols, xp, op, K, n_out, M, b * kCols);
    });
  }
  return out;
}

// w [N, K] → [ceil(N / 64), K, 64], zero past N: each block's columns for one k are 256 contiguous bytes.
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: a float32 [N, K] weight expected");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kCols - 1) / kCols;
  auto padded = torch::zeros({blocks * kCols, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, kCols, K}).transpose(1, 2).contiguous();
}

}  // namespace

TORCH_LIBRARY(flashdraft, m) {
  m.def("matvec(Tensor x, Tensor w, int n_out) -> Tensor", &matvec);
  m.def("matvec_pack(Tensor w) -> Tensor", &pack);
}
