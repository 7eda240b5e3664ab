// y = x @ W.T for group-wise 4-bit or 8-bit W (w = q * d + m per group, q in 0..15 or 0..255) and
// fp32 or bf16 x that is quantized here to int8 per row and group (x ~ xq * dx, as llama.cpp's Q8_1
// does for Q4_1 weights), on AVX512-VNNI: one vpdpbusd multiplies 16 outputs x 4 inputs of
// unsigned weights by signed activations and sums them into int32. 8-bit weights serve an LM head
// stored as GGUF Q8_0 (w = q8 * d, q8 signed): q = q8 + 128 and m = -128 d.
//
// Why it exists: one decode step of a small LLM multiplies one row by every weight, and torch's
// int4 kernel spends most of that time converting weights to floats. Here a weight costs a nibble
// mask and a quarter of one vpdpbusd; the float work is once per group of 32:
//   sum_k w_k x_k ~ d * dx * sum_k q_k xq_k + m * (dx * sum_k xq_k).
// The int32 sums are exact, and the per-group float steps run in group order for every output,
// so a row's result depends neither on the other rows of the call nor on the thread count (a
// 1-row decode step and an n-row verification give the same logits for the same prefix).
//
// Layout (built by outrider_llm.native.pack_w4a8 / pack_w8a8):
//   4-bit: w uint8 [N/16, K/8, 64]: per tile of 16 outputs, per 8 inputs k0..k0+7, byte 4i+p
//      holds q[16t+i, k0+p] in its low nibble and q[16t+i, k0+4+p] in its high nibble;
//   8-bit: w uint8 [N/16, K/4, 64]: per tile, per 4 inputs k0..k0+3, byte 4i+p holds q[16t+i, k0+p];
//   d, m  fp16 [N/16, K/G, 16]: scale and minimum of each (group, output).
// Output fp32 [M, N].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "native.h"

namespace {

constexpr int64_t kTile = 16;  // outputs per tile: one zmm of int32 / fp32

#define OUTRIDER_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

OUTRIDER_VNNI_TARGET inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
OUTRIDER_VNNI_TARGET inline __m512 load16(const uint16_t* x) {  // bf16 -> fp32: the 16 high bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// Per group: amax / 127 as the scale, inputs rounded to nearest (even) int8.
template <typename X>
OUTRIDER_VNNI_TARGET void quantize_rows(const X* x, int64_t rows, int64_t in, int64_t group, int8_t* xq,
                                        float* scale, float* sum) {
  const int64_t groups = in / group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const X* xg = x + r * in + g * group;
      int8_t* qg = xq + r * in + g * group;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < group; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(xg + k)));
      const float a = _mm512_reduce_max_ps(amax);
      const float d = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = 0; k < group; k += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xg + k), inv));  // |q| <= 127
        total = _mm512_add_epi32(total, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + k), _mm512_cvtepi32_epi8(q));
      }
      scale[r * groups + g] = d;
      sum[r * groups + g] = d * static_cast<float>(_mm512_reduce_add_epi32(total));
    }
  }
}

// R rows x T tiles of 16 outputs, over all groups; y[r] points at the first output of tile 0.
// Row r's activations: int8 as 32-bit words of 4 inputs, per group the scale dx and dx * sum(xq).
template <int Bits, int R, int T>
OUTRIDER_VNNI_TARGET void dot_tiles(const int32_t* const* x_words, const float* const* x_scale,
                                    const float* const* x_sum, int64_t groups, int64_t octs_per_group, int64_t octs,
                                    const uint8_t* w, const uint16_t* d, const uint16_t* m, float* const* y) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
    for (int64_t j = g * octs_per_group; j < (g + 1) * octs_per_group; ++j) {
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; ++t) {
        if (Bits == 4) {
          const __m512i v = _mm512_loadu_si512(w + (t * octs + j) * 64);
          lo[t] = _mm512_and_si512(v, nibble);                         // inputs k0..k0+3
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);   // inputs k0+4..k0+7
        } else {
          lo[t] = _mm512_loadu_si512(w + (t * octs + j) * 128);
          hi[t] = _mm512_loadu_si512(w + (t * octs + j) * 128 + 64);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x_lo = _mm512_set1_epi32(x_words[r][2 * j]);
        const __m512i x_hi = _mm512_set1_epi32(x_words[r][2 * j + 1]);
        for (int t = 0; t < T; ++t) {
          acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo[t], x_lo);
          acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi[t], x_hi);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (t * groups + g) * kTile)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + (t * groups + g) * kTile)));
      for (int r = 0; r < R; ++r) {
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scale[r][g]));
        out[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), row_scale, out[r][t]);
        out[r][t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x_sum[r][g]), out[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y[r] + t * kTile, out[r][t]);
}

constexpr int kRows = 8;  // rows per pass: up to 8 read each weight once (a tree of 8 verifies in one pass)
using DotFn = void (*)(const int32_t* const*, const float* const*, const float* const*, int64_t,
                       int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, float* const*);
// [bits == 8][rows - 1][0]: several tiles at once (register budget: R * T int32 + R * T fp32 +
// 2T weights), [..][1]: one tile (the tail).
#define OUTRIDER_DOT_ROWS(B)                                                                          \
  {{dot_tiles<B, 1, 4>, dot_tiles<B, 1, 1>}, {dot_tiles<B, 2, 4>, dot_tiles<B, 2, 1>},                \
   {dot_tiles<B, 3, 2>, dot_tiles<B, 3, 1>}, {dot_tiles<B, 4, 2>, dot_tiles<B, 4, 1>},                \
   {dot_tiles<B, 5, 1>, dot_tiles<B, 5, 1>}, {dot_tiles<B, 6, 1>, dot_tiles<B, 6, 1>},                \
   {dot_tiles<B, 7, 1>, dot_tiles<B, 7, 1>}, {dot_tiles<B, 8, 1>, dot_tiles<B, 8, 1>}}
constexpr DotFn kDotFns[2][kRows][2] = {OUTRIDER_DOT_ROWS(4), OUTRIDER_DOT_ROWS(8)};
constexpr int kDotTiles[kRows] = {4, 4, 2, 2, 1, 1, 1, 1};

}  // namespace

namespace outrider_native {

bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

void quantize_rows_fp32(const float* x, int64_t rows, int64_t in, int64_t group, int8_t* xq, float* scale,
                        float* sum) {
  quantize_rows(x, rows, in, group, xq, scale, sum);
}

void a8_matmul(const int8_t* xq_bytes, const float* x_scale, const float* x_sum, int64_t rows, int64_t in,
               int64_t group, const uint8_t* wp, const uint16_t* dp, const uint16_t* mp, int64_t out, int bits,
               float* yp) {
  const int32_t* const xq = reinterpret_cast<const int32_t*>(xq_bytes);
  const int64_t tiles = out / kTile, groups = in / group;
  const int64_t octs = in / 8, octs_per_group = group / 8;  // 8 inputs per step of the dot
  const int b8 = bits == 8;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int32_t* words[kRows];
    const float* scales[kRows];
    const float* sums[kRows];
    float* y_rows[kRows];
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      for (int r = 0; r < n; ++r) {
        words[r] = xq + (r0 + r) * in / 4;
        scales[r] = x_scale + (r0 + r) * groups;
        sums[r] = x_sum + (r0 + r) * groups;
      }
      for (int64_t t = begin; t < end;) {
        const int step = t + kDotTiles[n - 1] <= end ? kDotTiles[n - 1] : 1;
        for (int r = 0; r < n; ++r) y_rows[r] = yp + (r0 + r) * out + t * kTile;
        kDotFns[b8][n - 1][step == 1](words, scales, sums, groups, octs_per_group, octs, wp + t * in * bits * 2,
                                      dp + t * groups * kTile, mp + t * groups * kTile, y_rows);
        t += step;
      }
    }
  });
}

}  // namespace outrider_native

namespace {

using outrider_native::vnni_supported;

at::Tensor a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                 int64_t group_size, int64_t bits) {
  TORCH_CHECK(vnni_supported(), "outrider::w4a8_mm needs AVX512-VNNI, which this CPU lacks");
  TORCH_CHECK(bits == 4 || bits == 8, "outrider::w4a8_mm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "outrider::w4a8_mm: x must be contiguous fp32 or bf16 [rows, in], got ", x.sizes(), " ", x.scalar_type());
  const int64_t per_block = bits == 4 ? 8 : 4;  // inputs per 64-byte block of one tile
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == 64 && w.is_contiguous(),
              "outrider::w4a8_mm: w must be contiguous uint8 [out/16, in/", per_block, ", 64], got ", w.sizes());
  const int64_t rows = x.size(0), in = x.size(1), tiles = w.size(0), out = tiles * kTile;
  TORCH_CHECK(w.size(1) * per_block == in, "outrider::w4a8_mm: w holds ", w.size(1) * per_block, " inputs, x has ", in);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && in % group_size == 0,
              "outrider::w4a8_mm: group_size must be a multiple of 16 dividing ", in, ", got ", group_size);
  const int64_t groups = in / group_size;
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == groups && t->size(2) == kTile,
                "outrider::w4a8_mm: scales and minimums must be contiguous fp16 [", tiles, ", ", groups,
                ", 16], got ", t->sizes(), " ", t->scalar_type());
  }
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;
  // Per-thread scratch, kept between calls (an allocation per call costs more than a small matmul).
  thread_local std::vector<int8_t> xq_store;
  thread_local std::vector<float> scale_store, sum_store;
  xq_store.resize(rows * in + 64);
  scale_store.resize(rows * groups);
  sum_store.resize(rows * groups);
  int8_t* const xq = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xq_store.data()) + 3) & ~uintptr_t(3));
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), rows, in, group_size, xq, scale_store.data(), sum_store.data());
  } else {
    quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, in, group_size, xq,
                  scale_store.data(), sum_store.data());
  }
  outrider_native::a8_matmul(xq, scale_store.data(), sum_store.data(), rows, in, group_size, w.data_ptr<uint8_t>(),
                             reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                             reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), out, static_cast<int>(bits),
                             y.data_ptr<float>());
  return y;
}

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size) {
  return a8_mm(x, w, d, m, group_size, 4);
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size) {
  return a8_mm(x, w, d, m, group_size, 8);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(outrider, lib) {
  lib.def("w4a8_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size) -> Tensor");
  lib.def("w8a8_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(outrider, CPU, lib) {
  lib.impl("w4a8_mm", w4a8_mm);
  lib.impl("w8a8_mm", w8a8_mm);
}
