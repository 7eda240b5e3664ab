// ARMv8.0 NEON: the dot products by vmull_s8 (16-bit products) and pairwise adds into 32 bits
// (at most 128 x 127 x 2 in 16 bits: exact).

#include "isa_prelude.h"

#if defined(__aarch64__)

namespace {

#include "isa_arm_neon.h"

struct Neon : NeonBase {
  static constexpr const char* kName = "neon";
  // acc[i] += sum_p w[4i+p] x_p for one quarter (4 outputs x 4 inputs).
  static int32x4_t quarter(int32x4_t acc, int8x16_t w, int8x16_t xb) {
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(xb));    // outputs 0, 1
    const int16x8_t hi = vmull_s8(vget_high_s8(w), vget_high_s8(xb));  // outputs 2, 3
    return vpadalq_s16(acc, vpaddq_s16(lo, hi));
  }
  static I dot4(I acc, W w, int32_t x) {
    const int8x16_t xb = broadcast(x);
    for (int i = 0; i < 4; ++i) acc.q[i] = quarter(acc.q[i], as_signed4(w.q[i]), xb);
    return acc;
  }
  static I dot8(I acc, W w, int32_t x) {
    const int8x16_t xb = broadcast(x);
    for (int i = 0; i < 4; ++i) acc.q[i] = quarter(acc.q[i], as_signed8(w.q[i]), xb);
    return acc;
  }
};

#include "isa_generic.h"


}  // namespace

namespace outrider_native {
const KernelSet kNeon = OUTRIDER_KERNELS(Neon, matmul_tiles<Neon>);
}  // namespace outrider_native

#endif
