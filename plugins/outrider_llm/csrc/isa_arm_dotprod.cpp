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

#define OUTRIDER_NEON_SDOT
#include "isa_arm_neon.h"

struct NeonDotprod : NeonSdot {
  static constexpr const char* kName = "neon_dotprod";
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
