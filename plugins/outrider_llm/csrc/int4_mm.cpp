// y = x @ W.T for group-wise 4-bit W (w = q * d + m per group, q in 0..15) and bf16 x, on AMX
// (Intel Sapphire Rapids and later) or, without it, AVX512-BF16.
//
// Why it exists: torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) dequantizes to fp32 and
// runs fp32 FMAs per row, so its cost grows about linearly with rows: a speculative verify step of
// 4-8 rows costs 1.5-3x a 1-row decode step. On AMX one tile multiply serves up to 16 rows, so
// verification costs about a decode step. The per-group scale and minimum are applied once per
// group in fp32: sum_k w_k x_k = d * sum_k q_k x_k + m * sum_k x_k, with d and m kept in fp16 (a
// GGUF Q4_1 file's own values; torch's kernel rounds them to bf16).
//
// Every output is computed by one thread, in one fixed order, whatever the number of rows or
// threads: row r's result does not depend on the other rows of the call (a 1-row decode and a
// 4-row verify give the target the same logits for the same prefix).
//
// Layout (built by outrider_llm.native.pack_int4_tiles):
//   w  uint8 [N/16, K/4, 32]: per tile of 16 outputs, per 4 inputs k0..k0+3, byte 2i+p holds
//      q[16t+i, k0+p] in its low nibble and q[16t+i, k0+2+p] in its high nibble;
//   d, m  fp16 [N/16, K/G, 16]: scale and minimum of each (group, output).
// Output fp32 [M, N].

#if defined(__x86_64__) || defined(_M_X64)  // AMX and AVX512-BF16 only: nothing to build elsewhere

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kTile = 16;  // outputs per tile: one fp32 zmm

#define OUTRIDER_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

// One 32-byte block of the layout (4 inputs x 16 outputs) as two bf16 registers of 128 + q:
// input pairs (k0, k0+1) in `lo`, (k0+2, k0+3) in `hi`, output i in lane i. bf16 0x4300 | q is
// exactly 128 + q (q < 128): one OR per value instead of a conversion; the 128 * sum(x) this adds
// is taken out with the minimum's term (m - 128 d) in both paths below.
OUTRIDER_TARGET __attribute__((always_inline)) inline void expand_block(const uint8_t* block, __m512i& lo, __m512i& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  lo = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi16(0x000F)), _mm512_set1_epi16(0x4300));
  hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi16(0x4300));
}

// ---- AVX512-BF16: vdpbf16ps, R rows x T tiles of accumulators -------------------------------------
//
// sum_k w_k x_k = d * C + (m - 128 d) * sum_k x_k with C = sum_k (128 + q_k) x_k (expand_block),
// summed in input order (vdpbf16ps takes the odd input of a pair first, so
// both operands come with their halves swapped); the AMX path below applies the same scaling.

template <int R, int T>
OUTRIDER_TARGET void dp_tiles(const int32_t* const* x_swapped, const float* xsum, int64_t groups,
                              int64_t quads_per_group, int64_t quads, const uint8_t* w, const uint16_t* d,
                              const uint16_t* m, float* const* y) {
  const __m512 offset = _mm512_set1_ps(128.f);
  __m512 out[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r][t] = _mm512_setzero_ps();
  int64_t pair = 0;  // index of the current (x[k], x[k+1]) pair, as one int32
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t q = 0; q < quads_per_group; ++q, pair += 2) {
      __m512i w_lo[T], w_hi[T];
      for (int t = 0; t < T; ++t) {
        expand_block(w + (t * quads + g * quads_per_group + q) * 32, w_lo[t], w_hi[t]);
        w_lo[t] = _mm512_rol_epi32(w_lo[t], 16);
        w_hi[t] = _mm512_rol_epi32(w_hi[t], 16);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x_lo = _mm512_set1_epi32(x_swapped[r][pair]);
        const __m512i x_hi = _mm512_set1_epi32(x_swapped[r][pair + 1]);
        for (int t = 0; t < T; ++t) {
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w_lo[t], (__m512bh)x_lo);
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w_hi[t], (__m512bh)x_hi);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (t * groups + g) * kTile)));
      const __m512 minimum = _mm512_fnmadd_ps(offset, scale, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(m + (t * groups + g) * kTile))));
      for (int r = 0; r < R; ++r) {
        out[r][t] = _mm512_fmadd_ps(acc[r][t], scale, out[r][t]);
        out[r][t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[r * groups + g]), out[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y[r] + t * kTile, out[r][t]);
}

constexpr int kDpRows = 4;  // rows per pass of the dp kernel
using DpFn = void (*)(const int32_t* const*, const float*, int64_t, int64_t, int64_t, const uint8_t*,
                      const uint16_t*, const uint16_t*, float* const*);
// [rows - 1][0]: 4 tiles at once (2 for 3-4 rows, register budget), [rows - 1][1]: one tile (the tail).
constexpr DpFn kDpFns[kDpRows][2] = {{dp_tiles<1, 4>, dp_tiles<1, 1>},
                                     {dp_tiles<2, 4>, dp_tiles<2, 1>},
                                     {dp_tiles<3, 2>, dp_tiles<3, 1>},
                                     {dp_tiles<4, 2>, dp_tiles<4, 1>}};
constexpr int kDpTiles[kDpRows] = {4, 4, 2, 2};

// ---- AMX: one tile multiply per (16 outputs, 32 inputs), for up to 16 rows at once ----------------
//
// The 4-bit values of one group become a bf16 B tile in VNNI layout (16 rows of input pairs x 16
// outputs: exactly the registers expand_block gives, stored one after the other); the rows
// of x are the A tile; C = A B is this group's sum of q * x per (row, output), scaled into the
// fp32 output as above. Cost barely grows with rows: the tile multiply is the same for 1 or 16.

#define OUTRIDER_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

constexpr int kAmxRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

OUTRIDER_AMX_TARGET void amx_tiles(const uint16_t* x_block /* [rows, in] bf16 */, int64_t in,
                                   const float* xsum /* [rows, groups] */, int rows, int64_t groups,
                                   const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t tile_begin,
                                   int64_t tile_end, float* y /* row 0 of this block */, int64_t out) {
  TileConfig config;
  config.rows[0] = config.rows[3] = rows;  // C (two, alternating): rows x 16 fp32
  config.colsb[0] = config.colsb[3] = 64;
  config.rows[1] = rows;                   // A: rows x 32 bf16
  config.colsb[1] = 64;
  config.rows[2] = config.rows[4] = 16;    // B (two): 16 input pairs x 16 outputs x 2 bf16
  config.colsb[2] = config.colsb[4] = 64;
  _tile_loadconfig(&config);
  const __m512 offset = _mm512_set1_ps(128.f);
  // One output tile at a time, in three passes, so that no tile load waits for the stores just
  // before it (AMX loads do not forward from the store buffer): every group's B tile is built
  // first, then the tile multiplies run back to back, then the per-group scaling.
  const int64_t quads = in / 4, quads_per_group = quads / groups;  // 8 for groups of 32
  // Per-thread scratch, kept between calls (a fresh allocation per call costs more than a small matmul).
  thread_local std::vector<uint16_t> b_store;
  thread_local std::vector<float> c_store;
  b_store.resize(static_cast<size_t>(groups) * 16 * 32 + 32);
  c_store.resize(static_cast<size_t>(groups) * rows * 16 + 16);
  uint16_t* b_tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(b_store.data()) + 63) & ~uintptr_t(63));
  float* c_tiles = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(c_store.data()) + 63) & ~uintptr_t(63));
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const uint8_t* wt = w + t * quads * 32;
    for (int64_t j = 0; j < quads; ++j) {
      __m512i lo, hi;
      expand_block(wt + j * 32, lo, hi);
      _mm512_store_si512(b_tiles + (2 * j) * 32, lo);
      _mm512_store_si512(b_tiles + (2 * j + 1) * 32, hi);
    }
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(1, x_block + g * quads_per_group * 4, in * 2);
      if (g & 1) {
        _tile_zero(3);
        _tile_loadd(4, b_tiles + g * 16 * 32, 64);
        _tile_dpbf16ps(3, 1, 4);
        _tile_stored(3, c_tiles + g * rows * 16, 64);
      } else {
        _tile_zero(0);
        _tile_loadd(2, b_tiles + g * 16 * 32, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, c_tiles + g * rows * 16, 64);
      }
    }
    __m512 acc[kAmxRows];
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (t * groups + g) * kTile)));
      const __m512 minimum = _mm512_fnmadd_ps(offset, scale, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(m + (t * groups + g) * kTile))));
      const float* c_tile = c_tiles + g * rows * 16;
      for (int r = 0; r < rows; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c_tile + r * 16), scale, acc[r]);
        acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
      }
    }
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * out + t * kTile, acc[r]);
  }
  _tile_release();
}

bool amx_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    // Linux hands out the AMX register state only on request (once per process).
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool has_amx() { return amx_usable(); }

// path: -1 AMX where it runs (groups of 32), else vdpbf16ps; 0 forces vdpbf16ps, 1 AMX (tests).
// One path serves every call of a process: the two round differently (AMX sums a group's
// products in its own order), so mixing them would make a row's result depend on the call.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size, int64_t path) {
  TORCH_CHECK(cpu_supported(), "outrider::int4_mm needs AVX512-BF16, which this CPU lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "outrider::int4_mm: x must be contiguous bf16 [rows, in], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == 32 && w.is_contiguous(),
              "outrider::int4_mm: w must be contiguous uint8 [out/16, in/4, 32], got ", w.sizes());
  const int64_t rows = x.size(0), in = x.size(1), tiles = w.size(0), out = tiles * kTile;
  TORCH_CHECK(w.size(1) * 4 == in, "outrider::int4_mm: w holds ", w.size(1) * 4, " inputs, x has ", in);
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0 && in % group_size == 0,
              "outrider::int4_mm: group_size must be a multiple of 4 dividing ", in, ", got ", group_size);
  const int64_t groups = in / group_size;
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == groups && t->size(2) == kTile,
                "outrider::int4_mm: scales and minimums must be contiguous fp16 [", tiles, ", ", groups,
                ", 16], got ", t->sizes(), " ", t->scalar_type());
  }
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;

  // Per row and group: the sum of its bf16 inputs, for the minimum's term.
  // Per-thread scratch, kept between calls; the parallel regions below read it through plain
  // pointers (a thread_local named inside them would be each worker's own, empty, copy).
  thread_local std::vector<float> xsum_store;
  xsum_store.resize(rows * groups);
  float* const xsum = xsum_store.data();
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        uint32_t bits = static_cast<uint32_t>(xb[r * in + k]) << 16;
        float value;
        std::memcpy(&value, &bits, 4);
        sum += value;
      }
      xsum[r * groups + g] = sum;
    }
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t quads = in / 4, quads_per_group = group_size / 4;
  const bool amx = group_size == 32 && amx_usable();
  TORCH_CHECK(path != 1 || amx, "outrider::int4_mm: the AMX path needs AMX and groups of 32");
  if (path == 1 || (path == -1 && amx)) {
    // Rows in blocks of up to 16 (the A and C tiles' rows).
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
      const int n = static_cast<int>(std::min<int64_t>(kAmxRows, rows - r0));
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        amx_tiles(xb + r0 * in, in, xsum + r0 * groups, n, groups, wp, dp, mp, begin, end, yp + r0 * out, out);
      });
    }
    return y;
  }
  // Input pairs with their halves swapped, for vdpbf16ps (see dp_tiles).
  thread_local std::vector<int32_t> x_swapped_store;
  x_swapped_store.resize(rows * in / 2);
  int32_t* const x_swapped = x_swapped_store.data();
  for (int64_t i = 0; i < rows * in / 2; ++i) {
    x_swapped[i] = static_cast<int32_t>(static_cast<uint32_t>(xb[2 * i + 1]) | (static_cast<uint32_t>(xb[2 * i]) << 16));
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int32_t* x_rows[kDpRows];
    float* y_rows[kDpRows];
    for (int64_t r0 = 0; r0 < rows; r0 += kDpRows) {
      const int n = static_cast<int>(std::min<int64_t>(kDpRows, rows - r0));
      for (int r = 0; r < n; ++r) x_rows[r] = x_swapped + (r0 + r) * in / 2;
      for (int64_t t = begin; t < end;) {
        const int step = t + kDpTiles[n - 1] <= end ? kDpTiles[n - 1] : 1;
        for (int r = 0; r < n; ++r) y_rows[r] = yp + (r0 + r) * out + t * kTile;
        kDpFns[n - 1][step == 1](x_rows, xsum + r0 * groups, groups, quads_per_group, quads,
                                  wp + t * quads * 32, dp + t * groups * kTile, mp + t * groups * kTile, y_rows);
        t += step;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(outrider, lib) {
  lib.def("int4_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size, int path=-1) -> Tensor");
  lib.def("int4_mm_has_amx", &has_amx);
}

TORCH_LIBRARY_IMPL(outrider, CPU, lib) { lib.impl("int4_mm", int4_mm); }

#endif
