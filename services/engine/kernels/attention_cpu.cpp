// Attention that reads each sequence's keys and values where they lie in the KV pool, on the
// CPU (specserve::paged_attention): no gather of the entries into a padded batch, no padded
// query rows, masked-out entries skipped rather than computed. float32, AVX2 and FMA.
//
// For each new token (a row of q) and each KV head, the token's query heads that share it
// (grouped-query attention) are scored against every entry its mask lets it see, reading each
// key once for all of them; softmax in float with the row's maximum subtracted; then the
// values, each read once, weighted and summed. Work is split by (sequence, KV head), so a
// sequence's entries stay in one core's cache for all of its tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd_exp.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using specserve_simd::exp8;

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// All-ones lanes for the first `count` entries from j that `visible` (null: all) shows.
inline __m256 live(const bool* visible, int64_t j, int64_t count) {
  alignas(32) int32_t on[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < count; ++i) on[i] = (visible == nullptr || visible[j + i]) ? -1 : 0;
  return _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(on)));
}

inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return sum8(acc);
}

// q [t, H, D]; keys, values [S, KVH, D] (one layer's pool); slots [B, L] (entry j of sequence
// b is at slot slots[b, j]); mask [B, 1, N, L] bool, or empty: every token sees all L entries;
// query_rows [t]: padded row b * N + n of each token (empty: B == 1, token r is row r).
// -> [t, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& slots, const at::Tensor& mask,
                           const at::Tensor& query_rows, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_attention: q must be float32 [t, H, D]");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kFloat &&
                  values.is_contiguous(),
              "paged_attention: keys and values must be contiguous float32 [S, KVH, D]");
  const int64_t t = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == d && d % 8 == 0 && heads % kv_heads == 0,
              "paged_attention: head_dim must match and divide by 8, heads by KV heads");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "paged_attention: slots must be int64 [B, L]");
  const int64_t b_count = slots.size(0), length = slots.size(1);
  const bool masked = mask.numel() > 0;
  TORCH_CHECK(!masked || (mask.dim() == 4 && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                          mask.size(0) == b_count && mask.size(3) == length),
              "paged_attention: mask must be bool [B, 1, N, L]");
  const int64_t n_max = masked ? mask.size(2) : 1;
  const bool indexed = query_rows.numel() > 0;
  TORCH_CHECK(!indexed || (query_rows.scalar_type() == at::kLong && query_rows.numel() == t),
              "paged_attention: query_rows must be int64 [t]");
  TORCH_CHECK(indexed || b_count == 1, "paged_attention: query_rows needed for several sequences");

  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({t, heads, d}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  const int64_t* rp = indexed ? query_rows.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, entry = kv_heads * d;
  const float sc = static_cast<float>(scale);

  std::vector<std::vector<int64_t>> rows_of(b_count);  // each sequence's tokens
  for (int64_t r = 0; r < t; ++r) {
    const int64_t padded = indexed ? rp[r] : r;
    TORCH_CHECK(padded >= 0 && padded < b_count * n_max, "paged_attention: query row out of range");
    rows_of[padded / n_max].push_back(r);
  }

  at::parallel_for(0, b_count * kv_heads, 1, [&](int64_t w0, int64_t w1) {
    const int64_t stride = (length + 7) / 8 * 8;  // a head's scores, whole lanes
    std::vector<float> scores(group * stride);
    std::vector<float> acc(group * d);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / kv_heads, kvh = w % kv_heads;
      const int64_t* seq_slots = sp + b * length;
      for (int64_t r : rows_of[b]) {
        const int64_t n = (indexed ? rp[r] : r) % n_max;
        const bool* visible = masked ? mp + (b * n_max + n) * length : nullptr;
        const float* qr = qp + (r * heads + kvh * group) * d;
        std::vector<float> top(group, -std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < length; ++j) {
          if (visible != nullptr && !visible[j]) continue;
          const float* k = kp + seq_slots[j] * entry + kvh * d;
          for (int64_t h = 0; h < group; ++h) {
            const float s = dot(qr + h * d, k, d) * sc;
            scores[h * stride + j] = s;
            top[h] = std::max(top[h], s);
          }
        }
        std::vector<float> total(group, 0.f);
        for (int64_t h = 0; h < group; ++h) {
          float* s = scores.data() + h * stride;
          const __m256 m = _mm256_set1_ps(top[h]);
          __m256 sum = _mm256_setzero_ps();
          for (int64_t j = 0; j < length; j += 8) {  // entry j in lane j % 8, whatever L is
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m)),
                                           live(visible, j, std::min<int64_t>(8, length - j)));
            _mm256_storeu_ps(s + j, e);
            sum = _mm256_add_ps(sum, e);
          }
          total[h] = sum8(sum);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < length; ++j) {
          if (visible != nullptr && !visible[j]) continue;
          const float* v = vp + seq_slots[j] * entry + kvh * d;
          for (int64_t h = 0; h < group; ++h) {
            const __m256 p = _mm256_set1_ps(scores[h * stride + j]);
            float* a = acc.data() + h * d;
            for (int64_t i = 0; i < d; i += 8)
              _mm256_storeu_ps(a + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(a + i)));
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          const float inv = 1.f / total[h];
          float* o = op + (r * heads + kvh * group + h) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = acc[h * d + i] * inv;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("paged_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor mask, "
        "Tensor query_rows, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("paged_attention", paged_attention); }
