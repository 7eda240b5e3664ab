// What every isa_*.cpp includes first, before its target pragma: the standard and intrinsics
// headers, compiled for the baseline, so that no inline library function is emitted with one
// file's instruction set and then shared, by the linker, with a CPU that lacks it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
