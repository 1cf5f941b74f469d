// Greedy selection's argmax over a step's logits, on the CPU (specserve::argmax_rows): torch's
// CPU argmax over the vocabulary reads a [rows, 151936] float32 block at a few GB/s (1.6 ms for
// the 9 rows of an 8-node tree here, 66 ms for 576 rows); this one streams it, a row a
// thread at a time, with AVX2. Same result as torch.argmax(x, -1): the first index of the
// largest value, or of the first NaN where a row holds one. specserve::greedy_rows is the
// same scan with the logits' finite check in it: -1 for a row holding a NaN or an inf.
//
// Sampling's two passes over the vocabulary, likewise streamed (rejection.py):
// specserve::softmax_weights, the target's weights exp(x / T - max) of chosen rows at their
// own temperatures, unnormalised, with their sums (a row's sum in float lanes a chunk, the
// chunks in double); specserve::draw_rows, a token from each row of weights by inverse CDF.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "simd_exp.h"

namespace {

// finite_only: -1 where the row holds a NaN or an inf (|v| not below inf, unordered
// included), else its argmax.
int64_t argmax_row(const float* p, int64_t n, bool finite_only) {
  const float inf = std::numeric_limits<float>::infinity();
  const __m256 sign = _mm256_set1_ps(-0.f), infs = _mm256_set1_ps(inf);
  __m256 best = _mm256_set1_ps(-inf);
  __m256 nan = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    best = _mm256_max_ps(best, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (finite_only)
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), infs, _CMP_NLT_UQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = lanes[0];
  for (int k = 1; k < 8; ++k) top = std::max(top, lanes[k]);
  bool has_nan = _mm256_movemask_ps(nan) != 0, has_bad = _mm256_movemask_ps(bad) != 0;
  for (int64_t j = i; j < n; ++j) {
    has_nan = has_nan || std::isnan(p[j]);
    has_bad = has_bad || !std::isfinite(p[j]);
    top = std::max(top, p[j]);
  }
  if (finite_only && has_bad) return -1;
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(p[j])) return j;
  }
  const __m256 t = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), t, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (p[i] == top) return i;
  return 0;  // (unreachable: top is one of the row's values)
}

// x [R, V] float32 (rows may be strided, elements contiguous) -> [R] int64.
at::Tensor rows_of(const at::Tensor& x, bool finite_only) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows, greedy_rows: x must be float32 [R, V > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * stride, n, finite_only);
  });
  return out;
}

constexpr int64_t kChunk = 2048;  // values whose float sum is taken before it joins a double

// The 8 lanes of a float sum, added in double.
inline double lane_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  double s = 0.0;
  for (float l : lanes) s += l;
  return s;
}

float max_of(const float* p, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(p + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) top = std::max(top, p[i]);
  return top;
}

// w = exp(x / t - max(x / t)) (0 where x / t lies more than 87.3 below the maximum, -inf
// included); returns the sum of w. A row whose maximum is -inf gets zeros.
double softmax_row(const float* x, float t, int64_t n, float* w) {
  const float top = max_of(x, n) / t;  // (x -> x / t keeps the order: t > 0)
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(w, w + n, 0.f);
    return 0.0;
  }
  const __m256 ts = _mm256_set1_ps(t), m = _mm256_set1_ps(top), lo = _mm256_set1_ps(-87.3f);
  double total = 0.0;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t end = std::min(n, c + kChunk);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = c;
    for (; i + 8 <= end; i += 8) {
      const __m256 v = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), ts), m);
      const __m256 e = _mm256_and_ps(specserve_simd::exp8(v), _mm256_cmp_ps(v, lo, _CMP_GE_OQ));
      _mm256_storeu_ps(w + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    double chunk = lane_sum(sum);
    for (; i < end; ++i) {
      const float v = x[i] / t - top;
      w[i] = v >= -87.3f ? std::exp(v) : 0.f;
      chunk += w[i];
    }
    total += chunk;
  }
  return total;
}

// x [R, V] float32 (rows contiguous), rows [P] int64 into x, temperature [P] float32 (> 0)
// -> (weights [P, V], sums [P]) of softmax_row.
std::tuple<at::Tensor, at::Tensor> softmax_weights(const at::Tensor& x, const at::Tensor& rows,
                                                   const at::Tensor& temperature) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "softmax_weights: x must be float32 [R, V] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && temperature.dim() == 1 &&
                  temperature.scalar_type() == at::kFloat && temperature.size(0) == rows.size(0),
              "softmax_weights: rows must be int64 [P] and temperature float32 [P]");
  const int64_t count = rows.size(0), n = x.size(1), stride = x.stride(0);
  const at::Tensor rc = rows.contiguous(), tc = temperature.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const float* tp = tc.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0) && tp[i] > 0.f,
                "softmax_weights: row ", rp[i], " or temperature ", tp[i], " out of range");
  at::Tensor w = at::empty({count, n}, x.options());
  at::Tensor sums = at::empty({count}, x.options());
  const float* xp = x.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      sp[i] = static_cast<float>(softmax_row(xp + rp[i] * stride, tp[i], n, wp + i * n));
  });
  return {w, sums};
}

// One token of a row of non-negative weights, u uniform in [0, 1): the first whose cumulative
// weight exceeds u * total, found by chunk sums and then a scan of one chunk. Never a token of
// weight 0: where rounding leaves no crossing in the chunk, the chunk's last token with weight;
// where u * total reaches the total, the row's. A row of zeros gives 0 (as torch's
// inverse_cdf does).
int64_t draw_row(const float* w, int64_t n, double u) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> sums(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = c * kChunk;
    for (; i + 8 <= end; i += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(w + i));
    double s = lane_sum(sum);
    for (; i < end; ++i) s += w[i];
    sums[c] = s;
    total += s;
  }
  const auto last_weighted = [&](int64_t from, int64_t to) -> int64_t {
    for (int64_t j = to - 1; j >= from; --j)
      if (w[j] > 0.f) return j;
    return -1;
  };
  if (!(total > 0.0)) return 0;
  double target = u * total;
  for (int64_t c = 0; c < chunks; ++c) {
    if (target >= sums[c]) {
      target -= sums[c];
      continue;
    }
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    double cumulative = 0.0;
    for (int64_t j = begin; j < end; ++j) {
      cumulative += w[j];
      if (cumulative > target) return j;
    }
    return last_weighted(begin, end);
  }
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t j = last_weighted(c * kChunk, std::min(n, (c + 1) * kChunk));
    if (j >= 0) return j;
  }
  return 0;
}

// w [S, V] float32 (rows contiguous), u [S] float32 -> [S] int64.
at::Tensor draw_rows(const at::Tensor& w, const at::Tensor& u) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.stride(1) == 1 &&
                  u.dim() == 1 && u.scalar_type() == at::kFloat && u.size(0) == w.size(0),
              "draw_rows: w must be float32 [S, V] with contiguous rows, u float32 [S]");
  const int64_t count = w.size(0), n = w.size(1), stride = w.stride(0);
  const at::Tensor uc = u.contiguous();
  at::Tensor out = at::empty({count}, w.options().dtype(at::kLong));
  const float* wp = w.data_ptr<float>();
  const float* up = uc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, count, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = draw_row(wp + i * stride, n, up[i]);
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) { return rows_of(x, false); }
at::Tensor greedy_rows(const at::Tensor& x) { return rows_of(x, true); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("greedy_rows(Tensor x) -> Tensor");
  m.def("softmax_weights(Tensor x, Tensor rows, Tensor temperature) -> (Tensor, Tensor)");
  m.def("draw_rows(Tensor w, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("argmax_rows", argmax_rows);
  m.impl("greedy_rows", greedy_rows);
  m.impl("softmax_weights", softmax_weights);
  m.impl("draw_rows", draw_rows);
}
