// The NEON vector type (four q registers per 16 lanes), shared by isa_arm_neon.cpp (ARMv8.0:
// Cortex-A53/A57/A72, the Raspberry Pi 4, older Jetsons), isa_arm_dotprod.cpp (ARMv8.2 dotprod:
// Cortex-A76/A78, the Pi 5, Jetson Orin, Graviton 2+) and isa_arm_i8mm.cpp, each including it after
// its target pragma (the last two with OUTRIDER_NEON_SDOT defined: they get NeonSdot too).

struct NeonBase {
  struct F { float32x4_t q[4]; };
  struct I { int32x4_t q[4]; };
  struct W { uint8x16_t q[4]; };
  static constexpr bool kDot8Offset = true;  // weights are multiplied as signed bytes (w - 128)
  static constexpr bool kInt16Sums = false;
  static constexpr bool kRowPairs = false;
  static constexpr int kSuperRows = 4, kSuperTiles = 1;

#define OUTRIDER_Q4(expr) \
  F r;                    \
  for (int i = 0; i < 4; ++i) r.q[i] = (expr); \
  return r;
  static F fzero() { OUTRIDER_Q4(vdupq_n_f32(0.f)) }
  static F fset(float v) { OUTRIDER_Q4(vdupq_n_f32(v)) }
  static F fload(const float* p) { OUTRIDER_Q4(vld1q_f32(p + 4 * i)) }
  static void fstore(float* p, F v) {
    for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, v.q[i]);
  }
  static F add(F a, F b) { OUTRIDER_Q4(vaddq_f32(a.q[i], b.q[i])) }
  static F sub(F a, F b) { OUTRIDER_Q4(vsubq_f32(a.q[i], b.q[i])) }
  static F mul(F a, F b) { OUTRIDER_Q4(vmulq_f32(a.q[i], b.q[i])) }
  static F div(F a, F b) { OUTRIDER_Q4(vdivq_f32(a.q[i], b.q[i])) }
  static F fma(F a, F b, F c) { OUTRIDER_Q4(vfmaq_f32(c.q[i], a.q[i], b.q[i])) }
  static F fnma(F a, F b, F c) { OUTRIDER_Q4(vfmsq_f32(c.q[i], a.q[i], b.q[i])) }
  // As the reference's a > b ? a : b (vmaxq differs only for NaN and signed zeros, which the
  // kernels never compare).
  static F fmax(F a, F b) { OUTRIDER_Q4(vbslq_f32(vcgtq_f32(a.q[i], b.q[i]), a.q[i], b.q[i])) }
  static F fmin(F a, F b) { OUTRIDER_Q4(vbslq_f32(vcltq_f32(a.q[i], b.q[i]), a.q[i], b.q[i])) }
  static F fabs(F a) { OUTRIDER_Q4(vabsq_f32(a.q[i])) }
  static F round_even(F a) { OUTRIDER_Q4(vrndnq_f32(a.q[i])) }
  static F scale2n(F y, F n) {
    OUTRIDER_Q4(vmulq_f32(y.q[i], vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.q[i]), vdupq_n_s32(127)), 23))))
  }
  static F load_half(const uint16_t* p) { OUTRIDER_Q4(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)))) }
  static F cvt(I a) { OUTRIDER_Q4(vcvtq_f32_s32(a.q[i])) }
#undef OUTRIDER_Q4
  static float max_lanes(F a) {
    float m = vgetq_lane_f32(a.q[0], 0);
    alignas(16) float v[16];
    fstore(v, a);
    for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }

  static I izero() { return iset(0); }
  static I iset(int32_t v) {
    I r;
    for (int i = 0; i < 4; ++i) r.q[i] = vdupq_n_s32(v);
    return r;
  }
  static I iadd(I a, I b) {
    for (int i = 0; i < 4; ++i) a.q[i] = vaddq_s32(a.q[i], b.q[i]);
    return a;
  }
  static I cvt_round(F a) {
    I r;
    for (int i = 0; i < 4; ++i) r.q[i] = vcvtnq_s32_f32(a.q[i]);
    return r;
  }
  static I isub(I a, I b) {
    for (int i = 0; i < 4; ++i) a.q[i] = vsubq_s32(a.q[i], b.q[i]);
    return a;
  }
  static I imul(I a, I b) {
    for (int i = 0; i < 4; ++i) a.q[i] = vmulq_s32(a.q[i], b.q[i]);
    return a;
  }
  static I load_u8(const uint8_t* p) {
    const uint8x16_t v = vld1q_u8(p);
    const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_u8(vget_high_u8(v));
    I r;
    r.q[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo)));
    r.q[1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo)));
    r.q[2] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi)));
    r.q[3] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi)));
    return r;
  }
  static I load_i8(const int8_t* p) {
    const int8x16_t v = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
    I r;
    r.q[0] = vmovl_s16(vget_low_s16(lo));
    r.q[1] = vmovl_s16(vget_high_s16(lo));
    r.q[2] = vmovl_s16(vget_low_s16(hi));
    r.q[3] = vmovl_s16(vget_high_s16(hi));
    return r;
  }
  static int32_t sum_lanes(I a) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += vaddvq_s32(a.q[i]);
    return s;
  }
  static void store_i8(int8_t* p, I a) {
    const int16x8_t lo = vcombine_s16(vmovn_s32(a.q[0]), vmovn_s32(a.q[1]));
    const int16x8_t hi = vcombine_s16(vmovn_s32(a.q[2]), vmovn_s32(a.q[3]));
    vst1q_s8(p, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
  }

  static W wload(const uint8_t* p) {
    W r;
    for (int i = 0; i < 4; ++i) r.q[i] = vld1q_u8(p + 16 * i);
    return r;
  }
  static W lo_nibbles(W w) {
    for (int i = 0; i < 4; ++i) w.q[i] = vandq_u8(w.q[i], vdupq_n_u8(0x0F));
    return w;
  }
  static W hi_nibbles(W w) {
    for (int i = 0; i < 4; ++i) w.q[i] = vshrq_n_u8(w.q[i], 4);
    return w;
  }
  // 5-bit weights: lane L gains 16 where bit L of the 8-byte plane is set (vtst against 1 << L % 8).
  static W with_high_bits(W w, const uint8_t* bits) {
    static const uint8_t kBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bit = vld1q_u8(kBit), sixteen = vdupq_n_u8(16);
    for (int i = 0; i < 4; ++i) {
      const uint8x16_t bytes = vcombine_u8(vdup_n_u8(bits[2 * i]), vdup_n_u8(bits[2 * i + 1]));
      w.q[i] = vorrq_u8(w.q[i], vandq_u8(vtstq_u8(bytes, bit), sixteen));
    }
    return w;
  }
  // Q6_K's high parts: quarter c (lanes 16c ..) gains 16 x bits 2c, 2c + 1 of the plane's bytes.
  static W with_crumbs(W w, const uint8_t* plane) {
    const uint8x16_t v = vld1q_u8(plane), three = vdupq_n_u8(3);
    w.q[0] = vorrq_u8(w.q[0], vshlq_n_u8(vandq_u8(v, three), 4));
    w.q[1] = vorrq_u8(w.q[1], vshlq_n_u8(vandq_u8(vshrq_n_u8(v, 2), three), 4));
    w.q[2] = vorrq_u8(w.q[2], vshlq_n_u8(vandq_u8(vshrq_n_u8(v, 4), three), 4));
    w.q[3] = vorrq_u8(w.q[3], vshlq_n_u8(vshrq_n_u8(v, 6), 4));
    return w;
  }
  // 4-bit weights (0..15) are signed bytes as they are; 8-bit ones become w - 128.
  static int8x16_t as_signed4(uint8x16_t w) { return vreinterpretq_s8_u8(w); }
  static int8x16_t as_signed8(uint8x16_t w) { return vreinterpretq_s8_u8(veorq_u8(w, vdupq_n_u8(0x80))); }
  static int8x16_t broadcast(int32_t x) { return vreinterpretq_s8_s32(vdupq_n_s32(x)); }

  // Lane j = tree16(v[j]): AVX-512's transpose tree (isa_x86_avx512.cpp), on each quarter (one q
  // register) of 4 vectors at once, then (P0 + P1) + (P2 + P3) lanewise.
  static float32x4_t quarter_sums(float32x4_t u0, float32x4_t u1, float32x4_t u2, float32x4_t u3) {
    const float32x4_t x0 = vaddq_f32(vzip1q_f32(u0, u1), vzip2q_f32(u0, u1));
    const float32x4_t x1 = vaddq_f32(vzip1q_f32(u2, u3), vzip2q_f32(u2, u3));
    const float64x2_t d0 = vreinterpretq_f64_f32(x0), d1 = vreinterpretq_f64_f32(x1);
    return vaddq_f32(vreinterpretq_f32_f64(vzip1q_f64(d0, d1)), vreinterpretq_f32_f64(vzip2q_f64(d0, d1)));
  }
  static F sum16(const F* v) {
    F r;
    for (int k = 0; k < 4; ++k) {
      const F* u = v + 4 * k;
      float32x4_t p[4];
      for (int l = 0; l < 4; ++l) p[l] = quarter_sums(u[0].q[l], u[1].q[l], u[2].q[l], u[3].q[l]);
      r.q[k] = vaddq_f32(vaddq_f32(p[0], p[1]), vaddq_f32(p[2], p[3]));
    }
    return r;
  }
};

#if defined(OUTRIDER_NEON_SDOT)
// The dot products by sdot (ARMv8.2 dotprod): 4 outputs x 4 signed bytes into 32 bits per
// instruction; for the files compiled with dotprod (isa_arm_dotprod.cpp, isa_arm_i8mm.cpp).
struct NeonSdot : NeonBase {
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
#endif
