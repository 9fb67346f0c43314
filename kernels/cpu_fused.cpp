// Fused CPU kernels for the decode step's small elementwise work, its row argmax and its
// attention over the KV store's rows (fp32, contiguous).
//
// At decode sizes (1-100 rows of 256) each eager op costs a few microseconds of dispatch, and
// F.rms_norm alone is 6-8 of them (~10-20 us); these do the same arithmetic in one call. The
// attention reads each sequence's K/V rows where the store keeps them: no gathered copy.
// Torch references and the dispatch rule: kernels/cpu_fused.py. Built on first use by
// torch.utils.cpp_extension (cached); where it cannot be built, the references run.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
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

// Vectors of N float lanes (16: one AVX-512 register; 8: one AVX2 register; 4: SSE2's)
template <int N>
struct Lanes {
  typedef float floats __attribute__((vector_size(4 * N)));
  typedef int32_t ints __attribute__((vector_size(4 * N)));
};

// The widest register this CPU's builds use, in float lanes: 16 with AVX-512F, 8 with AVX2 and FMA,
// 0 otherwise (the argmax then runs its baseline build, and `paged_attention` is not called:
// cpu_fused.py runs the reference).
int attention_lanes() {
  static const int lanes = __builtin_cpu_supports("avx512f") ? 16
                           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 8 : 0;
  return lanes;
}

// The first index of the row's maximum, or of its first NaN. One pass keeps N running maxima and
// their first indices in vectors (compare and select; GCC's vector extensions, as plain loops do
// not vectorize without -ffast-math), N lanes of one register: a wider vector built for a narrower
// instruction set goes through the stack (3.4x slower than torch.argmax with 16 lanes on AVX2).
template <int N>
__attribute__((always_inline)) inline int64_t argmax_lanes(const float* row, int64_t V) {
  using floats = typename Lanes<N>::floats;
  using ints = typename Lanes<N>::ints;
  const auto first_nan = [&] { return std::find_if(row, row + V, [](float v) { return v != v; }) - row; };
  int64_t i = 0, first = 0;
  if (V >= N) {
    floats best, v;
    ints at, index, nan = {};
    for (int l = 0; l < N; ++l) at[l] = l;
    index = at;
    std::memcpy(&best, row, sizeof best);
    nan |= best != best;
    for (i = N; i + N <= V; i += N) {
      std::memcpy(&v, row + i, sizeof v);
      index += N;
      const ints more = v > best;  // strictly: a lane keeps its first maximum
      best = more ? v : best;
      at = more ? index : at;
      nan |= v != v;
    }
    int lane = 0, any_nan = 0;
    for (int j = 0; j < N; ++j) {
      any_nan |= nan[j];
      if (best[j] > best[lane] || (best[j] == best[lane] && at[j] < at[lane])) lane = j;
    }
    if (any_nan) return first_nan();
    first = at[lane];
  }
  for (; i < V; ++i) {  // the tail (or a row under N wide): later indices, so only a larger value wins
    if (row[i] != row[i]) return first_nan();
    if (row[i] > row[first]) first = i;
  }
  return first;
}
__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* row, int64_t V) { return argmax_lanes<16>(row, V); }
__attribute__((target("avx2,fma"))) int64_t argmax_avx2(const float* row, int64_t V) { return argmax_lanes<8>(row, V); }
int64_t argmax_base(const float* row, int64_t V) { return argmax_lanes<4>(row, V); }

// The row argmax for this CPU's widest registers
int64_t argmax_row(const float* row, int64_t V) {
  static const auto fn = attention_lanes() == 16 ? argmax_avx512 : attention_lanes() == 8 ? argmax_avx2 : argmax_base;
  return fn(row, V);
}

// 64-byte aligned scratch of n vectors of N lanes (std::vector's allocator need not align
// over-aligned types)
template <int N>
struct Vectors {
  using floats = typename Lanes<N>::floats;
  explicit Vectors(int64_t n)
      : data(static_cast<floats*>(std::aligned_alloc(64, (std::max<int64_t>(n, 1) * sizeof(floats) + 63) / 64 * 64))) {}
  ~Vectors() { std::free(data); }
  floats* data;
};
constexpr float NINF = -std::numeric_limits<float>::infinity();

// exp(x) lane-wise (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r; ~1 ulp)
template <int N>
__attribute__((always_inline)) inline typename Lanes<N>::floats exp_lanes(typename Lanes<N>::floats x) {
  using floats = typename Lanes<N>::floats;
  using ints = typename Lanes<N>::ints;
  const floats lo = x < -87.3f ? (floats){} - 87.3f : x;  // exp(-87.3) ~ 1e-38: the normal floor
  const floats t = lo * 1.44269504088896341f;
  const ints n = __builtin_convertvector(t + (t < 0 ? -0.5f : 0.5f), ints);  // round half away
  const floats nf = __builtin_convertvector(n, floats);
  const floats r = lo - nf * 0.693359375f + nf * 2.12194440e-4f;
  floats p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * (floats)((n + 127) << 23);
}

// Attention of up to N query vectors (lanes) of one sequence and KV head over the S rows it may
// read, head_dim D. Lanes hold queries, so a key's scores for all of them are one vector of FMAs
// (no horizontal sums), and the softmax runs lane-wise. qt [D] vectors: the queries transposed
// and scaled (lane l: query l); kv + rows[j] * kv_row: key j (its value v_off further on), at
// position key_pos[j]; lane l sees the keys whose positions lie in [bounds[0][l], bounds[1][l]]
// (a query's window; a padded query's bounds take in every key); probs [S] vectors of scratch;
// seen [S + 4] bytes of scratch; out[l]: lane l's output row.
// Values are accumulated QB lanes x CB vectors (of the row's D / N) per pass; QB * CB and the
// scores' 8 accumulators must stay in registers (32 of AVX-512's, 16 of AVX2's). With N = 16 built
// for AVX2 (two registers a vector) GCC kept them on the stack: 3-4.5x slower than the reference.
template <int N, int D, int QB, int CB>
__attribute__((always_inline)) inline void attend_lanes(const typename Lanes<N>::floats* qt, const float* kv,
                                                        int64_t kv_row, int64_t v_off, const int64_t* rows,
                                                        const int64_t* key_pos, const typename Lanes<N>::floats* bounds,
                                                        int64_t S, typename Lanes<N>::floats* probs, uint8_t* seen,
                                                        int lanes, float* const* out) {
  using floats = typename Lanes<N>::floats;
  constexpr int DC = D / N;  // vectors per value row
  static_assert(DC % CB == 0, "value vectors per pass must divide the row's");
  const floats lo = bounds[0], hi = bounds[1];
  // The extremes over the lanes, read from memory: indexing lo's or hi's lanes makes GCC split them
  // into scalars, and the vector compares below then run one lane at a time.
  const float* lanes_lo = reinterpret_cast<const float*>(bounds);
  const float* lanes_hi = lanes_lo + N;
  const float lowest = *std::min_element(lanes_lo, lanes_lo + N);
  const float highest = *std::max_element(lanes_hi, lanes_hi + N);
  const floats ninf = (floats){} + NINF;
  floats top = ninf;
  for (int64_t j = 0; j < S; j += 4) {  // scores, four keys at a time: probs[j] lane l = q_l . k_j, or -inf unseen
    const int n = static_cast<int>(std::min<int64_t>(4, S - j));
    float pos[4];  // exact: positions are far below 2^24
    bool any = false;
    for (int i = 0; i < 4; ++i) {
      pos[i] = static_cast<float>(key_pos[j + (i < n ? i : 0)]);
      seen[j + i] = i < n && lowest <= pos[i] && pos[i] <= highest;
      any |= seen[j + i];
    }
    if (!any) {
      for (int i = 0; i < n; ++i) probs[j + i] = ninf;
      continue;
    }
    const float* k[4];
    for (int i = 0; i < 4; ++i) k[i] = kv + rows[j + (i < n ? i : 0)] * kv_row;
    if (j + 16 < S) {  // the keys four groups ahead: rows lie scattered over pages, which the hardware
      // prefetchers do not follow (a batch-15 step's 11 calls: 2.96 -> 2.13 ms, bench/step_parts.py)
      for (int i = 0; i < 4; ++i) {
        const float* ahead = kv + rows[std::min<int64_t>(j + 16 + i, S - 1)] * kv_row;
        for (int c = 0; c < D; c += 16) __builtin_prefetch(ahead + c);
      }
    }
    floats even[4] = {}, odd[4] = {};  // two chains per key: an FMA's latency, not its throughput, bounds one
    for (int d = 0; d < D; d += 2) {
      const floats q0 = qt[d], q1 = qt[d + 1];
      for (int i = 0; i < 4; ++i) {
        even[i] += k[i][d] * q0;
        odd[i] += k[i][d + 1] * q1;
      }
    }
    for (int i = 0; i < n; ++i) {
      const floats below = lo - pos[i], above = pos[i] - hi;  // both <= 0: the lane sees the key
      const floats outside = below > above ? below : above;
      const floats s = outside > 0.f ? ninf : even[i] + odd[i];
      probs[j + i] = s;
      top = s > top ? s : top;
    }
  }
  floats total = {};
  for (int64_t j = 0; j < S; ++j) {
    const floats s = probs[j];
    const floats p = s == NINF ? (floats){} : exp_lanes<N>(s - top);
    probs[j] = p;
    total += p;
  }
  const float* lane_probs = reinterpret_cast<const float*>(probs);  // key j, lane l: lane_probs[N j + l]
  for (int l0 = 0; l0 < lanes; l0 += QB) {
    for (int c0 = 0; c0 < DC; c0 += CB) {  // lanes l0.. and value vectors c0.. per pass
      floats acc[QB][CB] = {};
      for (int64_t j = 0; j < S; ++j) {
        if (j + 8 < S) {  // the values eight keys ahead, likewise
          const float* ahead = kv + rows[j + 8] * kv_row + v_off + c0 * N;
          for (int c = 0; c < CB * N; c += 16) __builtin_prefetch(ahead + c);
        }
        if (!seen[j]) continue;
        const float* v = kv + rows[j] * kv_row + v_off + c0 * N;
        const float* p = lane_probs + j * N;
        for (int c = 0; c < CB; ++c) {  // one value vector at a time: an array of them would go through the stack
          floats vc;
          std::memcpy(&vc, v + c * N, sizeof vc);
          for (int l = 0; l < QB; ++l) acc[l][c] += p[(l0 + l) & (N - 1)] * vc;
        }
      }
      for (int l = 0; l < QB && l0 + l < lanes; ++l) {
        const float inv = 1.f / total[l0 + l];
        for (int c = 0; c < CB; ++c) {
          const floats o = acc[l][c] * inv;
          std::memcpy(out[l0 + l] + (c0 + c) * N, &o, sizeof o);
        }
      }
    }
  }
}

// One plain function per instruction set and head_dim, each with its lane width and blocking.
// Vectors go in and out by pointer: each would pass a vector argument its own way (the ABI
// differs between the AVX-512 build and the caller).
template <int N>
using AttendFn = void (*)(const typename Lanes<N>::floats*, const float*, int64_t, int64_t, const int64_t*,
                          const int64_t*, const typename Lanes<N>::floats*, int64_t, typename Lanes<N>::floats*,
                          uint8_t*, int, float* const*);
#define ATTEND(NAME, TARGET, N, D, QB, CB)                                                                   \
  __attribute__((target(TARGET))) void NAME(const Lanes<N>::floats* qt, const float* kv, int64_t kv_row,      \
                                            int64_t v_off, const int64_t* rows, const int64_t* key_pos,       \
                                            const Lanes<N>::floats* bounds, int64_t S, Lanes<N>::floats* probs, \
                                            uint8_t* seen, int lanes, float* const* out) {                    \
    attend_lanes<N, D, QB, CB>(qt, kv, kv_row, v_off, rows, key_pos, bounds, S, probs, seen, lanes, out);     \
  }
// AVX-512, 16 lanes: 8 score and 24 value accumulators of 32 registers
ATTEND(attend64_avx512, "avx512f", 16, 64, 6, 4)
ATTEND(attend128_avx512, "avx512f", 16, 128, 3, 8)
// AVX2 with FMA, 8 lanes: 8 score and 8 value accumulators of 16 registers
ATTEND(attend64_avx2, "avx2,fma", 8, 64, 2, 4)
ATTEND(attend128_avx2, "avx2,fma", 8, 128, 2, 4)
#undef ATTEND


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

// One paged_attention call's operands, for `attend_tiles`.
struct Tiles {
  const float* q;
  int64_t qs0, qs1, qs2;  // q's strides (its rows are contiguous)
  const float* cache;
  const int64_t *rows, *key_pos, *q_pos;
  float* out;
  int64_t B, Q, H, Hkv, D, S, window;
};

// Every (sequence, KV head, tile of N of its Q x G queries) through `attend`, N queries in the lanes.
template <int N>
void attend_tiles(const Tiles& a, AttendFn<N> attend) {
  using floats = typename Lanes<N>::floats;
  const int64_t G = a.H / a.Hkv, QG = a.Q * G, D = a.D, S = a.S, tiles = (QG + N - 1) / N;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, a.B * a.Hkv * tiles, 1, [&](int64_t lo, int64_t hi) {
    Vectors<N> qt_(D), probs_(S), bounds_(2);
    floats *qt = qt_.data, *probs = probs_.data;
    floats* bounds = bounds_.data;  // [0]: each lane's lowest visible position, [1]: its highest
    float* qt_lanes = reinterpret_cast<float*>(qt);
    float* outs[N];
    std::vector<uint8_t> seen(S + 4);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / (a.Hkv * tiles), g = t / tiles % a.Hkv, first = t % tiles * N;
      const int lanes = static_cast<int>(std::min<int64_t>(N, QG - first));
      // lanes past the tile's queries repeat its first (their output is dropped)
      for (int l = 0; l < N; ++l) {
        const int64_t i = first + (l < lanes ? l : 0), qi = i / G, h = g * G + i % G, p = a.q_pos[b * a.Q + qi];
        const float* qv = a.q + b * a.qs0 + qi * a.qs1 + h * a.qs2;
        for (int64_t d = 0; d < D; ++d) qt_lanes[d * N + l] = qv[d] * scale;
        const bool padded = p < 0;
        bounds[0][l] = padded ? NINF : static_cast<float>(std::max<int64_t>(0, a.window ? p - a.window + 1 : 0));
        bounds[1][l] = padded ? -NINF : static_cast<float>(p);
        outs[l] = a.out + ((b * a.Q + qi) * a.H + h) * D;
      }
      attend(qt, a.cache + g * D, 2 * a.Hkv * D, a.Hkv * D, a.rows + b * S, a.key_pos + b * S, bounds, S, probs,
             seen.data(), lanes, outs);
    }
  });
}

// q [B, Q, H, D] (rows of D contiguous), cache [rows, 2, Hkv, D] (K, V), read_rows [B, S] int64,
// key_pos [B, S] int64 (the rows' positions, -1 where not readable), q_pos [B, Q] int64 (-1: padding),
// window (0: none) -> [B, Q, H, D]: softmax(q k^T / sqrt(D)) v over the keys each query sees (a
// position p sees keys at 0 <= p' <= p, and p - p' < window when windowed; a padded query sees
// every key, as attention.visible), the keys and values of sequence b being cache rows
// read_rows[b] (kernels/attention.py `attend` over the gathered rows; query head h reads KV head
// h / (H / Hkv)). D is 64 or 128. Visibility comes from positions, so no mask is built or read.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& read_rows,
                              const torch::Tensor& key_pos, const torch::Tensor& q_pos, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat && q.stride(-1) == 1,
              "q: expected a float32 CPU tensor with contiguous rows");
  check_rows(cache, "cache");
  TORCH_CHECK(q.dim() == 4 && cache.dim() == 4 && cache.size(1) == 2 && cache.size(3) == q.size(3),
              "q [B, Q, H, D], cache [rows, 2, Hkv, D]: shapes do not match");
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Hkv = cache.size(2), S = read_rows.size(1);
  TORCH_CHECK(D == 64 || D == 128, "q: head_dim 64 or 128, got ", D);
  TORCH_CHECK(H % Hkv == 0, "q: ", H, " heads do not share ", Hkv, " KV heads");
  for (auto [t, name, n] : {std::tuple{&read_rows, "read_rows", S}, {&key_pos, "key_pos", S}, {&q_pos, "q_pos", Q}})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kLong && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == B && t->size(1) == n, name, ": expected contiguous int64 [", B, ", ", n, "]");
  TORCH_CHECK(window >= 0, "window: expected 0 (none) or a positive width, got ", window);
  const int64_t *rp = read_rows.data_ptr<int64_t>(), *kp = key_pos.data_ptr<int64_t>(), *pp = q_pos.data_ptr<int64_t>();
  const int64_t cache_rows = cache.size(0);
  TORCH_CHECK(std::all_of(rp, rp + B * S, [&](int64_t r) { return 0 <= r && r < cache_rows; }),
              "read_rows: a row outside the cache");
  const int N = attention_lanes();
  TORCH_CHECK(N, "paged_attention needs AVX2 with FMA or AVX-512F (cpu_fused.py runs the reference elsewhere)");
  auto out = torch::empty({B, Q, H, D}, q.options());
  const Tiles tiles{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), cache.data_ptr<float>(), rp, kp, pp,
                    out.data_ptr<float>(), B, Q, H, Hkv, D, S, window};
  if (N == 16)
    attend_tiles<16>(tiles, D == 64 ? attend64_avx512 : attend128_avx512);
  else
    attend_tiles<8>(tiles, D == 64 ? attend64_avx2 : attend128_avx2);
  return out;
}

// A decoder layer up to its attention, in one call: x [T, d] -> (q [T, H, D], kv [T, 2, Hkv, D]).
// The input norm (norm_w [d]), the fused QKV projection over its weight stored transposed
// (qkv_wt [d, (H + 2 Hkv) D], as `Linear.pack("blas")` keeps it), the q/k norms and RoPE
// (qk_norm_rope: qk_w [H + Hkv, D], cos, sin [T, D]); kv holds each token's K (normed and
// rotated) then V, as the KV store keeps them. The same ops, in the same order, as the layer's
// Python path (shared/model/layers.py): the results are bitwise those.
std::tuple<torch::Tensor, torch::Tensor> attention_input(const torch::Tensor& x, const torch::Tensor& norm_w,
                                                         double norm_eps, const torch::Tensor& qkv_wt,
                                                         const torch::Tensor& qk_w, const torch::Tensor& cos,
                                                         const torch::Tensor& sin, double qk_eps, int64_t kv_heads) {
  check_rows(qkv_wt, "qkv_wt");
  const int64_t T = x.size(0), D = qk_w.size(1), heads = qk_w.size(0) - kv_heads;
  TORCH_CHECK(kv_heads > 0 && heads > 0 && qkv_wt.size(1) == (heads + 2 * kv_heads) * D,
              "qkv_wt: expected [d, (heads + 2 kv_heads) head_dim]");
  auto qkv = at::mm(rms_norm(x, norm_w, norm_eps), qkv_wt).view({T, heads + 2 * kv_heads, D});
  auto qk = qk_norm_rope(qkv, qk_w, cos, sin, qk_eps);  // [T, H + Hkv, D]
  auto kv = torch::empty({T, 2, kv_heads, D}, x.options());
  const int64_t span = kv_heads * D;  // one token's K (or V) heads
  const float *kp = qk.data_ptr<float>() + heads * D, *vp = qkv.data_ptr<float>() + (heads + kv_heads) * D;
  float* out = kv.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(out + 2 * t * span, kp + t * (heads + kv_heads) * D, span * sizeof(float));
    std::memcpy(out + (2 * t + 1) * span, vp + t * (heads + 2 * kv_heads) * D, span * sizeof(float));
  }
  return {qk.slice(1, 0, heads), kv};
}

// The rest of a decoder layer, in one call: x [T, d], attention's output [T, H, D] ->
// x + o_proj(attention), then + the SwiGLU MLP of that sum's norm (post_w [d]). Weights stored
// transposed: o_wt [H D, d], gate_up_wt [d, 2 I] (gate, then up), down_wt [I, d]. The same ops,
// in the same order, as the layer's Python path: bitwise its results.
torch::Tensor attention_output_mlp(const torch::Tensor& x, const torch::Tensor& attention, const torch::Tensor& o_wt,
                                   const torch::Tensor& post_w, double eps, const torch::Tensor& gate_up_wt,
                                   const torch::Tensor& down_wt) {
  for (auto [t, name] : {std::pair{&o_wt, "o_wt"}, {&gate_up_wt, "gate_up_wt"}, {&down_wt, "down_wt"}}) check_rows(*t, name);
  const int64_t I = down_wt.size(0);
  TORCH_CHECK(gate_up_wt.size(1) == 2 * I, "gate_up_wt: expected [d, 2 * ", I, "]");
  auto [sum, normed] = add_rms_norm(x, at::mm(attention.flatten(1), o_wt), post_w, eps);
  auto gate_up = at::mm(normed, gate_up_wt);  // [T, 2I]
  return at::add(sum, at::mm(at::mul(at::silu(gate_up.slice(1, 0, I)), gate_up.slice(1, I)), down_wt));
}

// Each op runs without the GIL (it touches no Python object): the service's event loop thread
// answers, streams and receives while the engine thread is inside a layer.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm, "w * x / rms(x) over the last dimension", no_gil());
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))", no_gil());
  m.def("qk_norm_rope", &qk_norm_rope, "per-head RMS norm of q and k, then RoPE", no_gil());
  m.def("argmax", &argmax, "first index of each row's maximum (or first NaN), as torch.argmax", no_gil());
  m.def("paged_attention", &paged_attention, "attention of each sequence's queries over its cache rows", no_gil());
  m.def("attention_input", &attention_input, "a decoder layer's input norm, QKV projection, q/k norms and RoPE", no_gil());
  m.def("attention_output_mlp", &attention_output_mlp, "a decoder layer's output projection, residual, norm and MLP", no_gil());
  m.def("attention_lanes", &attention_lanes, "queries per vector in paged_attention on this CPU (0: it does not run)");
}
