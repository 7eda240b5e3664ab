// AVX-512 (F, BW, VL, DQ) with VNNI (Ice Lake, Sapphire Rapids, Zen 4/5): one zmm per 16 lanes,
// vpdpbusd for the dot products, a transpose tree that sums 16 keys' scores at once, and a
// matmul that reads each weight once for up to 12 rows (GGUF's blocks; 8 rows and up to 4 tiles at a
// time on the separate-table layouts).

#include "isa_prelude.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
#endif

namespace {

struct Avx512 {
  static constexpr const char* kName = "avx512_vnni";
  static constexpr bool kDot8Offset = false;
  static constexpr bool kInt16Sums = false;
  static constexpr bool kRowPairs = false;
  // One tile a pass: a decode step (one row) then reads each thread's weights as one linear stream,
  // which measured 1.2-1.4x faster from DRAM than four tiles' interleaved streams (1B Q4_K_M here).
  // 12 rows: a draft of 8 verified (9 rows) in one pass; 16 spilled accumulators (16 rows cost more
  // than two passes of 8).
  static constexpr int kSuperRows = 12, kSuperTiles = 1;
  using F = __m512;
  using I = __m512i;
  using W = __m512i;

  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F fmax(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmin(F a, F b) { return _mm512_min_ps(a, b); }
  static F fabs(F a) { return _mm512_abs_ps(a); }
  static F round_even(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2n(F y, F n) { return _mm512_scalef_ps(y, n); }  // exactly y * 2^n for n in [-126, 127]
  static F load_half(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static float max_lanes(F a) { return _mm512_reduce_max_ps(a); }  // exact in any order

  static I izero() { return _mm512_setzero_si512(); }
  static I iset(int32_t v) { return _mm512_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I load_i8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I cvt_round(F a) { return _mm512_cvtps_epi32(a); }
  static int32_t sum_lanes(I a) { return _mm512_reduce_add_epi32(a); }
  static void store_i8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }

  static W wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static W lo_nibbles(W w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static W hi_nibbles(W w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  // 5-bit weights: lane L gains 16 where bit L of the 8-byte plane is set (the plane is a mask).
  static W with_high_bits(W w, const uint8_t* bits) {
    __mmask64 k;
    std::memcpy(&k, bits, sizeof k);
    return _mm512_or_si512(w, _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(16)));
  }
  // Q6_K's high parts: lane L gains 16 x ((plane[L % 16] >> 2 (L / 16)) & 3): the plane in every
  // quarter, each quarter's 64-bit elements shifted by 2 (L / 16), masked to the low two bits.
  static W with_crumbs(W w, const uint8_t* plane) {
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    const __m512i crumbs = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0)),
                                            _mm512_set1_epi8(3));
    return _mm512_or_si512(w, _mm512_slli_epi16(crumbs, 4));
  }
  static I dot8(I acc, W w, int32_t x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)); }
  static I dot4(I acc, W w, int32_t x) { return dot8(acc, w, x); }

  // Lane j = tree16(v[j]), for 16 vectors at once (~3 operations per vector).
  static F sum16(const F* v) {
    __m512 a[8], b[4];
    for (int j = 0; j < 8; ++j)
      a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; ++j) {
      const __m512d lo = _mm512_castps_pd(a[2 * j]), hi = _mm512_castps_pd(a[2 * j + 1]);
      b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
  }
};

#include "isa_generic.h"

// The generic dot_rows' arithmetic, R rows x T tiles at a time (register budget: R * T int32 +
// R * T fp32 accumulators + 2T weights): one weight read serves up to 8 rows.
template <int Bits, bool F32, int R, int T>
void dot_tiles(const int32_t* const* x_words, const float* const* x_scale, const float* const* x_sum, int64_t groups,
               int64_t octs_per_group, int64_t octs, const uint8_t* w, const void* d, const void* m,
               float neg_offset, float* const* y) {
  __m512 out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_setzero_ps();
  constexpr int64_t kOctBytes = oct_bytes(Bits);
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (R > 1)  // see kPrefetchBytes
      for (int t = 0; t < T; ++t)
        for (int64_t at = 0; at < octs_per_group * kOctBytes; at += 64)
          __builtin_prefetch(w + (t * octs + g * octs_per_group) * kOctBytes + kPrefetchBytes + at);
    __m512i acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
    for (int64_t j = g * octs_per_group; j < (g + 1) * octs_per_group; ++j) {
      __m512i lo[T], hi[T];
      for (int t = 0; t < T; ++t) {
        if (Bits == 4) {
          const __m512i v = Avx512::wload(w + (t * octs + j) * 64);
          lo[t] = Avx512::lo_nibbles(v);
          hi[t] = Avx512::hi_nibbles(v);
        } else if (Bits == 5) {  // per oct: 64 bytes of nibbles, then 16 bytes of fifth bits
          const uint8_t* block = w + (t * octs + j) * 80;
          const __m512i v = Avx512::wload(block);
          lo[t] = Avx512::with_high_bits(Avx512::lo_nibbles(v), block + 64);
          hi[t] = Avx512::with_high_bits(Avx512::hi_nibbles(v), block + 72);
        } else {
          lo[t] = Avx512::wload(w + (t * octs + j) * 128);
          hi[t] = Avx512::wload(w + (t * octs + j) * 128 + 64);
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
      const __m512 scale = load_scales<Avx512, F32>(d, (t * groups + g) * 16);
      const __m512 minimum = group_minimum<Avx512, F32>(m, (t * groups + g) * 16, scale, neg_offset);
      for (int r = 0; r < R; ++r) {
        out[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_mul_ps(scale, _mm512_set1_ps(x_scale[r][g])),
                                    out[r][t]);
        out[r][t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x_sum[r][g]), out[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y[r] + t * 16, out[r][t]);
}

constexpr int kRows = 8;
using DotFn = void (*)(const int32_t* const*, const float* const*, const float* const*, int64_t, int64_t, int64_t,
                       const uint8_t*, const void*, const void*, float, float* const*);
// [bits][fp32 scales][rows - 1][0]: several tiles at once, [..][1]: one tile (the tail).
#define OUTRIDER_DOT_ROWS(B, S)                                                                          \
  {{dot_tiles<B, S, 1, 4>, dot_tiles<B, S, 1, 1>}, {dot_tiles<B, S, 2, 4>, dot_tiles<B, S, 2, 1>},     \
   {dot_tiles<B, S, 3, 2>, dot_tiles<B, S, 3, 1>}, {dot_tiles<B, S, 4, 2>, dot_tiles<B, S, 4, 1>},     \
   {dot_tiles<B, S, 5, 1>, dot_tiles<B, S, 5, 1>}, {dot_tiles<B, S, 6, 1>, dot_tiles<B, S, 6, 1>},     \
   {dot_tiles<B, S, 7, 1>, dot_tiles<B, S, 7, 1>}, {dot_tiles<B, S, 8, 1>, dot_tiles<B, S, 8, 1>}}
// [bits: 4, 5, 8]
const DotFn kDotFns[3][2][kRows][2] = {{OUTRIDER_DOT_ROWS(4, false), OUTRIDER_DOT_ROWS(4, true)},
                                       {OUTRIDER_DOT_ROWS(5, false), OUTRIDER_DOT_ROWS(5, true)},
                                       {OUTRIDER_DOT_ROWS(8, false), OUTRIDER_DOT_ROWS(8, true)}};
// One row (a decode step): one tile a pass, each thread's weights then stream linearly (see kSuperTiles).
constexpr int kDotTiles[kRows] = {1, 4, 2, 2, 1, 1, 1, 1};

void matmul_tiles_avx512(const int8_t* xq, const float* scale, const float* sum, const int32_t* /*isum*/,
                         int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
                         const void* m, int64_t /*out*/, int bits, int64_t t0, int64_t t1, float* y,
                         int64_t y_stride) {
  const int32_t* words = reinterpret_cast<const int32_t*>(xq);
  const int64_t groups = in / group, octs = in / 8, octs_per_group = group / 8;
  const int f32 = (bits & outrider_native::kF32Scales) != 0;
  const int scale_bytes = f32 ? 4 : 2;
  const float neg_offset = outrider_native::minimum_offset(bits);
  bits &= 15;
  const int kind = bits == 4 ? 0 : bits == 5 ? 1 : 2;
  const int32_t* x_words[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  float* y_rows[kRows];
  for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
    n = pass_rows(rows, r0, kRows);
    for (int r = 0; r < n; ++r) {
      x_words[r] = words + (r0 + r) * in / 4;
      x_scale[r] = scale + (r0 + r) * groups;
      x_sum[r] = sum + (r0 + r) * groups;
    }
    for (int64_t t = t0; t < t1;) {
      const int step = t + kDotTiles[n - 1] <= t1 ? kDotTiles[n - 1] : 1;
      for (int r = 0; r < n; ++r) y_rows[r] = y + (r0 + r) * y_stride + t * 16;
      const int64_t at = t * groups * 16 * scale_bytes;  // bytes into the scale tables
      kDotFns[kind][f32][n - 1][step == 1](x_words, x_scale, x_sum, groups, octs_per_group, octs,
                                         w + t * in * bits * 2, static_cast<const char*>(d) + at,
                                         m != nullptr ? static_cast<const char*>(m) + at : nullptr, neg_offset,
                                         y_rows);
      t += step;
    }
  }
}

}  // namespace

namespace outrider_native {
const KernelSet kAvx512Vnni = OUTRIDER_KERNELS(Avx512, matmul_tiles_avx512);
}  // namespace outrider_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
