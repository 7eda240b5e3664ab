// What the native kernels share (one extension, built from every .cpp here): the int8-activation
// matmul (w4a8_mm.cpp) and the attention (attend.cpp), called directly by the fused layer stack
// (w4a8_layers.cpp), and a vectorised exp.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

#define OUTRIDER_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace outrider_native {

// exp(x) per lane (Cephes' expf: range reduction by ln 2, degree-5 polynomial, 2^n by scalef), for
// x clamped to [-87.3, 88.3]; elementwise, so a value's result never depends on its neighbours.
OUTRIDER_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

bool vnni_supported();

// fp32 rows [rows, in] -> int8 per group of `group` (scale amax / 127, round to nearest even):
// xq [rows, in], scale and scale * sum(xq) [rows, in / group].
void quantize_rows_fp32(const float* x, int64_t rows, int64_t in, int64_t group, int8_t* xq, float* scale,
                        float* sum);

// y [rows, out] fp32 = quantized rows (as above) @ W.T, W in the w4a8 (bits 4) or w8a8 (bits 8)
// layout of w4a8_mm.cpp; parallel over output tiles.
void a8_matmul(const int8_t* xq, const float* scale, const float* sum, int64_t rows, int64_t in, int64_t group,
               const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t out, int bits, float* y);

// outrider::attend (attend.cpp).
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& kv, const at::Tensor& chunks, const at::Tensor& visible,
                  int64_t num_heads, int64_t num_kv_heads);

}  // namespace outrider_native
