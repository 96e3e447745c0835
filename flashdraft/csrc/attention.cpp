// Decode-sized attention over a ragged batch: every row attends to its own committed positions, and inside its
// block to what its chain or tree lets each query see.
//
// torch's SDPA takes the batch padded to its longest row under an additive mask [N, 1, W, keys]: every row pays for
// the longest one, and the mask is built and read each layer. Here row n reads exactly lens[n] + W keys, each
// once for all the queries of its group of heads (grouped-query attention), 16 keys at a time. Work is split over
// (row, kv head) pairs only, and every sum runs in an order fixed by the key's position alone (a key's dot, the
// softmax's lanes, Σ p·v in key order): a query's output does not depend on the other rows, the block width or the
// number of threads, so a verify attends bit for bit as the plain steps it replaces. float32, or bfloat16 read into
// float32 lanes (the scores, softmax and sums in float32, the output rounded once, as SDPA's CPU kernel does); any
// strides with a contiguous last dim that is a multiple of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Explicit 16-float vectors (GCC vector extensions, built -march=native): the compiler's own vectorisation of a loop
// depends on its length and the pointers' alignment, which would let a query's bits depend on the block around it.
constexpr int64_t kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vec splat(float c) { return vec{c, c, c, c, c, c, c, c, c, c, c, c, c, c, c, c}; }  // one broadcast

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

// 16 bfloat16 as float32: each is the high half of its float's bits.
inline vec load(const at::BFloat16* p) {
  typedef uint16_t hvec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  hvec h;
  std::memcpy(&h, p, sizeof(hvec));
  ivec bits = __builtin_convertvector(h, ivec) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof(vec));
  return v;
}

// The 16 lanes summed as a fixed tree (halves, quarters, ...): four shuffles, the same order for every dot.
inline float hsum(vec v) {
  v += __builtin_shuffle(v, ivec{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, ivec{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, ivec{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, ivec{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }

// Lanes l and l + h of each group of 2h lanes (one key each) of a and b summed into groups of h, a's and b's groups
// interleaved: one level of `hsum`'s tree for 2·(8 / h) keys at once.
template <int h>
inline vec fold(vec a, vec b) {
  ivec lo, hi;
  for (int l = 0; l < kLanes; ++l) {
    const int group = l / h, src = (group % 2) * kLanes + (group / 2) * 2 * h + l % h;
    lo[l] = src;
    hi[l] = src + h;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Sixteen dots' lanes summed at once: lane u of the result is hsum(a[u]) bit for bit (the same pairs in the same
// tree), in 15 two-vector folds instead of 64 one-vector shuffles.
inline vec hsum16(const vec* a) {
  vec x[8], y[4], z[2];
  for (int k = 0; k < 8; ++k) x[k] = fold<8>(a[k], a[k + 8]);  // x[k]: keys k, k + 8
  for (int k = 0; k < 4; ++k) y[k] = fold<4>(x[k], x[k + 4]);  // y[k]: keys k, k + 4, k + 8, k + 12
  for (int k = 0; k < 2; ++k) z[k] = fold<2>(y[k], y[k + 2]);  // z[k]: keys k, k + 2, ..., k + 14
  return fold<1>(z[0], z[1]);                                  // keys 0 .. 15 in order
}

// Up to 16 cache rows (stride apart) as float32 rows of D: the rows themselves for float32, else converted into
// buf [16, D] once for all the queries that read them. Rows past m repeat row 0 (scored, never used).
inline void rows_as_float(const float* p, int64_t stride, int64_t m, int64_t, float*, const float** out) {
  for (int64_t u = 0; u < kLanes; ++u) out[u] = p + (u < m ? u : 0) * stride;
}
inline void rows_as_float(const at::BFloat16* p, int64_t stride, int64_t m, int64_t D, float* buf, const float** out) {
  for (int64_t u = 0; u < kLanes; ++u) {
    out[u] = buf + (u < m ? u : 0) * D;
    if (u < m)
      for (int64_t d = 0; d < D; d += kLanes) store(buf + u * D + d, load(p + u * stride + d));
  }
}

// 16 cache rows of D elements into the cache ahead of their use (a hint: past the end it reads nothing).
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t D) {
  for (int64_t u = 0; u < kLanes; ++u)
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + u * stride) + b);
}

// Cephes' expf on 16 lanes (relative error ~1e-7 on [-87, 88]); every lane computes exactly the same way.
inline vec exp16(vec x) {
  x = x < splat(88.3762626647949f) ? x : splat(88.3762626647949f);
  x = x > splat(-87.3365447505531f) ? x : splat(-87.3365447505531f);
  vec fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vec t = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);  // truncation, then floor
  fx = t > fx ? t - splat(1.f) : t;
  x = x - fx * splat(0.693359375f) - fx * splat(-2.12194440e-4f);
  vec y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * (x * x) + x + splat(1.f);
  ivec bits = (__builtin_convertvector(fx, ivec) + 127) << 23;  // 2^fx
  vec scale;
  std::memcpy(&scale, &bits, sizeof(vec));
  return y * scale;
}

// q [N, H, W, D] (rotated queries), keys / values [N, KVH, P, D] with P >= lens[n] + W (row n's block at
// lens[n] .. lens[n] + W - 1), lens [N] int64, see [N, W, W] bool (query j sees block key m) → out [N, W, H, D].
template <typename T>
torch::Tensor ragged_attention_of(const torch::Tensor& q_in, const torch::Tensor& keys, const torch::Tensor& values,
                                  const torch::Tensor& lens_in, const torch::Tensor& see_in, double scale) {
  const auto q = q_in.to(at::kFloat);  // the queries once in float32 (a copy only for bfloat16)
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "ragged_attention: 4-d q, keys, values");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "ragged_attention: the head dimension must be contiguous");
  const int64_t N = q.size(0), H = q.size(1), W = q.size(2), D = q.size(3), KVH = keys.size(1), P = keys.size(2);
  TORCH_CHECK(keys.size(0) >= N && values.size(0) >= N && H % KVH == 0 && keys.size(3) == D && values.size(3) == D &&
              values.size(1) == KVH && values.size(2) >= P, "ragged_attention: shapes do not match");
  TORCH_CHECK(D % kLanes == 0, "ragged_attention: the head dimension must be a multiple of 16");
  const auto lens = lens_in.to(at::kLong).contiguous();
  const auto see = see_in.to(at::kBool).contiguous();
  TORCH_CHECK(lens.numel() == N && see.numel() == N * W * W, "ragged_attention: lens [N], see [N, W, W]");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(lp[n] >= 0 && lp[n] + W <= P, "ragged_attention: a row's keys run past the cache");
  const bool* sp = see.data_ptr<bool>();
  auto out = torch::empty({N, W, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH, Q = G * W;  // queries per (row, kv head): query i is head g·G + i / W at block j = i % W
  const float fscale = static_cast<float>(scale), ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N * KVH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores, acc(Q * D), total(Q), buf(kLanes * D);
    std::vector<const float*> qrow(Q);
    const float* r16[kLanes];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b / KVH, g = b % KVH, len = lp[n], L = len + W;
      const T* kb = kp + n * keys.stride(0) + g * keys.stride(1);
      const T* vb = vp + n * values.stride(0) + g * values.stride(1);
      const int64_t ks = keys.stride(2), vs = values.stride(2);
      for (int64_t i = 0; i < Q; ++i) qrow[i] = qp + n * q.stride(0) + (g * G + i / W) * q.stride(1) + i % W * q.stride(2);
      const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes;  // each query's scores padded to whole vectors
      scores.assign(Q * Lp, ninf);  // [Q, Lp]; a key a query may not see stays -inf
      for (int64_t t0 = 0; t0 < L; t0 += kLanes) {  // 16 key rows read once for all the queries of the group
        const int64_t m = std::min(kLanes, L - t0);
        rows_as_float(kb + t0 * ks, ks, m, D, buf.data(), r16);
        prefetch_rows(kb + (t0 + 2 * kLanes) * ks, ks, D);
        for (int64_t i = 0; i < Q; ++i) {
          vec a[kLanes] = {};
          for (int64_t d = 0; d < D; d += kLanes) {
            const vec x = load(qrow[i] + d);
            for (int64_t u = 0; u < kLanes; ++u) a[u] += x * load(r16[u] + d);
          }
          const vec r = hsum16(a) * splat(fscale);
          float* s = scores.data() + i * Lp + t0;
          if (t0 + kLanes <= len) {
            store(s, r);
          } else {
            const bool* seen = sp + (n * W + i % W) * W;  // seen[c]: query i sees block key len + c
            for (int64_t u = 0; u < m; ++u)
              if (t0 + u < len || seen[t0 + u - len]) s[u] = r[u];
          }
        }
      }
      for (int64_t i = 0; i < Q; ++i) {  // softmax over each query's keys: max, then exp and sum lane by lane
        float* s = scores.data() + i * Lp;
        vec mv = splat(ninf);
        for (int64_t t = 0; t < Lp; t += kLanes) {
          const vec x = load(s + t);
          mv = x > mv ? x : mv;
        }
        float m = ninf;
        for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, mv[l]);
        vec sum = {};
        for (int64_t t = 0; t < Lp; t += kLanes) {
          const vec x = load(s + t), e = exp16(x - splat(m));
          const vec p = x == splat(ninf) ? splat(0.f) : e;  // a masked key weighs exactly nothing
          store(s + t, p);
          sum += p;
        }
        total[i] = hsum(sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += kLanes) {  // Σ p·v in key order, 16 value rows read once for all queries
        const int64_t m = std::min(kLanes, L - t0);
        rows_as_float(vb + t0 * vs, vs, m, D, buf.data(), r16);
        prefetch_rows(vb + (t0 + 2 * kLanes) * vs, vs, D);
        for (int64_t i = 0; i < Q; ++i) {
          const float* p = scores.data() + i * Lp + t0;  // 0 where masked: adds exactly nothing
          float* a = acc.data() + i * D;
          for (int64_t d = 0; d < D; d += kLanes) {
            vec r = load(a + d);
            for (int64_t u = 0; u < m; ++u) r += splat(p[u]) * load(r16[u] + d);
            store(a + d, r);
          }
        }
      }
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t h = g * G + i / W, j = i % W;
        float* o = op + ((n * W + j) * H + h) * D;
        const float inv = 1.f / total[i];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
      }
    }
  });
  return out.to(q_in.scalar_type());
}

torch::Tensor ragged_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& lens, const torch::Tensor& see, double scale) {
  const auto t = keys.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && q.scalar_type() == t && values.scalar_type() == t,
              "ragged_attention: q, keys and values all float32 or all bfloat16");
  return t == at::kFloat ? ragged_attention_of<float>(q, keys, values, lens, see, scale)
                         : ragged_attention_of<at::BFloat16>(q, keys, values, lens, see, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashdraft, m) {
  m.def("ragged_attention(Tensor q, Tensor keys, Tensor values, Tensor lens, Tensor see, float scale) -> Tensor",
        &ragged_attention);
}
