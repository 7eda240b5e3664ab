// ARMv8.2 NEON with the dot product extension: one sdot multiplies 4 outputs x 4 inputs of signed
// bytes and sums them into 32 bits.

#include "isa_prelude.h"

#if defined(__aarch64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

namespace {

#include "isa_arm_neon.h"

struct NeonDotprod : NeonBase {
  static constexpr const char* kName = "neon_dotprod";
  static I dot4(I acc, W w, int32_t x) {
    const int8x16_t xb = broadcast(x);
    for (int i = 0; i < 4; ++i) acc.q[i] = vdotq_s32(acc.q[i], as_signed4(w.q[i]), xb);
    return acc;
  }
  static I dot8(I acc, W w, int32_t x) {
    const int8x16_t xb = broadcast(x);
    for (int i = 0; i < 4; ++i) acc.q[i] = vdotq_s32(acc.q[i], as_signed8(w.q[i]), xb);
    return acc;
  }
};

#include "isa_generic.h"


}  // namespace

namespace outrider_native {
const KernelSet kNeonDotprod = OUTRIDER_KERNELS(NeonDotprod, matmul_tiles<NeonDotprod>);
}  // namespace outrider_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
