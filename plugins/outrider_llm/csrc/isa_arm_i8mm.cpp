// ARMv8.6 NEON with the int8 matrix multiply extension (Graviton 3+, Neoverse V1/V2/N2, Cortex-A510/
// A710/X2 and later, Apple M2+): one usmmla multiplies 2 outputs x 8 inputs of unsigned weights by
// 2 rows x 8 inputs of signed activations into a 2 x 2 block of int32 sums, twice the products of
// an sdot. A pass over several rows (a verified draft, streams, a prefill) takes the rows of a
// K-type super block two at a time; a single row (a decode step) and the simple types use sdot, as
// neon_dotprod does. Exact integer sums either way: the results equal the scalar reference's.

#include "isa_prelude.h"

#if defined(__aarch64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod,i8mm"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#endif

namespace {

#define OUTRIDER_NEON_SDOT
#include "isa_arm_neon.h"

struct NeonI8mm : NeonSdot {
  static constexpr const char* kName = "neon_i8mm";
  static constexpr bool kRowPairs = true;

  // Two rows x 16 outputs: q[2k + h] holds outputs o = 4k + 2h and o + 1 of rows a and b as
  // (o a, o b, o+1 a, o+1 b), usmmla's 2 x 2 block.
  struct P { int32x4_t q[8]; };
  static P pzero() {
    P p;
    for (int i = 0; i < 8; ++i) p.q[i] = vdupq_n_s32(0);
    return p;
  }
  // One oct (lo: inputs 0..3, hi: 4..7 of 16 outputs, byte 4i + p) against rows a and b's 8
  // activations of it: zipping lo's and hi's 32-bit words gives two outputs' 8 weights each.
  static P pair_dot(P acc, W lo, W hi, const int8_t* a, const int8_t* b) {
    const int8x16_t x = vcombine_s8(vld1_s8(a), vld1_s8(b));
    for (int k = 0; k < 4; ++k) {
      const uint32x4_t l = vreinterpretq_u32_u8(lo.q[k]), h = vreinterpretq_u32_u8(hi.q[k]);
      acc.q[2 * k] = vusmmlaq_s32(acc.q[2 * k], vreinterpretq_u8_u32(vzip1q_u32(l, h)), x);
      acc.q[2 * k + 1] = vusmmlaq_s32(acc.q[2 * k + 1], vreinterpretq_u8_u32(vzip2q_u32(l, h)), x);
    }
    return acc;
  }
  // The pair's sums as each row's 16 lanes (the even lanes of a block are row a's, the odd row b's).
  static void unpair(const P& p, I& a, I& b) {
    for (int k = 0; k < 4; ++k) {
      a.q[k] = vuzp1q_s32(p.q[2 * k], p.q[2 * k + 1]);
      b.q[k] = vuzp2q_s32(p.q[2 * k], p.q[2 * k + 1]);
    }
  }
};

#include "isa_generic.h"

}  // namespace

namespace outrider_native {
const KernelSet kNeonI8mm = OUTRIDER_KERNELS(NeonI8mm, matmul_tiles<NeonI8mm>);
}  // namespace outrider_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
