// AVX2 + FMA + F16C (Haswell and later, Zen): every kernel on two ymm per 16 lanes.

#include "isa_prelude.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace {

#include "isa_x86_avx2.h"

struct Avx2 : Avx2Base {
  static constexpr const char* kName = "avx2";
  static constexpr bool kDot8Offset = true;
  static constexpr int kSuperRows = 4, kSuperTiles = 1;
  static constexpr bool kInt16Sums = true;
  static constexpr bool kRowPairs = false;
  struct H { __m256i a, b; };
  static H hzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static H hdot(H h, W lo, W hi, int32_t xl, int32_t xh) {
    const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
    H r = {_mm256_add_epi16(h.a, _mm256_add_epi16(_mm256_maddubs_epi16(lo.a, bl), _mm256_maddubs_epi16(hi.a, bh))),
           _mm256_add_epi16(h.b, _mm256_add_epi16(_mm256_maddubs_epi16(lo.b, bl), _mm256_maddubs_epi16(hi.b, bh)))};
    settled(r.a, r.b);
    return r;
  }
  // Each oct's sum is settled into its register before the next oct's products: integer adds may be
  // reassociated, and GCC 12 then computed every product of a group's unrolled octs before adding
  // any, spilling most of them on 16 ymm (313 stack moves in the Q4_0 matmul, 87 with this; several
  // rows ran 1.3-1.4x faster here). An empty asm with the vectors as in-out operands costs nothing.
  static void settled(__m256i& a, __m256i& b) { asm("" : "+x"(a), "+x"(b)); }
  static I widen(I acc, H h) { return {_mm256_add_epi32(acc.a, pairs(h.a)), _mm256_add_epi32(acc.b, pairs(h.b))}; }
  // vpmaddwd by the scale in both 16-bit halves of its lane: the pair's sum times the scale in one step.
  static I pair_scale(I s) { return {_mm256_or_si256(s.a, _mm256_slli_epi32(s.a, 16)), _mm256_or_si256(s.b, _mm256_slli_epi32(s.b, 16))}; }
  static I widen_scaled(I acc, H h, I s) {
    return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(h.a, s.a)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(h.b, s.b))};
  }
  static __m256i pairs(__m256i products16) { return _mm256_madd_epi16(products16, _mm256_set1_epi16(1)); }
  static I dot4(I acc, W w, int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    return {_mm256_add_epi32(acc.a, pairs(_mm256_maddubs_epi16(w.a, xb))),
            _mm256_add_epi32(acc.b, pairs(_mm256_maddubs_epi16(w.b, xb)))};
  }
  static __m256i signed_dot(__m256i w, __m256i xb) {  // sum of (w - 128) x, per 4 bytes
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return pairs(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q)));
  }
  static I dot8(I acc, W w, int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    I r = {_mm256_add_epi32(acc.a, signed_dot(w.a, xb)), _mm256_add_epi32(acc.b, signed_dot(w.b, xb))};
    settled(r.a, r.b);
    return r;
  }
};

#include "isa_generic.h"


}  // namespace

namespace outrider_native {
const KernelSet kAvx2 = OUTRIDER_KERNELS(Avx2, matmul_tiles<Avx2>);
}  // namespace outrider_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
