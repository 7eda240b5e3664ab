// The AVX2 vector type (two ymm per 16 lanes), shared by isa_x86_avx2.cpp and isa_x86_avxvnni.cpp,
// each of which includes it after its own target pragma. AVX2 has no unsigned x signed byte dot
// that sums into 32 bits: vpmaddubsw adds pairs of products in 16 bits (saturating) and vpmaddwd
// adds those pairs. 4-bit weights (<= 15 x 127 x 2) never saturate; 8-bit weights go through
// llama.cpp's sign trick (|q| x sign(x, q) with q = w - 128, at most 128 x 127 x 2).

struct Avx2Base {
  struct F { __m256 a, b; };
  struct I { __m256i a, b; };
  struct W { __m256i a, b; };

  static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F fset(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void fstore(float* p, F v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  static F add(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  static F sub(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
  static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static F div(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
  static F fma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static F fnma(F x, F y, F z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
  // Operand order as the scalar reference's (a > b ? a : b): maxps returns its second operand
  // unless the first is greater.
  static F fmax(F x, F y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
  static F fmin(F x, F y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
  static F fabs(F x) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_and_ps(x.a, mask), _mm256_and_ps(x.b, mask)};
  }
  static F round_even(F x) {
    constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(x.a, kMode), _mm256_round_ps(x.b, kMode)};
  }
  static __m256 pow2(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F scale2n(F y, F n) { return {_mm256_mul_ps(y.a, pow2(n.a)), _mm256_mul_ps(y.b, pow2(n.b))}; }
  static F load_half(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
  }
  static F cvt(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
  static float max_lanes(F x) {
    alignas(32) float v[16];
    fstore(v, x);
    float m = v[0];
    for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }

  static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I iset(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
  static I iadd(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
  static I isub(I x, I y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
  static I imul(I x, I y) { return {_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
  static I load_u8(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
  }
  static I load_i8(const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
  }
  static I cvt_round(F x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
  static int32_t sum_lanes(I x) {
    alignas(32) int32_t v[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), x.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + 8), x.b);
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
  }
  static void store_i8(int8_t* p, I x) {
    // packs works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; the permute puts a before b.
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(x.a, x.b), 0xD8);
    const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), w8);
  }

  static W wload(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static W lo_nibbles(W w) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(w.a, nibble), _mm256_and_si256(w.b, nibble)};
  }
  static W hi_nibbles(W w) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(w.b, 4), nibble)};
  }
  // 32 bits -> 32 bytes, 0xFF where bit j is set (llama.cpp's bytes_from_bits_32).
  static __m256i bytes_from_bits(const uint8_t* p) {
    uint32_t bits;
    std::memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));
  }
  // 5-bit weights: lane L gains 16 where bit L of the 8-byte plane is set.
  static W with_high_bits(W w, const uint8_t* bits) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    return {_mm256_or_si256(w.a, _mm256_and_si256(bytes_from_bits(bits), sixteen)),
            _mm256_or_si256(w.b, _mm256_and_si256(bytes_from_bits(bits + 4), sixteen))};
  }
  // Q6_K's high parts: lane L gains 16 x ((plane[L % 16] >> 2 (L / 16)) & 3). The plane in every
  // 128-bit half, each 64-bit element shifted by its quarter's 2 (L / 16) (bits from the next byte
  // enter each byte's top and are masked off).
  static W with_crumbs(W w, const uint8_t* plane) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    const __m256i three = _mm256_set1_epi8(3);
    const __m256i a = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(2, 2, 0, 0)), three);
    const __m256i b = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(6, 6, 4, 4)), three);
    return {_mm256_or_si256(w.a, _mm256_slli_epi16(a, 4)), _mm256_or_si256(w.b, _mm256_slli_epi16(b, 4))};
  }
  // Lanes 0..7 = tree16 of v[0..7], for 8 vectors at once: AVX-512's transpose tree (isa_x86_avx512.cpp)
  // on 128-bit quarters, the halves of each vector kept apart until the last step.
  static __m256 sum8(const F* v) {
    __m256 xa[4], xb[4], ya[2], yb[2];
    for (int j = 0; j < 4; ++j) {
      xa[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j].a, v[2 * j + 1].a), _mm256_unpackhi_ps(v[2 * j].a, v[2 * j + 1].a));
      xb[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j].b, v[2 * j + 1].b), _mm256_unpackhi_ps(v[2 * j].b, v[2 * j + 1].b));
    }
    for (int j = 0; j < 2; ++j) {  // per quarter L, lane p: P_L of vector 4j + p
      const __m256d a0 = _mm256_castps_pd(xa[2 * j]), a1 = _mm256_castps_pd(xa[2 * j + 1]);
      const __m256d b0 = _mm256_castps_pd(xb[2 * j]), b1 = _mm256_castps_pd(xb[2 * j + 1]);
      ya[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a0, a1)), _mm256_castpd_ps(_mm256_unpackhi_pd(a0, a1)));
      yb[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(b0, b1)), _mm256_castpd_ps(_mm256_unpackhi_pd(b0, b1)));
    }
    const __m256 p01 = _mm256_add_ps(_mm256_permute2f128_ps(ya[0], ya[1], 0x20), _mm256_permute2f128_ps(ya[0], ya[1], 0x31));
    const __m256 p23 = _mm256_add_ps(_mm256_permute2f128_ps(yb[0], yb[1], 0x20), _mm256_permute2f128_ps(yb[0], yb[1], 0x31));
    return _mm256_add_ps(p01, p23);
  }
  static F sum16(const F* v) { return {sum8(v), sum8(v + 8)}; }
};
