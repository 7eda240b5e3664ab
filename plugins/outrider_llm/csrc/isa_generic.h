// The kernels, written once over a 16-lane vector type `A` that each instruction set supplies
// (isa_*.cpp); this arithmetic, run by the scalar `A`, is the definition every path must match.
//
// Included by each isa_*.cpp inside an anonymous namespace, after that file's target pragma, so
// every instantiation is local to its file and compiled for its instruction set. It includes no
// header itself (the standard headers come first, compiled for the baseline: see isa_prelude.h).
//
// What `A` provides (all lanewise unless said; F: 16 floats, I: 16 int32, W: 64 weight bytes =
// 16 outputs x 4 inputs, byte 4i+p for output i and input p):
//   F fzero(), fset(float), fload(const float*), fstore(float*, F), add, sub, mul, div,
//     fma(a, b, c) = a*b+c and fnma(a, b, c) = c-a*b (fused, one rounding), fmax, fmin, fabs,
//     round_even(F) (to an integral float), scale2n(y, n) = y * 2^n (n integral in [-126, 127]),
//     load_half(const uint16_t*) (fp16 -> fp32), cvt(I) (int32 -> float);
//   float max_lanes(F);
//   I izero(), iset(int32), iadd; I cvt_round(F) (to nearest even); int32 sum_lanes(I);
//     store_i8(int8_t*, I) (values in int8 range);
//   W wload(const uint8_t*), lo_nibbles(W), hi_nibbles(W); with_high_bits(W, const uint8_t* plane): lane L
//     plus 16 where bit L of the 8-byte plane is set (5-bit weights);
//   I dot4(I acc, W w, int32 x): acc[i] += sum_p w[4i+p] * x_p, w in 0..15, x four int8;
//   I dot8(I acc, W w, int32 x): the same for w in 0..255, or, where kDot8Offset, for w - 128
//     (the caller then adds 128 * sum(x): the same exact integer);
//   F sum16(const F v[16]): lane j = tree16(v[j]);
//   I imul(I, I) (low 32 bits of the product), isub; I load_u8(const uint8_t*), load_i8(const int8_t*):
//     16 bytes widened to int32; with_crumbs(W, const uint8_t* plane): lane L plus 16 * ((plane[L % 16]
//     >> 2 (L / 16)) & 3) (Q6_K's high parts: 0..63); dot4 holds weights up to 63 on every path;
//   kRowPairs: the super-block matmul takes rows two at a time: P, pzero(), pair_dot(P, lo, hi,
//     const int8_t* a, const int8_t* b) (one oct of 16 outputs against rows a and b's 8 activations),
//     unpair(P, I& a, I& b) (each row's 16 lanes of sums; NEON i8mm);
//   kSuperRows, kSuperTiles: rows and tiles per pass of the super-block matmul (register budget);
//   kInt16Sums: the file has H (16 lanes of 16-bit sums), hzero(), hdot(H, W lo, W hi, int32 xl,
//     int32 xh) (one oct's two pairs of products per lane added in 16 bits: AVX2's vpmaddubsw, whose
//     widening vpmaddwd is the other half of dot4's cost) and widen(I, H) (the pairs of H summed
//     into I), widen_scaled(I, H, I s) (the same, each pair times its lane's scale, s from
//     pair_scale(I) of scales 0..63). The matmuls sum int16_octs(top weight) octs in H before
//     widening; the integers are the same, since no sum can reach 2^15.

// The one horizontal sum of 16 lanes every path uses (what AVX-512's transpose tree computes):
// per 128-bit quarter L, (e[4L] + e[4L+2]) + (e[4L+1] + e[4L+3]); then (P0 + P1) + (P2 + P3).
inline float tree16(const float* e) {
  float p[4];
  for (int l = 0; l < 4; ++l) p[l] = (e[4 * l] + e[4 * l + 2]) + (e[4 * l + 1] + e[4 * l + 3]);
  return (p[0] + p[1]) + (p[2] + p[3]);
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <class A>
inline typename A::F sum16_by_lanes(const typename A::F* v) {
  alignas(64) float lanes[16], out[16];
  for (int j = 0; j < 16; ++j) {
    A::fstore(lanes, v[j]);
    out[j] = tree16(lanes);
  }
  return A::fload(out);
}

template <class A>
inline float tree16_of(typename A::F v) {
  alignas(64) float lanes[16];
  A::fstore(lanes, v);
  return tree16(lanes);
}

// exp(x) per lane (Cephes' expf: range reduction by ln 2, degree-5 polynomial, 2^n), for x
// clamped to [-87.3, 88.3].
template <class A>
inline typename A::F exp16(typename A::F x) {
  using F = typename A::F;
  x = A::fmin(A::fmax(x, A::fset(-87.3f)), A::fset(88.3f));
  const F n = A::round_even(A::mul(x, A::fset(1.44269504088896341f)));
  x = A::fnma(n, A::fset(0.693359375f), x);
  x = A::fnma(n, A::fset(-2.12194440e-4f), x);
  F y = A::fset(1.9875691500e-4f);
  y = A::fma(y, x, A::fset(1.3981999507e-3f));
  y = A::fma(y, x, A::fset(8.3334519073e-3f));
  y = A::fma(y, x, A::fset(4.1665795894e-2f));
  y = A::fma(y, x, A::fset(1.6666665459e-1f));
  y = A::fma(y, x, A::fset(5.0000001201e-1f));
  y = A::fma(y, A::mul(x, x), A::add(x, A::fset(1.f)));
  return A::scale2n(y, n);
}

// ---- activations to int8 ----------------------------------------------------------------------

template <class A>
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t group, int8_t* xq, float* scale, float* sum,
                   int32_t* isum) {
  using F = typename A::F;
  using I = typename A::I;
  const int64_t groups = in / group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * in + g * group;
      int8_t* qg = xq + r * in + g * group;
      F amax = A::fzero();
      for (int64_t k = 0; k < group; k += 16) amax = A::fmax(amax, A::fabs(A::fload(xg + k)));
      const float a = A::max_lanes(amax);
      const float d = a / 127.f;
      const F inv = A::fset(a > 0.f ? 127.f / a : 0.f);
      I total = A::izero();
      for (int64_t k = 0; k < group; k += 16) {
        const I q = A::cvt_round(A::mul(A::fload(xg + k), inv));  // |q| <= 127
        total = A::iadd(total, q);
        A::store_i8(qg + k, q);
      }
      const int32_t t = A::sum_lanes(total);
      scale[r * groups + g] = d;
      sum[r * groups + g] = d * static_cast<float>(t);
      isum[r * groups + g] = t;
    }
  }
}

// ---- int8 activations x 4- or 8-bit weights ------------------------------------------------------

// R rows x one tile of 16 outputs, over all groups: per group the exact int32 dot products, then
//   y += float(acc) * (d * dx) + m * (dx * sum(xq)), in group order (two fused steps).
// 16 scales (or minimums) at element `i` of a table of fp16, or of fp32 (F32: kF32Scales).
template <class A, bool F32>
inline typename A::F load_scales(const void* table, int64_t i) {
  if constexpr (F32)
    return A::fload(static_cast<const float*>(table) + i);
  else
    return A::load_half(static_cast<const uint16_t*>(table) + i);
}

// A group's minimums: the table's, or (no table: m null) -offset * scale, exact for the power of two
// `offset` of a symmetric type (Q8_0: 128, Q6_K: 32, Q5_0: 16), the same value a table would hold.
template <class A, bool F32>
inline typename A::F group_minimum(const void* m, int64_t i, typename A::F scale, float neg_offset) {
  return m != nullptr ? load_scales<A, F32>(m, i) : A::mul(scale, A::fset(neg_offset));
}

// How far ahead of its reads a pass over several rows asks for its weights. Such a pass spends
// long enough on each cache line that the hardware prefetcher falls behind: 8 rows from memory
// measured 3x the time of the same pass over weights already in L2.
constexpr int64_t kPrefetchBytes = 4096;

// Octs one 16-bit lane can sum without saturating: each adds two pairs of products, 4 products of
// at most top x 128 (top 15: 4 octs, a 4-bit group of 32; 31: 2; 63: 1).
constexpr int int16_octs(int top) { return 32767 / (4 * top * 128); }

// Rows of the pass that starts at row r0: the rows split into as few passes as kRows allows, of
// sizes that differ by at most one (9 rows under kRows 8 would be 8 + 1, a second pass over every
// weight for one row; 5 + 4 costs the same decoding of weights and keeps both passes full).
inline int pass_rows(int64_t rows, int64_t r0, int k_rows) {
  const int64_t left = rows - r0, passes = (left + k_rows - 1) / k_rows;
  return static_cast<int>((left + passes - 1) / passes);
}

// Bytes of one oct (16 outputs x 8 inputs) of the separate-table layouts: 4-bit nibbles, 5-bit
// nibbles and their fifth bits, or 8-bit bytes.
constexpr int64_t oct_bytes(int bits) { return bits == 4 ? 64 : bits == 5 ? 80 : 128; }

// One oct's two weight vectors (inputs k0..k0+3 and k0+4..k0+7) in that layout: 4-bit nibbles; the
// same then 8 + 8 bytes of fifth bits; or 8-bit bytes.
template <class A, int Bits>
inline void oct_values(const uint8_t* oct, typename A::W& lo, typename A::W& hi) {
  if constexpr (Bits == 8) {
    lo = A::wload(oct);
    hi = A::wload(oct + 64);
  } else {
    const typename A::W v = A::wload(oct);
    lo = A::lo_nibbles(v);
    hi = A::hi_nibbles(v);
    if constexpr (Bits == 5) {
      lo = A::with_high_bits(lo, oct + 64);
      hi = A::with_high_bits(hi, oct + 72);
    }
  }
}

template <class A, int Bits, int R, bool F32>
void dot_rows(const int32_t* const* x_words, const float* const* x_scale, const float* const* x_sum,
              const int32_t* const* x_isum, int64_t groups, int64_t octs_per_group, const uint8_t* w,
              const void* d, const void* m, float neg_offset, float* const* y) {
  using F = typename A::F;
  using I = typename A::I;
  using W = typename A::W;
  F out[R];
  for (int r = 0; r < R; ++r) out[r] = A::fzero();
  constexpr int64_t kOctBytes = oct_bytes(Bits);
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (R > 1)  // see kPrefetchBytes
      for (int64_t at = 0; at < octs_per_group * kOctBytes; at += 64)
        __builtin_prefetch(w + g * octs_per_group * kOctBytes + kPrefetchBytes + at);
    I acc[R];
    for (int r = 0; r < R; ++r) acc[r] = A::izero();
    if constexpr (Bits != 8 && A::kInt16Sums) {
      constexpr int64_t kRun = int16_octs(Bits == 4 ? 15 : 31);
      for (int64_t j0 = g * octs_per_group; j0 < (g + 1) * octs_per_group; j0 += kRun) {
        typename A::H h[R];
        for (int r = 0; r < R; ++r) h[r] = A::hzero();
        for (int64_t j = j0; j < min64(j0 + kRun, (g + 1) * octs_per_group); ++j) {
          W lo, hi;
          oct_values<A, Bits>(w + j * kOctBytes, lo, hi);
          for (int r = 0; r < R; ++r) h[r] = A::hdot(h[r], lo, hi, x_words[r][2 * j], x_words[r][2 * j + 1]);
        }
        for (int r = 0; r < R; ++r) acc[r] = A::widen(acc[r], h[r]);
      }
    } else
    for (int64_t j = g * octs_per_group; j < (g + 1) * octs_per_group; ++j) {
      W lo, hi;
      oct_values<A, Bits>(w + j * kOctBytes, lo, hi);
      for (int r = 0; r < R; ++r) {
        if (Bits != 8) {  // 0..31: every path's 4-bit dot holds it (pairs of products <= 31 x 128 x 2)
          acc[r] = A::dot4(acc[r], lo, x_words[r][2 * j]);
          acc[r] = A::dot4(acc[r], hi, x_words[r][2 * j + 1]);
        } else {
          acc[r] = A::dot8(acc[r], lo, x_words[r][2 * j]);
          acc[r] = A::dot8(acc[r], hi, x_words[r][2 * j + 1]);
        }
      }
    }
    if (Bits == 8 && A::kDot8Offset)
      for (int r = 0; r < R; ++r) acc[r] = A::iadd(acc[r], A::iset(128 * x_isum[r][g]));
    const F scale = load_scales<A, F32>(d, g * 16);
    const F minimum = group_minimum<A, F32>(m, g * 16, scale, neg_offset);
    for (int r = 0; r < R; ++r) {
      out[r] = A::fma(A::cvt(acc[r]), A::mul(scale, A::fset(x_scale[r][g])), out[r]);
      out[r] = A::fma(minimum, A::fset(x_sum[r][g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) A::fstore(y[r], out[r]);
}

template <class A, int Bits, bool F32>
void matmul_tiles_bits(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                       int64_t in, int64_t group, const uint8_t* w, const void* d, const void* m,
                       float neg_offset, int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  using S = std::conditional_t<F32, float, uint16_t>;  // the scale tables' element
  constexpr int kRows = 4;  // rows per pass over a tile's weights
  const int32_t* words = reinterpret_cast<const int32_t*>(xq);
  const int64_t groups = in / group, octs_per_group = group / 8;
  const int32_t* x_words[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  const int32_t* x_isum[kRows];
  float* y_rows[kRows];
  for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
    n = pass_rows(rows, r0, kRows);
    for (int r = 0; r < n; ++r) {
      x_words[r] = words + (r0 + r) * in / 4;
      x_scale[r] = scale + (r0 + r) * groups;
      x_sum[r] = sum + (r0 + r) * groups;
      x_isum[r] = isum + (r0 + r) * groups;
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int r = 0; r < n; ++r) y_rows[r] = y + (r0 + r) * y_stride + t * 16;
      const uint8_t* wt = w + t * in * Bits * 2;
      const S* dt = static_cast<const S*>(d) + t * groups * 16;
      const S* mt = m != nullptr ? static_cast<const S*>(m) + t * groups * 16 : nullptr;
      switch (n) {
        case 1: dot_rows<A, Bits, 1, F32>(x_words, x_scale, x_sum, x_isum, groups, octs_per_group, wt, dt, mt, neg_offset, y_rows); break;
        case 2: dot_rows<A, Bits, 2, F32>(x_words, x_scale, x_sum, x_isum, groups, octs_per_group, wt, dt, mt, neg_offset, y_rows); break;
        case 3: dot_rows<A, Bits, 3, F32>(x_words, x_scale, x_sum, x_isum, groups, octs_per_group, wt, dt, mt, neg_offset, y_rows); break;
        default: dot_rows<A, Bits, 4, F32>(x_words, x_scale, x_sum, x_isum, groups, octs_per_group, wt, dt, mt, neg_offset, y_rows); break;
      }
    }
  }
}

template <class A>
void matmul_tiles(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                  int64_t in, int64_t group, const uint8_t* w, const void* d, const void* m, int64_t /*out*/,
                  int bits, int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  const bool f32 = bits & outrider_native::kF32Scales;
  const float neg_offset = outrider_native::minimum_offset(bits);
  if ((bits & 15) == 4) {
    if (f32)
      matmul_tiles_bits<A, 4, true>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
    else
      matmul_tiles_bits<A, 4, false>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
  } else if ((bits & 15) == 5) {
    if (f32)
      matmul_tiles_bits<A, 5, true>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
    else
      matmul_tiles_bits<A, 5, false>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
  } else if (f32) {
    matmul_tiles_bits<A, 8, true>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
  } else {
    matmul_tiles_bits<A, 8, false>(xq, scale, sum, isum, rows, in, group, w, d, m, neg_offset, t0, t1, y, y_stride);
  }
}

// ---- GGUF K types at the file's bytes (super-blocks of 256 inputs; kernels.h kSuperBlocks) ------------

template <int Layout>
struct SuperShape;
template <>
struct SuperShape<4> {  // Q4_K: d, dmin, sc[8], mn[8], then octs of 64 bytes
  static constexpr int kGroups = 8, kOctsPerGroup = 4, kOctBytes = 64, kScales = 64, kMins = 192, kOcts = 320;
};
template <>
struct SuperShape<5> {  // Q5_K: the same, octs of 80 bytes (nibbles, then fifth bits)
  static constexpr int kGroups = 8, kOctsPerGroup = 4, kOctBytes = 80, kScales = 64, kMins = 192, kOcts = 320;
};
template <>
struct SuperShape<6> {  // Q6_K: d, sc[16] (int8), then octs of 96 bytes (nibbles, then 2-bit high parts)
  static constexpr int kGroups = 16, kOctsPerGroup = 2, kOctBytes = 96, kScales = 32, kMins = 0, kOcts = 288;
};

// The two weight vectors of one oct (inputs k0..k0+3 and k0+4..k0+7), values 0..15, 0..31 or 0..63.
template <class A, int Layout>
inline void super_oct(const uint8_t* oct, typename A::W& lo, typename A::W& hi) {
  oct_values<A, Layout == 5 ? 5 : 4>(oct, lo, hi);
  if constexpr (Layout == 6) {
    lo = A::with_crumbs(lo, oct + 64);
    hi = A::with_crumbs(hi, oct + 80);
  }
}

// R rows x T tiles (tile t at w + t * tile_bytes), every super-block: per group the exact dot
// products, times the group's integer scale (Q6_K: less 32 x the activations' group sum first),
// summed in int32; the minimums' sum likewise; then per super-block, in this order,
//   y += float(sum) * (d * dx);  y -= float(minimums) * (dmin * dx)   (two fused steps).
// The bounds: |dot| <= 32 x 63 x 127 (Q6_K: 16 x 63 x 127 + 32 x 16 x 127), x a scale <= 63 (127),
// over 8 (16) groups: < 2^31.
template <class A, int Layout, int R, int T>
void super_dot(const int32_t* const* x_words, const float* const* x_scale, const int32_t* const* x_bsum,
               int64_t blocks, const uint8_t* w, int64_t tile_bytes, float* const* y) {
  using F = typename A::F;
  using I = typename A::I;
  using W = typename A::W;
  using S = SuperShape<Layout>;
  constexpr int64_t kBytes = outrider_native::super_block_bytes(Layout);
  // Q4_K, Q5_K summed in 16 bits: the widening multiply takes the group's (unsigned) scale, so each
  // run goes straight into the total; otherwise (Q6_K's scale multiplies the sum less its offset)
  // the group's sum is scaled after its octs.
  constexpr bool kScaledRuns = A::kInt16Sums && !(A::kRowPairs && R >= 2) && Layout != 6;
  F out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = A::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* base[T];
    for (int t = 0; t < T; ++t) base[t] = w + t * tile_bytes + b * kBytes;
    for (int t = 0; t < T; ++t)  // every pass, one row's too: 3-5% off a 1B Q4_K_M decode step here
      for (int64_t at = 0; at < kBytes; at += 64) __builtin_prefetch(base[t] + kPrefetchBytes + at);
    I total[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) total[r][t] = A::izero();
    for (int g = 0; g < S::kGroups; ++g) {
      I dot[R][T];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) dot[r][t] = A::izero();
      if constexpr (A::kRowPairs && R >= 2) {  // rows 2p and 2p + 1 together, an odd last row alone
        typename A::P pairs[R / 2][T];
        for (int p = 0; p < R / 2; ++p)
          for (int t = 0; t < T; ++t) pairs[p][t] = A::pzero();
        for (int o = 0; o < S::kOctsPerGroup; ++o) {
          const int64_t j = b * 32 + g * S::kOctsPerGroup + o;
          W lo[T], hi[T];
          for (int t = 0; t < T; ++t)
            super_oct<A, Layout>(base[t] + S::kOcts + (g * S::kOctsPerGroup + o) * S::kOctBytes, lo[t], hi[t]);
          for (int p = 0; p < R / 2; ++p)
            for (int t = 0; t < T; ++t)
              pairs[p][t] = A::pair_dot(pairs[p][t], lo[t], hi[t], reinterpret_cast<const int8_t*>(x_words[2 * p] + 2 * j),
                                        reinterpret_cast<const int8_t*>(x_words[2 * p + 1] + 2 * j));
          if constexpr (R % 2 == 1)
            for (int t = 0; t < T; ++t) {
              dot[R - 1][t] = A::dot4(dot[R - 1][t], lo[t], x_words[R - 1][2 * j]);
              dot[R - 1][t] = A::dot4(dot[R - 1][t], hi[t], x_words[R - 1][2 * j + 1]);
            }
        }
        for (int p = 0; p < R / 2; ++p)
          for (int t = 0; t < T; ++t) A::unpair(pairs[p][t], dot[2 * p][t], dot[2 * p + 1][t]);
      } else if constexpr (A::kInt16Sums) {
        constexpr int kRun = int16_octs(Layout == 4 ? 15 : Layout == 5 ? 31 : 63);
        static_assert(S::kOctsPerGroup % kRun == 0, "a group's octs split into whole 16-bit runs");
        I run_scale[T];
        if constexpr (kScaledRuns)
          for (int t = 0; t < T; ++t) run_scale[t] = A::pair_scale(A::load_u8(base[t] + S::kScales + g * 16));
        for (int o0 = 0; o0 < S::kOctsPerGroup; o0 += kRun) {
          typename A::H h[R][T];
          for (int r = 0; r < R; ++r)
            for (int t = 0; t < T; ++t) h[r][t] = A::hzero();
          for (int o = o0; o < o0 + kRun; ++o) {
            const int64_t j = b * 32 + g * S::kOctsPerGroup + o;
            W lo[T], hi[T];
            for (int t = 0; t < T; ++t)
              super_oct<A, Layout>(base[t] + S::kOcts + (g * S::kOctsPerGroup + o) * S::kOctBytes, lo[t], hi[t]);
            for (int r = 0; r < R; ++r)
              for (int t = 0; t < T; ++t) h[r][t] = A::hdot(h[r][t], lo[t], hi[t], x_words[r][2 * j], x_words[r][2 * j + 1]);
          }
          for (int r = 0; r < R; ++r)
            for (int t = 0; t < T; ++t) {
              if constexpr (kScaledRuns)
                total[r][t] = A::widen_scaled(total[r][t], h[r][t], run_scale[t]);
              else
                dot[r][t] = A::widen(dot[r][t], h[r][t]);
            }
        }
      } else
      for (int o = 0; o < S::kOctsPerGroup; ++o) {
        const int64_t j = b * 32 + g * S::kOctsPerGroup + o;  // the oct of the row
        W lo[T], hi[T];
        for (int t = 0; t < T; ++t)
          super_oct<A, Layout>(base[t] + S::kOcts + (g * S::kOctsPerGroup + o) * S::kOctBytes, lo[t], hi[t]);
        for (int r = 0; r < R; ++r) {
          const int32_t xl = x_words[r][2 * j], xh = x_words[r][2 * j + 1];
          for (int t = 0; t < T; ++t) {
            dot[r][t] = A::dot4(dot[r][t], lo[t], xl);
            dot[r][t] = A::dot4(dot[r][t], hi[t], xh);
          }
        }
      }
      if constexpr (!kScaledRuns)
      for (int t = 0; t < T; ++t) {
        const I scale = Layout == 6 ? A::load_i8(reinterpret_cast<const int8_t*>(base[t] + S::kScales + g * 16))
                                    : A::load_u8(base[t] + S::kScales + g * 16);
        for (int r = 0; r < R; ++r) {
          I v = dot[r][t];
          if constexpr (Layout == 6) v = A::isub(v, A::iset(32 * x_bsum[r][b * 16 + g]));
          total[r][t] = A::iadd(total[r][t], A::imul(v, scale));
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const F d = A::load_half(reinterpret_cast<const uint16_t*>(base[t]));
      for (int r = 0; r < R; ++r) {
        const F dx = A::fset(x_scale[r][b]);
        out[r][t] = A::fma(A::cvt(total[r][t]), A::mul(d, dx), out[r][t]);
        if constexpr (Layout != 6) {
          I mins = A::izero();
          for (int g = 0; g < 8; ++g) {
            const int32_t s = x_bsum[r][b * 16 + 2 * g] + x_bsum[r][b * 16 + 2 * g + 1];
            mins = A::iadd(mins, A::imul(A::load_u8(base[t] + S::kMins + g * 16), A::iset(s)));
          }
          const F dmin = A::load_half(reinterpret_cast<const uint16_t*>(base[t] + 32));
          out[r][t] = A::fnma(A::cvt(mins), A::mul(dmin, dx), out[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) A::fstore(y[r] + t * 16, out[r][t]);
}

constexpr int super_tiles(int budget, int rows) { return budget / rows >= 4 ? 4 : budget / rows >= 2 ? 2 : 1; }

// Rows r0 .. r0 + R of tiles [t0, t1): T tiles a pass (A::kSuperTiles / R), then one at a time.
template <class A, int Layout, int R>
void super_rows(const int32_t* const* x_words, const float* const* x_scale, const int32_t* const* x_bsum,
                int64_t blocks, const uint8_t* w, int64_t t0, int64_t t1, float* const* y_rows0) {
  constexpr int T = super_tiles(A::kSuperTiles, R);
  const int64_t tile_bytes = blocks * outrider_native::super_block_bytes(Layout);
  float* y_rows[R];
  for (int64_t t = t0; t < t1;) {
    for (int r = 0; r < R; ++r) y_rows[r] = y_rows0[r] + t * 16;
    if (T > 1 && t + T <= t1) {
      super_dot<A, Layout, R, T>(x_words, x_scale, x_bsum, blocks, w + t * tile_bytes, tile_bytes, y_rows);
      t += T;
    } else {
      super_dot<A, Layout, R, 1>(x_words, x_scale, x_bsum, blocks, w + t * tile_bytes, tile_bytes, y_rows);
      t += 1;
    }
  }
}

// Weight bytes a pass over many rows keeps hot: a prefill walks every row block over this many
// tiles before the next ones, so the weights come from L2 once per row block instead of from
// memory (or L3) once per row block. Only the order in which outputs are computed changes.
constexpr int64_t kTileChunkBytes = 192 << 10;

inline int64_t tile_chunk(int64_t rows, int64_t row_block, int64_t tile_bytes, int64_t t0, int64_t t1) {
  return rows <= row_block ? t1 - t0 : (kTileChunkBytes / tile_bytes > 1 ? kTileChunkBytes / tile_bytes : 1);
}

template <class A, int Layout>
void matmul_super_layout(const int8_t* xq, const float* scale, const int32_t* bsum, int64_t rows, int64_t in,
                         const uint8_t* w, int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  constexpr int kRows = A::kSuperRows;
  static_assert(kRows <= 12, "the switch below has a case per row count up to 12");
  const int32_t* words = reinterpret_cast<const int32_t*>(xq);
  const int64_t blocks = in / 256;
  const int64_t chunk = tile_chunk(rows, kRows, blocks * outrider_native::super_block_bytes(Layout), t0, t1);
  const int32_t* x_words[kRows];
  const float* x_scale[kRows];
  const int32_t* x_bsum[kRows];
  float* y_rows[kRows];
  for (int64_t c0 = t0; c0 < t1; c0 += chunk)
  for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
    const int64_t c1 = min64(t1, c0 + chunk);
    n = pass_rows(rows, r0, kRows);
    for (int r = 0; r < n; ++r) {
      x_words[r] = words + (r0 + r) * in / 4;
      x_scale[r] = scale + (r0 + r) * blocks;
      x_bsum[r] = bsum + (r0 + r) * (in / 16);
      y_rows[r] = y + (r0 + r) * y_stride;
    }
    switch (n) {
#define OUTRIDER_SUPER_CASE(N) \
  case N: if constexpr (N <= kRows) super_rows<A, Layout, N>(x_words, x_scale, x_bsum, blocks, w, c0, c1, y_rows); break;
      OUTRIDER_SUPER_CASE(1)
      OUTRIDER_SUPER_CASE(2)
      OUTRIDER_SUPER_CASE(3)
      OUTRIDER_SUPER_CASE(4)
      OUTRIDER_SUPER_CASE(5)
      OUTRIDER_SUPER_CASE(6)
      OUTRIDER_SUPER_CASE(7)
      OUTRIDER_SUPER_CASE(8)
      OUTRIDER_SUPER_CASE(9)
      OUTRIDER_SUPER_CASE(10)
      OUTRIDER_SUPER_CASE(11)
      OUTRIDER_SUPER_CASE(12)
#undef OUTRIDER_SUPER_CASE
      default: break;
    }
  }
}

template <class A>
void matmul_super(const int8_t* xq, const float* scale, const int32_t* bsum, int64_t rows, int64_t in,
                  const uint8_t* w, int layout, int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  if (layout == 4)
    matmul_super_layout<A, 4>(xq, scale, bsum, rows, in, w, t0, t1, y, y_stride);
  else if (layout == 5)
    matmul_super_layout<A, 5>(xq, scale, bsum, rows, in, w, t0, t1, y, y_stride);
  else
    matmul_super_layout<A, 6>(xq, scale, bsum, rows, in, w, t0, t1, y, y_stride);
}

// ---- the simple types with their scales beside their values (kernels.h kGroupBlocks) --------------

// A group-block code of `Bits` with a minimums table (HasM) or an offset (which one does not change the size).
constexpr int group_code(int bits, bool has_m) {
  return outrider_native::kGroupBlocks | bits | (has_m ? 0 : 1 << outrider_native::kOffsetShift);
}

// dot_rows' arithmetic, operation for operation, over group blocks: R rows x one tile.
template <class A, int Bits, bool HasM, int R>
void group_dot(const int32_t* const* x_words, const float* const* x_scale, const float* const* x_sum,
               const int32_t* const* x_isum, int64_t groups, const uint8_t* w, float neg_offset, float* const* y) {
  using F = typename A::F;
  using I = typename A::I;
  using W = typename A::W;
  constexpr int64_t kHeader = HasM ? 64 : 32;
  constexpr int64_t kBytes = outrider_native::group_block_bytes(group_code(Bits, HasM));
  F out[R];
  for (int r = 0; r < R; ++r) out[r] = A::fzero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = w + g * kBytes;
    const uint8_t* values = block + kHeader;
    if constexpr (R > 1)
      for (int64_t at = 0; at < kBytes; at += 64) __builtin_prefetch(block + kPrefetchBytes + at);
    I acc[R];
    for (int r = 0; r < R; ++r) acc[r] = A::izero();
    if constexpr (Bits != 8 && A::kInt16Sums) {
      constexpr int kRun = int16_octs(Bits == 4 ? 15 : 31);
      for (int o0 = 0; o0 < 4; o0 += kRun) {
        typename A::H h[R];
        for (int r = 0; r < R; ++r) h[r] = A::hzero();
        for (int o = o0; o < o0 + kRun; ++o) {
          W lo, hi;
          oct_values<A, Bits>(values + o * oct_bytes(Bits), lo, hi);
          const int64_t j = g * 4 + o;
          for (int r = 0; r < R; ++r) h[r] = A::hdot(h[r], lo, hi, x_words[r][2 * j], x_words[r][2 * j + 1]);
        }
        for (int r = 0; r < R; ++r) acc[r] = A::widen(acc[r], h[r]);
      }
    } else
    for (int o = 0; o < 4; ++o) {
      W lo, hi;
      oct_values<A, Bits>(values + o * oct_bytes(Bits), lo, hi);
      const int64_t j = g * 4 + o;
      for (int r = 0; r < R; ++r) {
        if (Bits != 8) {
          acc[r] = A::dot4(acc[r], lo, x_words[r][2 * j]);
          acc[r] = A::dot4(acc[r], hi, x_words[r][2 * j + 1]);
        } else {
          acc[r] = A::dot8(acc[r], lo, x_words[r][2 * j]);
          acc[r] = A::dot8(acc[r], hi, x_words[r][2 * j + 1]);
        }
      }
    }
    if (Bits == 8 && A::kDot8Offset)
      for (int r = 0; r < R; ++r) acc[r] = A::iadd(acc[r], A::iset(128 * x_isum[r][g]));
    const F scale = A::load_half(reinterpret_cast<const uint16_t*>(block));
    const F minimum = HasM ? A::load_half(reinterpret_cast<const uint16_t*>(block + 32))
                           : A::mul(scale, A::fset(neg_offset));
    for (int r = 0; r < R; ++r) {
      out[r] = A::fma(A::cvt(acc[r]), A::mul(scale, A::fset(x_scale[r][g])), out[r]);
      out[r] = A::fma(minimum, A::fset(x_sum[r][g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) A::fstore(y[r], out[r]);
}

template <class A, int Bits, bool HasM>
void matmul_groups_layout(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                          int64_t in, const uint8_t* w, float neg_offset, int64_t t0, int64_t t1, float* y,
                          int64_t y_stride) {
  constexpr int kRows = A::kSuperRows;
  static_assert(kRows <= 12, "the switch below has a case per row count up to 12");
  const int32_t* words = reinterpret_cast<const int32_t*>(xq);
  const int64_t groups = in / 32, tile_bytes = groups * outrider_native::group_block_bytes(group_code(Bits, HasM));
  const int64_t chunk = tile_chunk(rows, kRows, tile_bytes, t0, t1);  // see kTileChunkBytes
  const int32_t* x_words[kRows];
  const float* x_scale[kRows];
  const float* x_sum[kRows];
  const int32_t* x_isum[kRows];
  float* y_rows[kRows];
  for (int64_t c0 = t0; c0 < t1; c0 += chunk)
  for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
    const int64_t c1 = min64(t1, c0 + chunk);
    n = pass_rows(rows, r0, kRows);
    for (int r = 0; r < n; ++r) {
      x_words[r] = words + (r0 + r) * in / 4;
      x_scale[r] = scale + (r0 + r) * groups;
      x_sum[r] = sum + (r0 + r) * groups;
      x_isum[r] = isum + (r0 + r) * groups;
    }
    for (int64_t t = c0; t < c1; ++t) {
      for (int r = 0; r < n; ++r) y_rows[r] = y + (r0 + r) * y_stride + t * 16;
      const uint8_t* wt = w + t * tile_bytes;
      switch (n) {
#define OUTRIDER_GROUP_CASE(N) \
  case N: if constexpr (N <= kRows) group_dot<A, Bits, HasM, N>(x_words, x_scale, x_sum, x_isum, groups, wt, neg_offset, y_rows); break;
        OUTRIDER_GROUP_CASE(1)
        OUTRIDER_GROUP_CASE(2)
        OUTRIDER_GROUP_CASE(3)
        OUTRIDER_GROUP_CASE(4)
        OUTRIDER_GROUP_CASE(5)
        OUTRIDER_GROUP_CASE(6)
        OUTRIDER_GROUP_CASE(7)
        OUTRIDER_GROUP_CASE(8)
        OUTRIDER_GROUP_CASE(9)
        OUTRIDER_GROUP_CASE(10)
        OUTRIDER_GROUP_CASE(11)
        OUTRIDER_GROUP_CASE(12)
#undef OUTRIDER_GROUP_CASE
        default: break;
      }
    }
  }
}

template <class A>
void matmul_groups(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                   int64_t in, const uint8_t* w, int bits, int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  const float neg_offset = outrider_native::minimum_offset(bits);
  const bool has_m = neg_offset == 0.f;
  switch ((bits & 15) * 2 + (has_m ? 1 : 0)) {
    case 8: matmul_groups_layout<A, 4, false>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
    case 9: matmul_groups_layout<A, 4, true>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
    case 10: matmul_groups_layout<A, 5, false>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
    case 11: matmul_groups_layout<A, 5, true>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
    case 16: matmul_groups_layout<A, 8, false>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
    default: matmul_groups_layout<A, 8, true>(xq, scale, sum, isum, rows, in, w, neg_offset, t0, t1, y, y_stride); break;
  }
}

// ---- attention ---------------------------------------------------------------------------------

// Loads 16 lanes of p[0..n) with zeros after (n < 16), and the matching store.
template <class A>
inline typename A::F load_part(const float* p, int64_t n) {
  alignas(64) float tmp[16] = {0};
  for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
  return A::fload(tmp);
}

template <class A>
inline void store_part(float* p, typename A::F v, int64_t n) {
  alignas(64) float tmp[16];
  A::fstore(tmp, v);
  for (int64_t i = 0; i < n; ++i) p[i] = tmp[i];
}

// A KV cache row of `d` values in storage T, read 16 lanes at a time: fp32 as it is, fp16 widened
// (exactly), or q8_0 (T int8_t: the d int8 values, then d / 32 fp16 scales; lanes q * scale).
template <class T>
struct KvRows;
template <>
struct KvRows<float> {
  static constexpr int64_t stride(int64_t d) { return d; }  // elements a row
  template <class A>
  static typename A::F load(const float* row, int64_t, int c) { return A::fload(row + 16 * c); }
};
template <>
struct KvRows<uint16_t> {
  static constexpr int64_t stride(int64_t d) { return d; }
  template <class A>
  static typename A::F load(const uint16_t* row, int64_t, int c) { return A::load_half(row + 16 * c); }
};
template <>
struct KvRows<int8_t> {
  static constexpr int64_t stride(int64_t d) { return d + d / 16; }  // bytes a row: values, then fp16 scales
  template <class A>
  static typename A::F load(const int8_t* row, int64_t d, int c) {
    uint16_t scale;
    std::memcpy(&scale, row + d + 2 * (c / 2), sizeof scale);
    return A::mul(A::cvt(A::load_i8(row + 16 * c)), A::fset(outrider_native::half_bits_to_float(scale)));
  }
};

// cap * tanh(s / cap) per lane (Gemma 2's attention soft-capping), tanh(x) as 1 - 2 / (exp(2x) + 1):
// one exp, as everywhere here, saturating to +-1 with exp's clamps.
template <class A>
inline typename A::F soft_cap(typename A::F s, float cap) {
  const typename A::F one = A::fset(1.f);
  const typename A::F e = exp16<A>(A::mul(s, A::fset(2.f / cap)));
  return A::mul(A::fset(cap), A::sub(one, A::div(A::fset(2.f), A::add(e, one))));
}

// scores[i] = q . k[pos[i]] for one head (dim = 16 * C), soft-capped where cap > 0, then softmax in place.
template <class A, int C, class T>
void softmax_scores(const float* q, const T* keys, const int64_t* pos, int64_t count, float* scores, float cap) {
  using F = typename A::F;
  F qv[C];
  for (int c = 0; c < C; ++c) qv[c] = A::fload(q + 16 * c);
  for (int64_t i0 = 0; i0 < count; i0 += 16) {
    const int64_t n = min64(16, count - i0);
    F v[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= n) {
        v[j] = A::fzero();
        continue;
      }
      const T* k = keys + pos[i0 + j] * KvRows<T>::stride(16 * C);
      v[j] = A::mul(qv[0], KvRows<T>::template load<A>(k, 16 * C, 0));
      for (int c = 1; c < C; ++c) v[j] = A::fma(qv[c], KvRows<T>::template load<A>(k, 16 * C, c), v[j]);
    }
    F s = A::sum16(v);
    if (cap > 0.f) s = soft_cap<A>(s, cap);
    if (n == 16)
      A::fstore(scores + i0, s);
    else
      store_part<A>(scores + i0, s, n);
  }
  float top = scores[0];
  for (int64_t i = 1; i < count; ++i) top = scores[i] > top ? scores[i] : top;
  const F shift = A::fset(top);
  F total = A::fzero();
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = min64(16, count - i);
    if (n == 16) {
      const F e = exp16<A>(A::sub(A::fload(scores + i), shift));
      A::fstore(scores + i, e);
      total = A::add(total, e);
    } else {
      // Lanes past the end enter the total as zeros.
      const F e = load_part<A>(scores + i, n);
      alignas(64) float tmp[16] = {0};
      store_part<A>(tmp, exp16<A>(A::sub(e, shift)), n);
      for (int64_t k = 0; k < n; ++k) scores[i + k] = tmp[k];
      total = A::add(total, A::fload(tmp));
    }
  }
  const F inv = A::fset(1.f / tree16_of<A>(total));
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t n = min64(16, count - i);
    if (n == 16)
      A::fstore(scores + i, A::mul(A::fload(scores + i), inv));
    else
      store_part<A>(scores + i, A::mul(load_part<A>(scores + i, n), inv), n);
  }
}

// out[g] = sum_i probs[g][i] v[pos[i]] for G heads that share these values (one load of v each).
template <class A, int C, int G, class T>
void weighted_values(const T* values, const int64_t* pos, int64_t count, const float* const* probs,
                     float* const* out) {
  using F = typename A::F;
  F acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = A::fzero();
  for (int64_t i = 0; i < count; ++i) {
    const T* v = values + pos[i] * KvRows<T>::stride(16 * C);
    F vv[C];
    for (int c = 0; c < C; ++c) vv[c] = KvRows<T>::template load<A>(v, 16 * C, c);
    for (int g = 0; g < G; ++g) {
      const F p = A::fset(probs[g][i]);
      for (int c = 0; c < C; ++c) acc[g][c] = A::fma(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) A::fstore(out[g] + 16 * c, acc[g][c]);
}

template <class A, int C, class T>
void attend_group_c(const float* q, int64_t group, const T* keys, const T* values, const int64_t* pos,
                    int64_t count, float* scores, float* out, float cap) {
  constexpr int64_t d = 16 * C;
  for (int64_t g = 0; g < group; ++g)
    softmax_scores<A, C, T>(q + g * d, keys, pos, count, scores + g * (count + 16), cap);
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const float* probs[4];
    float* outs[4];
    const int64_t n = min64(group - g0, 4);
    for (int64_t g = 0; g < n; ++g) {
      probs[g] = scores + (g0 + g) * (count + 16);
      outs[g] = out + (g0 + g) * d;
    }
    switch (n) {
      case 1: weighted_values<A, C, 1, T>(values, pos, count, probs, outs); break;
      case 2: weighted_values<A, C, 2, T>(values, pos, count, probs, outs); break;
      case 3: weighted_values<A, C, 3, T>(values, pos, count, probs, outs); break;
      default: weighted_values<A, C, 4, T>(values, pos, count, probs, outs); break;
    }
  }
}

template <class A, class T = float>
void attend_group(const float* q, int64_t group, int64_t dim, const T* keys, const T* values,
                  const int64_t* pos, int64_t count, float* scores, float* out, float cap) {
  switch (dim) {
    case 16: attend_group_c<A, 1, T>(q, group, keys, values, pos, count, scores, out, cap); break;
    case 32: attend_group_c<A, 2, T>(q, group, keys, values, pos, count, scores, out, cap); break;
    case 64: attend_group_c<A, 4, T>(q, group, keys, values, pos, count, scores, out, cap); break;
    case 128: attend_group_c<A, 8, T>(q, group, keys, values, pos, count, scores, out, cap); break;
    default: attend_group_c<A, 16, T>(q, group, keys, values, pos, count, scores, out, cap); break;  // 256 (checked)
  }
}

// ---- the rest of a layer -------------------------------------------------------------------------

// y = x * (1 / sqrt(mean(x^2) + eps)) * w per row; hidden % 16 == 0.
template <class A>
void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t hidden, float* y) {
  using F = typename A::F;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    F acc = A::fzero();
    for (int64_t k = 0; k < hidden; k += 16) {
      const F v = A::fload(xr + k);
      acc = A::fma(v, v, acc);
    }
    const F inv = A::fset(1.f / std::sqrt(tree16_of<A>(acc) / static_cast<float>(hidden) + eps));
    for (int64_t k = 0; k < hidden; k += 16)
      A::fstore(y + r * hidden + k, A::mul(A::mul(A::fload(xr + k), inv), A::fload(w + k)));
  }
}

// y = silu(gate) * up per row of gate_up = [gate | up] (each `inter` wide, inter % 16 == 0).
template <class A>
void swiglu_rows(const float* gate_up, int64_t rows, int64_t inter, float* y) {
  using F = typename A::F;
  const F one = A::fset(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    for (int64_t k = 0; k < inter; k += 16) {
      const F gate = A::fload(g + k);
      const F sig = A::div(one, A::add(one, exp16<A>(A::sub(A::fzero(), gate))));
      A::fstore(y + r * inter + k, A::mul(A::mul(gate, sig), A::fload(g + inter + k)));
    }
  }
}

// y = gelu_tanh(gate) * up per row (GeGLU, Gemma's MLP): gelu_tanh(g) = 0.5 g (1 + tanh(u)), u =
// sqrt(2 / pi) (g + 0.044715 g^3), computed as g sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) =
// 1 / (1 + exp(-2u))), so one exp a lane as in SwiGLU.
template <class A>
void geglu_rows(const float* gate_up, int64_t rows, int64_t inter, float* y) {
  using F = typename A::F;
  const F one = A::fset(1.f), c = A::fset(-2.f * 0.7978845608028654f), cube = A::fset(0.044715f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    for (int64_t k = 0; k < inter; k += 16) {
      const F gate = A::fload(g + k);
      const F inner = A::fma(A::mul(cube, A::mul(gate, gate)), gate, gate);  // g + 0.044715 g^3
      const F sig = A::div(one, A::add(one, exp16<A>(A::mul(c, inner))));
      A::fstore(y + r * inter + k, A::mul(A::mul(gate, sig), A::fload(g + inter + k)));
    }
  }
}

template <class A>
void add_rows(float* x, const float* y, int64_t count) {
  int64_t k = 0;
  for (; k + 16 <= count; k += 16) A::fstore(x + k, A::add(A::fload(x + k), A::fload(y + k)));
  for (; k < count; ++k) x[k] += y[k];
}

// The table entry for `A`, with its own matmul (the generic one unless the file has a faster one).
#define OUTRIDER_KERNELS(A, MATMUL) \
  { A::kName, quantize_rows<A>, MATMUL, matmul_super<A>, matmul_groups<A>, attend_group<A, float>, attend_group<A, uint16_t>, \
    attend_group<A, int8_t>, \
    rms_norm_rows<A>, swiglu_rows<A>, geglu_rows<A>, add_rows<A> }
