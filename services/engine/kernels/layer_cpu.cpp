// A decoder layer's small float32 ops as one kernel each, on the CPU (specserve::rms_norm,
// specserve::rotary), and the quantiser that writes int4_mm's layout at load
// (specserve::int4_quantize, at the end). Each replaces several ATen ops whose dispatch, not their arithmetic, is
// their cost at decode sizes: torch's rms_norm on the CPU runs about ten ops (one row of 896
// took 40-47 us), rotary positions six (a slice, a negation, a concatenation, two products and
// a sum). Same arithmetic as the ops they replace, in float32, products and sums rounded apart
// (no fused multiply-add), so what they compute is what the ATen ops compute up to the
// summation order of the norm's mean of squares, taken here in double precision.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// x [T, n] (rows may be strided, elements contiguous), weight [n] -> [T, n]:
// x * rsqrt(mean(x^2) + eps) * weight, each row alone.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rms_norm: x must be float32 [T, n] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be float32 [n] matching x");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float add = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * stride;
      double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) sums[j] += static_cast<double>(xr[i + j]) * xr[i + j];
      for (; i < n; ++i) sums[0] += static_cast<double>(xr[i]) * xr[i];
      const double total = ((sums[0] + sums[1]) + (sums[2] + sums[3])) +
                           ((sums[4] + sums[5]) + (sums[6] + sums[7]));
      const float mean = static_cast<float>(total / static_cast<double>(n));
      const float scale = 1.f / std::sqrt(mean + add);
      float* o = op + r * n;
      for (int64_t k = 0; k < n; ++k) o[k] = (xr[k] * scale) * wp[k];
    }
  });
  return out;
}

// x [T, H, D] (token rows may be strided, heads and elements contiguous), cos and sin
// [T, 1, D] contiguous -> [T, H, D]: x * cos + rotate_half(x) * sin, where rotate_half(x) is
// (-x[D/2:], x[:D/2]).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary: x must be float32 [T, H, D] with contiguous heads, D even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == x.size(0) * x.size(2),
                "rotary: cos and sin must be float32 [T, 1, D], contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t stride = x.stride(0);
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = xp + t * stride + h * d;
        float* o = op + (t * heads + h) * d;
        for (int64_t k = 0; k < half; ++k) o[k] = xr[k] * c[k] + (-xr[k + half]) * s[k];
        for (int64_t k = half; k < d; ++k) o[k] = xr[k] * c[k] + xr[k - half] * s[k];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotary", rotary);
}

namespace {

// Weights [out, in] (float32 or bfloat16) -> int4_mm's layout: packed [out, in' / 2] uint8 and
// scale_offset [out, in' / 256, 16] bfloat16, in' = in padded with zero weights to whole blocks
// of 256. The arithmetic of quant.int4_codes and kernels.int4_blocks, step for step in float32
// (min and max of a group of 32; scale = max((max - min) / 15, 1e-12); code = clamp(round-half-
// even((w - min) / scale), 0, 15); offset = min + 8 * scale; scale and offset rounded to
// bfloat16), so the same bits, without the tensor temporaries: a 1.5B model in about a second.
std::tuple<at::Tensor, at::Tensor> int4_quantize(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "int4_quantize: weight must be a float32 or bfloat16 [out, in] CPU tensor");
  constexpr int64_t kGroup = 32, kGroups = 8, kInputs = kGroup * kGroups;
  const at::Tensor w = weight.contiguous();
  const int64_t out = w.size(0), in = w.size(1), blocks = (in + kInputs - 1) / kInputs;
  at::Tensor packed = at::empty({out, blocks * kInputs / 2}, w.options().dtype(at::kByte));
  at::Tensor pairs = at::empty({out, blocks, 2 * kGroups}, w.options().dtype(at::kBFloat16));
  const bool half = w.scalar_type() == at::kBFloat16;
  uint8_t* pp = packed.data_ptr<uint8_t>();
  at::BFloat16* sp = pairs.data_ptr<at::BFloat16>();
  at::parallel_for(0, out, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(blocks * kInputs, 0.f);  // (zeros pad the last block)
    uint8_t codes[kInputs];
    for (int64_t r = r0; r < r1; ++r) {
      if (half) {
        const at::BFloat16* src = w.data_ptr<at::BFloat16>() + r * in;
        for (int64_t i = 0; i < in; ++i) row[i] = static_cast<float>(src[i]);
      } else {
        std::memcpy(row.data(), w.data_ptr<float>() + r * in, in * sizeof(float));
      }
      for (int64_t b = 0; b < blocks; ++b) {
        at::BFloat16* so = sp + (r * blocks + b) * 2 * kGroups;
        for (int64_t g = 0; g < kGroups; ++g) {
          const float* x = row.data() + b * kInputs + g * kGroup;
          float low = x[0], high = x[0];
          for (int64_t i = 1; i < kGroup; ++i) {
            low = std::min(low, x[i]);
            high = std::max(high, x[i]);
          }
          const float scale = std::max((high - low) / 15.f, 1e-12f);
          for (int64_t i = 0; i < kGroup; ++i) {
            const float c = std::nearbyint((x[i] - low) / scale);
            codes[g * kGroup + i] = static_cast<uint8_t>(std::min(std::max(c, 0.f), 15.f));
          }
          so[g] = at::BFloat16(scale);
          so[kGroups + g] = at::BFloat16(low + 8.f * scale);
        }
        // byte j of row i: step 2i (low nibble) and 2i + 1 (high) of group j / 4, code j % 4
        uint8_t* dst = pp + r * blocks * kInputs / 2 + b * kInputs / 2;
        for (int64_t i = 0; i < 4; ++i)
          for (int64_t j = 0; j < 32; ++j) {
            const int64_t g = j / 4, k = j % 4;
            dst[i * 32 + j] = codes[g * kGroup + 4 * (2 * i) + k] |
                              (codes[g * kGroup + 4 * (2 * i + 1) + k] << 4);
          }
      }
    }
  });
  return {packed, pairs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("int4_quantize(Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("int4_quantize", int4_quantize); }
