// int4 weights x float32 activations on x86 CPUs with AVX2 (specserve::int4_mm).
//
// Weights: per output row, groups of 32 inputs, each as 16 bytes of 4-bit codes (byte j holds
// input j in its low nibble and input 16 + j in its high one) and a bfloat16 (scale, offset)
// pair, with w = (code - 8) * scale + offset. Activations are quantised per row to int8 in
// the same groups of 32 (one float scale per group), so a group's dot product is one integer
// multiply-add over bytes (maddubs) scaled once, the way llama.cpp's Q4 x Q8 kernels work.
// Each output element is computed from its own input row alone, in the same order whatever
// the number of rows, so a token's outputs do not depend on the call it shares.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 4;  // activation rows that share one unpack of a weight group

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Groups come in blocks of kBlock = 8. A block's 256 codes are 128 bytes: four 32-byte rows,
// row i's low nibbles step 2i and high nibbles step 2i + 1; a step's 32 bytes are 4 codes of
// each of the 8 groups (group-major), so one maddubs and one madd leave each group's dot
// product in its own int32 lane. Activations are laid out the same way, unpacked.
constexpr int64_t kBlock = 8;

// One activation row [n] -> int8 codes in the block layout [n], and per group its scale d
// and d * (sum of its codes) s.
void quantize_row(const float* x, int64_t n, int8_t* q, float* d, float* s) {
  for (int64_t g = 0; g < n / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* block = q + (g / kBlock) * kBlock * kGroup;
    const int64_t lane = (g % kBlock) * 4;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));
      block[(i / 4) * 32 + lane + i % 4] = static_cast<int8_t>(v);
      sum += v;
    }
    d[g] = amax / 127.f;
    s[g] = d[g] * static_cast<float>(sum);
  }
}

inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Output rows [r0, r1) for activation rows [m0, m0 + T): each weight block is unpacked once
// and used for the T rows.
template <int T>
void tile_rows(const uint8_t* qs, const uint16_t* so, const int8_t* xq, const float* xd,
               const float* xs, float* y, int64_t n, int64_t out, int64_t r0, int64_t r1,
               int64_t m0) {
  const int64_t groups = n / kGroup, blocks = groups / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 eight = _mm256_set1_ps(8.f);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wq = qs + r * (n / 2);
    const uint16_t* wso = so + r * groups * 2;
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i codes[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * 128 + i * 32));
        codes[2 * i] = _mm256_and_si256(v, low);
        codes[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 scale = bf16x8(wso + b * 16);
      const __m256 minimum = _mm256_fnmadd_ps(eight, scale, bf16x8(wso + b * 16 + 8));
      for (int t = 0; t < T; ++t) {
        const int8_t* xb = xq + (m0 + t) * n + b * kBlock * kGroup;
        __m256i sum16 = _mm256_maddubs_epi16(codes[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
        for (int k = 1; k < 8; ++k)  // |sum| <= 8 * 2 * 15 * 127 = 30480: no int16 overflow
          sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(codes[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + k * 32))));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones));
        const int64_t at = (m0 + t) * groups + b * kBlock;
        acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_loadu_ps(xd + at)), acc[t]);
        acc[t] = _mm256_fmadd_ps(minimum, _mm256_loadu_ps(xs + at), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) y[(m0 + t) * out + r] = hsum(acc[t]);
  }
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& so) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int4_mm: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2,
              "int4_mm: codes must be uint8 [out, in / 2]");
  TORCH_CHECK(so.scalar_type() == at::kBFloat16 && so.dim() == 3 && so.size(2) == kBlock * 2,
              "int4_mm: scales and offsets must be bfloat16 [out, in / 256, 16]");
  const int64_t rows = x.size(0), n = x.size(1), out = qs.size(0);
  TORCH_CHECK(n % (kGroup * kBlock) == 0 && qs.size(1) * 2 == n && so.size(0) == out &&
                  so.size(1) * kGroup * kBlock == n,
              "int4_mm: shapes disagree: x ", x.sizes(), ", codes ", qs.sizes(),
              ", scales and offsets ", so.sizes());
  const at::Tensor xc = x.contiguous(), qc = qs.contiguous(), sc = so.contiguous();
  const int64_t groups = n / kGroup;
  at::Tensor xq = at::empty({rows, n}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({rows, groups}, x.options());
  at::Tensor xs = at::empty({rows, groups}, x.options());
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = xd.data_ptr<float>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(xp + m * n, n, qp + m * n, dp + m * groups, sp + m * groups);
  });
  const uint8_t* wq = qc.data_ptr<uint8_t>();
  const uint16_t* wso = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 32, [&](int64_t r0, int64_t r1) {
    int64_t m = 0;
    for (; m + kTile <= rows; m += kTile)
      tile_rows<kTile>(wq, wso, qp, dp, sp, yp, n, out, r0, r1, m);
    for (; m < rows; ++m) tile_rows<1>(wq, wso, qp, dp, sp, yp, n, out, r0, r1, m);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scale_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("int4_mm", int4_mm); }
