// The portable reference: plain C++ on 16-lane arrays, no instruction-set extension. It defines
// the result of every kernel (each SIMD path must equal it bit for bit: check_kernels.cpp), and it
// serves any CPU that has none of the SIMD paths.

#include "isa_prelude.h"

namespace {

struct Scalar {
  static constexpr const char* kName = "scalar";
  static constexpr bool kDot8Offset = false;
  static constexpr bool kInt16Sums = false;
  static constexpr bool kRowPairs = false;
  static constexpr int kSuperRows = 4, kSuperTiles = 1;
  struct F { float v[16]; };
  struct I { int32_t v[16]; };
  struct W { uint8_t b[64]; };

#define OUTRIDER_LANES(expr) \
  F r;                       \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r;
  static F fzero() { OUTRIDER_LANES(0.f) }
  static F fset(float a) { OUTRIDER_LANES(a) }
  static F fload(const float* p) { OUTRIDER_LANES(p[i]) }
  static void fstore(float* p, F a) { std::memcpy(p, a.v, sizeof a.v); }
  static F add(F a, F b) { OUTRIDER_LANES(a.v[i] + b.v[i]) }
  static F sub(F a, F b) { OUTRIDER_LANES(a.v[i] - b.v[i]) }
  static F mul(F a, F b) { OUTRIDER_LANES(a.v[i] * b.v[i]) }
  static F div(F a, F b) { OUTRIDER_LANES(a.v[i] / b.v[i]) }
  static F fma(F a, F b, F c) { OUTRIDER_LANES(std::fma(a.v[i], b.v[i], c.v[i])) }
  static F fnma(F a, F b, F c) { OUTRIDER_LANES(std::fma(-a.v[i], b.v[i], c.v[i])) }
  static F fmax(F a, F b) { OUTRIDER_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]) }
  static F fmin(F a, F b) { OUTRIDER_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]) }
  static F fabs(F a) { OUTRIDER_LANES(std::fabs(a.v[i])) }
  static F round_even(F a) { OUTRIDER_LANES(std::nearbyint(a.v[i])) }
  static F scale2n(F y, F n) { OUTRIDER_LANES(y.v[i] * pow2(static_cast<int32_t>(n.v[i]))) }
  static F load_half(const uint16_t* p) { OUTRIDER_LANES(half_to_float(p[i])) }
  static F cvt(I a) { OUTRIDER_LANES(static_cast<float>(a.v[i])) }
#undef OUTRIDER_LANES
  static float max_lanes(F a) {
    float m = a.v[0];
    for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
    return m;
  }

  static I izero() { return iset(0); }
  static I iset(int32_t a) {
    I r;
    for (int i = 0; i < 16; ++i) r.v[i] = a;
    return r;
  }
  static I iadd(I a, I b) {
    for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
    return a;
  }
  static I isub(I a, I b) {
    for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i];
    return a;
  }
  static I imul(I a, I b) {
    for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static I load_u8(const uint8_t* p) {
    I r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static I load_i8(const int8_t* p) {
    I r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static I cvt_round(F a) {
    I r;
    for (int i = 0; i < 16; ++i) r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i]));
    return r;
  }
  static int32_t sum_lanes(I a) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += a.v[i];
    return s;
  }
  static void store_i8(int8_t* p, I a) {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(a.v[i]);
  }

  static W wload(const uint8_t* p) {
    W r;
    std::memcpy(r.b, p, 64);
    return r;
  }
  static W lo_nibbles(W a) {
    for (int i = 0; i < 64; ++i) a.b[i] &= 15;
    return a;
  }
  static W hi_nibbles(W a) {
    for (int i = 0; i < 64; ++i) a.b[i] >>= 4;
    return a;
  }
  // 5-bit weights: lane L gains 16 where bit L (byte L / 8, bit L % 8) of the plane is set.
  static W with_high_bits(W a, const uint8_t* bits) {
    for (int i = 0; i < 64; ++i) a.b[i] |= static_cast<uint8_t>(((bits[i >> 3] >> (i & 7)) & 1) << 4);
    return a;
  }
  // Q6_K's high parts: lane L gains 16 x crumb L (byte L % 16, bits 2 (L / 16)) of the 16-byte plane.
  static W with_crumbs(W a, const uint8_t* plane) {
    for (int i = 0; i < 64; ++i) a.b[i] |= static_cast<uint8_t>(((plane[i & 15] >> (2 * (i >> 4))) & 3) << 4);
    return a;
  }
  static I dot4(I acc, W w, int32_t x) { return dot8(acc, w, x); }
  static I dot8(I acc, W w, int32_t x) {
    int8_t xb[4];
    std::memcpy(xb, &x, 4);
    for (int i = 0; i < 16; ++i)
      for (int p = 0; p < 4; ++p) acc.v[i] += static_cast<int32_t>(w.b[4 * i + p]) * xb[p];
    return acc;
  }

  static F sum16(const F* v);

  static float pow2(int32_t n) {  // 2^n for n in [-126, 127]: a normal float, exactly
    const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static float half_to_float(uint16_t h) { return outrider_native::half_to_float(h); }  // exact
};

#include "isa_generic.h"

Scalar::F Scalar::sum16(const F* v) { return sum16_by_lanes<Scalar>(v); }

}  // namespace

namespace outrider_native {
const KernelSet kScalar = OUTRIDER_KERNELS(Scalar, matmul_tiles<Scalar>);
}  // namespace outrider_native
