// AVX2 with AVX-VNNI (Alder Lake and later, Zen 5): vpdpbusd on ymm sums unsigned x signed bytes
// into 32 bits directly, for 4- and 8-bit weights alike.

#include "isa_prelude.h"

#if defined(__x86_64__) || defined(_M_X64)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

namespace {

#include "isa_x86_avx2.h"

struct AvxVnni : Avx2Base {
  static constexpr const char* kName = "avx_vnni";
  static constexpr bool kDot8Offset = false;
  static constexpr int kSuperRows = 4, kSuperTiles = 1;
  static constexpr bool kInt16Sums = false;
  static constexpr bool kRowPairs = false;
  static I dot8(I acc, W w, int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    return {_mm256_dpbusd_avx_epi32(acc.a, w.a, xb), _mm256_dpbusd_avx_epi32(acc.b, w.b, xb)};
  }
  static I dot4(I acc, W w, int32_t x) { return dot8(acc, w, x); }
};

#include "isa_generic.h"


}  // namespace

namespace outrider_native {
const KernelSet kAvxVnni = OUTRIDER_KERNELS(AvxVnni, matmul_tiles<AvxVnni>);
}  // namespace outrider_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
