// int4 weights x float32 activations on x86 CPUs with AVX2 (specserve::int4_mm).
//
// Weights: per output row, groups of 32 inputs with w = (code - 8) * scale + offset, a 4-bit
// code a weight and a bfloat16 scale and offset a group, in blocks of 8 groups (the layout
// below; kernels.int4_blocks packs it). Activations are quantised per row to int8 in the same
// groups of 32 (a float scale each), so a group's dot product is integer multiply-adds over
// bytes, scaled once, as in llama.cpp's Q4 x Q8 kernels. Where the CPU has AVX512-VNNI the
// bytes may be multiplied and added by dpbusd on 512-bit or 256-bit registers, elsewhere by
// AVX2's maddubs and madd, and where it has AMX-INT8 by tdpbusd on tiles of 16 x 16 rows, a
// group at a time (int4_amx.inc): the same integers every way, scaled and summed in the same
// order, so the same outputs; which path a call takes goes by its rows, as measured on the
// model at load (int4_set_paths).
// Each output element is computed from its own activation row alone, in the same order
// whatever the number of rows, so a token's outputs do not depend on the call it shares.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowChunk = 32;  // weight rows that the activation rows' tiles pass in turn
// Bytes of codes ahead of the block in hand that are fetched into cache as it is unpacked: the
// hardware's prefetcher stops at each 4 KiB page, and a decode row read 70% of the read
// bandwidth without this and 78% with it (2 threads, Xeon with AVX512-VNNI).
constexpr int64_t kAhead = 2048;

// Groups come in blocks of kBlock = 8. A block's 256 codes are 128 bytes: four 32-byte rows,
// row i's low nibbles step 2i and high nibbles step 2i + 1; a step's 32 bytes are 4 codes of
// each of the 8 groups (group-major), so the products of 8 steps summed leave each group's
// dot product in its own int32 lane. A block's scales (8 bfloat16) come before its offsets (8)
// in scale_offset. Activations are laid out the same way, as bytes, with the steps stored in
// the order kSlot gives (0 2 1 3 4 6 5 7): the 64 bytes of two weight rows hold steps
// (0, 2 | 1, 3) and (4, 6 | 5, 7) as low | high nibbles, so that each 64 bytes of activations
// meets one 512-bit half of the nibbles as it is.
constexpr int64_t kBlock = 8;
constexpr int kSlot[kBlock] = {0, 2, 1, 3, 4, 6, 5, 7};  // where step k's 32 bytes sit

// Group g of an activation row (32 values at x) -> its int8 codes, in the block layout within
// the block at q, its scale d = amax / 127 and d * (the sum of its codes) s (d and s: the
// block's 8, at g % kBlock). Rounds to nearest even as std::nearbyint does (AVX2's conversion
// under the default rounding mode).
inline void quantize_group(const float* x, int64_t g, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + i * 8);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i c[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    sum = _mm256_add_epi32(sum, c[i]);
  }
  // int32 -> int8 (|code| <= 127): the packs interleave 128-bit lanes, the permute restores order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  alignas(32) int32_t words[8];  // word k: codes 4k .. 4k + 3
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), bytes);
  for (int k = 0; k < 8; ++k)
    std::memcpy(q + kSlot[k] * 32 + (g % kBlock) * 4, &words[k], sizeof(int32_t));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  const int64_t i = g % kBlock;
  d[i] = top / 127.f;
  s[i] = d[i] * static_cast<float>(_mm_cvtsi128_si32(t));
}

// Block b of one activation row of `cols` values (n padded) -> int8 codes [256 at q] and its
// groups' d and s [8 at d, s]. Groups past `cols` (the weights' zero padding to whole blocks)
// are zeros.
void quantize_block(const float* x, int64_t cols, int64_t b, int8_t* q, float* d, float* s) {
  for (int64_t g = b * kBlock; g < (b + 1) * kBlock; ++g) {
    if (g * kGroup < cols) {
      quantize_group(x + g * kGroup, g, q, d, s);
    } else {
      for (int k = 0; k < 8; ++k) std::memset(q + kSlot[k] * 32 + (g % kBlock) * 4, 0, 4);
      d[g % kBlock] = s[g % kBlock] = 0.f;
    }
  }
}

// A call's quantised activation rows, in tiles of kLayoutRows rows, and within a tile block by
// block: [tile][block][row in the tile][256 codes], d and s [tile][block][row][8]. The rows of a
// tile then sit 256 bytes (8 floats) apart within a block and a tile's loop addresses them all
// from one pointer at fixed offsets: with a pointer a row, 8 rows' pointers had outgrown the
// registers. The last tile holds what rows are left (one row: a row's blocks in order).
constexpr int64_t kLayoutRows = 8;
struct RowTile {  // rows [m, m + count) of a tile of `height` rows: row m's block 0 at q, d, s
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t height, m, count;
};
struct Rows {
  int8_t* q;
  float* d;
  float* s;
  int64_t rows, blocks;
  // rows in row m's tile
  int64_t height(int64_t m) const {
    return std::min(kLayoutRows, rows - m / kLayoutRows * kLayoutRows);
  }
  // row m's block b, counted in blocks of one row
  int64_t at(int64_t m, int64_t b) const {
    return m / kLayoutRows * kLayoutRows * blocks + b * height(m) + m % kLayoutRows;
  }
  int8_t* q_at(int64_t m, int64_t b) const { return q + at(m, b) * kBlock * kGroup; }
  float* d_at(int64_t m, int64_t b) const { return d + at(m, b) * kBlock; }
  float* s_at(int64_t m, int64_t b) const { return s + at(m, b) * kBlock; }
  RowTile tile(int64_t m, int64_t count) const {
    return {q_at(m, 0), d_at(m, 0), s_at(m, 0), height(m), m, count};
  }
};

namespace avx2 {
#include "int4_rows.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define SPECSERVE_VNNI 1
#include "int4_rows.inc"
#undef SPECSERVE_VNNI
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace vnni256 {
#define SPECSERVE_VNNI256 1
#include "int4_rows.inc"
#undef SPECSERVE_VNNI256
}  // namespace vnni256
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "int4_amx.inc"
}  // namespace amx
#pragma GCC pop_options

// The instruction paths, by number (kernels.PATHS names them in this order).
enum Path : int64_t { kAvx2 = 0, kVnni256 = 1, kVnni512 = 2, kAmx = 3, kPaths = 4 };

at::Tensor int4_mm_on(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& so, Path path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int4_mm: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2,
              "int4_mm: codes must be uint8 [out, in / 2]");
  TORCH_CHECK(so.scalar_type() == at::kBFloat16 && so.dim() == 3 && so.size(2) == kBlock * 2,
              "int4_mm: scales and offsets must be bfloat16 [out, in / 256, 16]");
  // n: the weights' inputs, whole blocks; x may have fewer columns (whole groups), the rest
  // being the weights' zero padding.
  const int64_t rows = x.size(0), cols = x.size(1), n = qs.size(1) * 2, out = qs.size(0);
  TORCH_CHECK(n % (kGroup * kBlock) == 0 && cols % kGroup == 0 && cols <= n &&
                  n - cols < kGroup * kBlock && so.size(0) == out &&
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
  const int64_t blocks = groups / kBlock;
  const Rows acts{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(), rows, blocks};
  at::parallel_for(0, rows * blocks, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / blocks, b = i % blocks;
      quantize_block(xp + m * cols, cols, b, acts.q_at(m, b), acts.d_at(m, b), acts.s_at(m, b));
    }
  });
  const uint8_t* wq = qc.data_ptr<uint8_t>();
  const uint16_t* wso = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  if (path == kAmx) {  // whole strips of 16 weight rows on the tiles, the rest as vnni512's
    const amx::Acts tiles(acts, n);
    const int64_t strips = out / amx::kTileRows, tiled = strips * amx::kTileRows;
    at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
      amx::rows_of(wq, wso, tiles, yp, rows, n, out, s0 * amx::kTileRows, s1 * amx::kTileRows);
    });
    if (tiled < out) vnni::rows_of(wq, wso, acts, yp, n, out, tiled, out);
    return y;
  }
  at::parallel_for(0, out, 32, [&](int64_t r0, int64_t r1) {
    switch (path) {
      case kVnni512: vnni::rows_of(wq, wso, acts, yp, n, out, r0, r1); break;
      case kVnni256: vnni256::rows_of(wq, wso, acts, yp, n, out, r0, r1); break;
      default: avx2::rows_of(wq, wso, acts, yp, n, out, r0, r1); break;
    }
  });
  return y;
}

bool vnni_supported() {
  static const bool vnni =
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return vnni;
}

// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25), and the kernel's leave to use the
// tiles' state: Linux hands it to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_supported() {
  static const bool amx = [] {
    unsigned a, b, c, d;
    if (!vnni_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return amx;
}

bool runs(int64_t path) {
  switch (path) {
    case kAvx2: return true;
    case kVnni256: case kVnni512: return vnni_supported();
    case kAmx: return amx_supported();
    default: return false;
  }
}

const char* needs(int64_t path) { return path == kAmx ? "AMX-INT8" : "AVX512-VNNI"; }

// The path a call of r rows takes: by_rows[min(r, kTable) - 1]. quant.quantize times every path
// this CPU runs over a pass of the model's int4 layers and sets it (kernels.choose_int4_path);
// all give the same bits. On an AMD EPYC (Zen 4 runs 512-bit ops in two halves) one row of the
// LM head streamed 1.5x faster through AVX2 than through 512-bit VNNI, 16 rows 1.3x slower; on
// a Xeon a pass of the default target's layers took AMX's tiles from 28 rows (the last entry
// is also every larger call: prompt chunks).
constexpr int64_t kTable = 64;
std::array<std::atomic<int64_t>, kTable> by_rows{};  // (zero: AVX2 until set)

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& so) {
  const int64_t rows = std::clamp<int64_t>(x.size(0), 1, kTable);
  return int4_mm_on(x, qs, so, static_cast<Path>(by_rows[rows - 1].load()));
}

// One path on its own (the tests compare them; kernels.choose_int4_path times them).
at::Tensor int4_mm_path(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& so, int64_t path) {
  TORCH_CHECK(path >= 0 && path < kPaths, "int4_mm_path: no path ", path);
  TORCH_CHECK(runs(path), "int4_mm_path: this CPU has no ", needs(path), " for path ", path);
  return int4_mm_on(x, qs, so, static_cast<Path>(path));
}

std::vector<int64_t> int4_paths() {
  std::vector<int64_t> paths;
  for (int64_t p = 0; p < kPaths; ++p)
    if (runs(p)) paths.push_back(p);
  return paths;
}

// paths[i]: the path of calls of i + 1 rows; the last one also of every larger call.
void int4_set_paths(std::vector<int64_t> paths) {
  TORCH_CHECK(!paths.empty(), "int4_set_paths: no paths");
  for (int64_t p : paths)
    TORCH_CHECK(p >= 0 && p < kPaths && runs(p), "int4_set_paths: this CPU does not run path ", p);
  for (int64_t i = 0; i < kTable; ++i)
    by_rows[i].store(paths[std::min<int64_t>(i, paths.size() - 1)]);
}

std::vector<int64_t> int4_paths_set() {
  std::vector<int64_t> paths;
  for (const auto& p : by_rows) paths.push_back(p.load());
  return paths;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scale_offset) -> Tensor");
  m.def("int4_mm_path(Tensor x, Tensor codes, Tensor scale_offset, int path) -> Tensor");
  m.def("int4_paths() -> int[]", int4_paths);
  m.def("int4_set_paths(int[] paths) -> ()", int4_set_paths);
  m.def("int4_paths_set() -> int[]", int4_paths_set);
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
  m.impl("int4_mm", int4_mm);
  m.impl("int4_mm_path", int4_mm_path);
}
