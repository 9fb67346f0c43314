// Fused CPU kernels for the decode step's small elementwise work (fp32, contiguous rows).
//
// At decode sizes (1-100 rows of 256) each eager op costs a few microseconds of dispatch, and
// F.rms_norm alone is 6-8 of them (~10-20 us); these do the same arithmetic in one call.
// Torch references and the dispatch rule: kernels/cpu_fused.py. Built on first use by
// torch.utils.cpp_extension (cached); where it cannot be built, the references run.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * x / rms(x) over the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head RMS norm of q and k, then RoPE");
}
