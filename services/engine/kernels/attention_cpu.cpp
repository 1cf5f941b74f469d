// Attention that reads each sequence's keys and values where they lie in the KV pool, on the
// CPU (specserve::paged_attention): no gather of the entries into a padded batch, no padded
// query rows, masked-out entries skipped rather than computed. float32, AVX2 and FMA.
//
// For each new token (a row of q) and each KV head, the token's query heads that share it
// (grouped-query attention) are scored against its entries, 8 entries a head at a time
// (scores8), entries its mask hides set to -inf; softmax in float with the row's maximum
// subtracted; then the values weighted and summed, the sums of 64 of a head's values in
// registers over a span of entries (weighted_chunk). Work is split by (sequence, KV head), and
// a sequence's tokens go kRows at a time, so that each key and value read from the pool
// serves every query head of kRows tokens (a tree's tokens share their prefix). Passes over
// the pool ask the cache for entries kAhead on (the hardware prefetcher stops at each 4 KiB
// page). The engine's pool is stored head by head (kv_cache.head_major), so a thread's entries
// lie in one run; any strides are read.
//
// The default target's shapes, one sequence's step over 28 layers from a pool larger than the
// caches (`python -m benchmarks.paged_attention`, 2 threads, AMD EPYC): at 4,000 entries one
// token took 27-40 -> 18-21 ms and a 7-token chain 89-105 -> 59-65 ms against the kernel that
// scored one entry at a time and accumulated values with a run-time lane count, on a pool
// stored slot by slot; stored head by head, 13.0-14.5 and 54-55 ms.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd_exp.h"

namespace {

using specserve_simd::exp8;

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Scores of one query head (q: d floats) against 8 keys (ks: their d floats each), times
// scale: 8 dot products side by side, each in 8 lanes summed in order, then reduced by pairs
// ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) for all 8 at once. Each key's score is the same
// whichever of the 8 places it takes, so a token's scores do not depend on its pass.
inline __m256 scores8(const float* q, const float* const* ks, int64_t d, float scale) {
  __m256 a[8];
  for (int n = 0; n < 8; ++n) a[n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int n = 0; n < 8; ++n) a[n] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(ks[n] + i), a[n]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                    _mm256_permute2f128_ps(u0, u1, 0x31));
  return _mm256_mul_ps(sums, _mm256_set1_ps(scale));
}

constexpr int64_t kAhead = 8;  // entries ahead that a pass over the pool asks the cache for

// Asks the cache for `bytes` from `at` (a key's or value's lines, read a few entries later:
// the hardware's own prefetcher stops at each 4 KiB page, a few entries apart).
inline void prefetch(const float* at, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(at);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// acc[0, 8 * LANES) += sum over entries [j0, j1) that `visible` shows, in order, of p[j] *
// value j's first 8 * LANES values (vp: the chunk's start in entry 0), the sums in registers:
// each element the same chain of multiply-adds as one accumulated in memory entry by entry.
template <int LANES>
inline void weighted_chunk(const float* p, const float* vp, const int64_t* seq_slots,
                           int64_t slot_stride, const bool* visible, int64_t j0, int64_t j1,
                           int64_t length, float* acc, bool fetch) {
  __m256 sum[LANES];
  for (int i = 0; i < LANES; ++i) sum[i] = _mm256_loadu_ps(acc + i * 8);
  for (int64_t j = j0; j < j1; ++j) {
    if (fetch && j + kAhead < length) prefetch(vp + seq_slots[j + kAhead] * slot_stride, LANES * 32);
    if (visible != nullptr && !visible[j]) continue;
    const float* v = vp + seq_slots[j] * slot_stride;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int i = 0; i < LANES; ++i) sum[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i * 8), sum[i]);
  }
  for (int i = 0; i < LANES; ++i) _mm256_storeu_ps(acc + i * 8, sum[i]);
}

// acc[0, d) += sum over entries [j0, j1) of p[j] * value j: weighted_chunk over 64 of the d
// values at a time. `fetch`: ask the cache for the values kAhead entries on.
inline void weighted_values(const float* p, const float* vp, const int64_t* seq_slots,
                            int64_t slot_stride, const bool* visible, int64_t j0, int64_t j1,
                            int64_t length, int64_t d, float* acc, bool fetch) {
  for (int64_t c = 0; c < d; c += 64) {
    const float* v = vp + c;
    float* a = acc + c;
    switch (std::min<int64_t>(64, d - c) / 8) {
      case 8: weighted_chunk<8>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 7: weighted_chunk<7>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 6: weighted_chunk<6>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 5: weighted_chunk<5>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 4: weighted_chunk<4>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 3: weighted_chunk<3>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      case 2: weighted_chunk<2>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
      default: weighted_chunk<1>(p, v, seq_slots, slot_stride, visible, j0, j1, length, a, fetch); break;
    }
  }
}

constexpr int64_t kRows = 4;  // a sequence's tokens that share each read of a key and value
constexpr int64_t kSpan = 64;  // entries whose values stay in L1 while every token takes them

// q [t, H, D]; keys, values [S, KVH, D] (one layer's pool, any strides but 1 between an
// entry's D values: the engine's pool is stored head by head); slots [B, L] (entry j of sequence
// b is at slot slots[b, j]); mask [B, 1, N, L] bool, or empty: every token sees all L entries;
// query_rows [t]: padded row b * N + n of each token (empty: B == 1, token r is row r).
// -> [t, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& slots, const at::Tensor& mask,
                           const at::Tensor& query_rows, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_attention: q must be float32 [t, H, D]");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && keys.stride(2) == 1 &&
                  values.sizes() == keys.sizes() && values.strides() == keys.strides() &&
                  values.scalar_type() == at::kFloat,
              "paged_attention: keys and values must be float32 [S, KVH, D], strided alike, "
              "each entry's D values contiguous");
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
  const int64_t group = heads / kv_heads;
  const int64_t slot_stride = keys.stride(0), head_stride = keys.stride(1);  // (floats)
  const float sc = static_cast<float>(scale);

  std::vector<std::vector<int64_t>> rows_of(b_count);  // each sequence's tokens
  for (int64_t r = 0; r < t; ++r) {
    const int64_t padded = indexed ? rp[r] : r;
    TORCH_CHECK(padded >= 0 && padded < b_count * n_max, "paged_attention: query row out of range");
    rows_of[padded / n_max].push_back(r);
  }

  // Work by (sequence, KV head); a sequence's tokens kRows at a time, so that each key and
  // value read from the pool serves all of them (a tree's tokens see the same prefix).
  at::parallel_for(0, b_count * kv_heads, 1, [&](int64_t w0, int64_t w1) {
    const int64_t stride = (length + 7) / 8 * 8;  // a head's scores, whole lanes
    std::vector<float> scores(kRows * group * stride);
    std::vector<float> acc(kRows * group * d), total(kRows * group);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / kv_heads, kvh = w % kv_heads;
      const int64_t* seq_slots = sp + b * length;
      const std::vector<int64_t>& tokens = rows_of[b];
      for (size_t c0 = 0; c0 < tokens.size(); c0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, tokens.size() - c0);
        const bool* visible[kRows];
        const float* qr[kRows];
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = tokens[c0 + i], n = (indexed ? rp[r] : r) % n_max;
          visible[i] = masked ? mp + (b * n_max + n) * length : nullptr;
          qr[i] = qp + (r * heads + kvh * group) * d;
        }
        // Scores 8 entries at a time (past the end: the last entry again, never read), each
        // block of keys serving every query head of the chunk's tokens; then an entry a token
        // does not see scores -inf.
        for (int64_t j0 = 0; j0 < length; j0 += 8) {
          const float* ks[8];
          for (int64_t n = 0; n < 8; ++n)
            ks[n] = kp + seq_slots[std::min(j0 + n, length - 1)] * slot_stride + kvh * head_stride;
          for (int64_t n = kAhead; n < kAhead + 8 && j0 + n < length; ++n)
            prefetch(kp + seq_slots[j0 + n] * slot_stride + kvh * head_stride, d * 4);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t h = 0; h < group; ++h)
              _mm256_storeu_ps(scores.data() + (i * group + h) * stride + j0,
                               scores8(qr[i] + h * d, ks, d, sc));
        }
        const float inf = std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < rows; ++i) {
          float* si = scores.data() + i * group * stride;
          for (int64_t j = length; j < stride; ++j)
            for (int64_t h = 0; h < group; ++h) si[h * stride + j] = -inf;
          if (visible[i] == nullptr) continue;
          for (int64_t j = 0; j < length; ++j)
            if (!visible[i][j])
              for (int64_t h = 0; h < group; ++h) si[h * stride + j] = -inf;
        }
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t h = 0; h < group; ++h) {
            float* s = scores.data() + (i * group + h) * stride;
            __m256 top = _mm256_set1_ps(-inf);
            for (int64_t j = 0; j < stride; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
            const __m256 m = _mm256_set1_ps(max8(top)), none = _mm256_set1_ps(-inf);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < stride; j += 8) {  // entry j in lane j % 8, whatever L is
              const __m256 x = _mm256_loadu_ps(s + j);
              const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, none, _CMP_NEQ_OQ));
              _mm256_storeu_ps(s + j, e);
              sum = _mm256_add_ps(sum, e);
            }
            total[i * group + h] = sum8(sum);
          }
        }
        std::fill(acc.begin(), acc.begin() + rows * group * d, 0.f);
        for (int64_t j0 = 0; j0 < length; j0 += kSpan) {
          const int64_t j1 = std::min(length, j0 + kSpan);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t h = 0; h < group; ++h)
              weighted_values(scores.data() + (i * group + h) * stride, vp + kvh * head_stride, seq_slots,
                              slot_stride, visible[i], j0, j1, length, d,
                              acc.data() + (i * group + h) * d, i == 0 && h == 0);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = tokens[c0 + i];
          for (int64_t h = 0; h < group; ++h) {
            const float inv = 1.f / total[i * group + h];
            const float* a = acc.data() + (i * group + h) * d;
            float* o = op + (r * heads + kvh * group + h) * d;
            for (int64_t x = 0; x < d; ++x) o[x] = a[x] * inv;
          }
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
