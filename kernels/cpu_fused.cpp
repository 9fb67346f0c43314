// Fused CPU kernels for the decode step's small elementwise work and its row argmax (fp32,
// contiguous rows).
//
// At decode sizes (1-100 rows of 256) each eager op costs a few microseconds of dispatch, and
// F.rms_norm alone is 6-8 of them (~10-20 us); these do the same arithmetic in one call.
// Torch references and the dispatch rule: kernels/cpu_fused.py. Built on first use by
// torch.utils.cpp_extension (cached); where it cannot be built, the references run.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// out[i] = w[i] * (x[i] * rsqrt(mean(x^2) + eps)), as transformers' Qwen3RMSNorm (fp32)
inline void rms_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
  const float r = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

typedef float floats16 __attribute__((vector_size(64)));
typedef int32_t ints16 __attribute__((vector_size(64)));

// The first index of the row's maximum, or of its first NaN. One pass keeps 16 running maxima and
// their first indices in vectors (compare and select; GCC's vector extensions, as plain loops do
// not vectorize without -ffast-math), built for AVX-512, AVX2 and baseline x86-64 and picked by
// the CPU at load (the build itself is generic).
__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t argmax_row(const float* row, int64_t V) {
  const auto first_nan = [&] { return std::find_if(row, row + V, [](float v) { return v != v; }) - row; };
  int64_t i = 0, first = 0;
  if (V >= 16) {
    floats16 best, v;
    ints16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, index = at, nan = {};
    std::memcpy(&best, row, sizeof best);
    nan |= best != best;
    for (i = 16; i + 16 <= V; i += 16) {
      std::memcpy(&v, row + i, sizeof v);
      index += 16;
      const ints16 more = v > best;  // strictly: a lane keeps its first maximum
      best = more ? v : best;
      at = more ? index : at;
      nan |= v != v;
    }
    int lane = 0, any_nan = 0;
    for (int j = 0; j < 16; ++j) {
      any_nan |= nan[j];
      if (best[j] > best[lane] || (best[j] == best[lane] && at[j] < at[lane])) lane = j;
    }
    if (any_nan) return first_nan();
    first = at[lane];
  }
  for (; i < V; ++i) {  // the tail (or a row under 16 wide): later indices, so only a larger value wins
    if (row[i] != row[i]) return first_nan();
    if (row[i] > row[first]) first = i;
  }
  return first;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
              name, ": expected a contiguous float32 CPU tensor");
}

}  // namespace

// x [N, d], w [d] -> [N, d]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(w, "w");
  const int64_t d = x.size(-1), n = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "w: expected ", d, " elements, got ", w.numel());
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// x, delta [N, d], w [d] -> (x + delta, w * norm(x + delta)): a residual add and the next norm
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_rows(w, "w");
  TORCH_CHECK(x.sizes() == delta.sizes(), "delta: expected the shape of x");
  const int64_t d = x.size(-1), n = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "w: expected ", d, " elements, got ", w.numel());
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* row = sp + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = xp[r * d + i] + dp[r * d + i];
      rms_row(row, wp, op + r * d, d, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

// qkv [T, A, D] (A >= heads: query heads, key heads, then value heads), w [heads, D],
// cos, sin_signed [T, D] -> [T, heads, D]: each of the first `heads` heads RMS-normed with its
// weight row, then rotated: y * cos + roll(y, D/2) * sin_signed (cpu_fused.qk_norm_rope_reference)
torch::Tensor qk_norm_rope(const torch::Tensor& qkv, const torch::Tensor& w, const torch::Tensor& cos,
                           const torch::Tensor& sin, double eps) {
  for (auto [t, name] : {std::pair{&qkv, "qkv"}, {&w, "w"}, {&cos, "cos"}, {&sin, "sin"}}) check_rows(*t, name);
  const int64_t T = qkv.size(0), A = qkv.size(1), D = qkv.size(2), heads = w.size(0), half = D / 2;
  TORCH_CHECK(heads <= A && w.size(1) == D && D % 2 == 0, "w: expected [heads <= ", A, ", ", D, "]");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos, sin: expected [", T, ", ", D, "]");
  auto out = torch::empty({T, heads, D}, qkv.options());
  const float *qp = qkv.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> y(D);
    for (int64_t t = lo; t < hi; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        rms_row(qp + (t * A + h) * D, wp + h * D, y.data(), D, static_cast<float>(eps));
        float* o = op + (t * heads + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = y[i] * c[i] + y[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < D; ++i) o[i] = y[i] * c[i] + y[i - half] * s[i];
      }
    }
  });
  return out;
}

// x [..., V] -> [...] int64: the first index of each row's maximum, or of its first NaN (as
// torch.argmax, which is ~3.6 us per 2048-wide row here: a verify's 96 rows took 350 us)
torch::Tensor argmax(const torch::Tensor& x) {
  check_rows(x, "x");
  const int64_t V = x.size(-1), n = V ? x.numel() / V : 0;
  TORCH_CHECK(V > 0, "x: expected rows of 1+ values");
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      op[r] = argmax_row(xp + r * V, V);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * x / rms(x) over the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head RMS norm of q and k, then RoPE");
  m.def("argmax", &argmax, "first index of each row's maximum (or first NaN), as torch.argmax");
}
