// Outrider's native CPU kernels: the torch-free core (plain pointers), one implementation per
// instruction set behind one table, chosen once at load from the CPU's features.
//
// Layout as ggml-cpu's: the scalar code (isa_scalar.cpp, on the generic templates of
// isa_generic.h) defines every result; each SIMD file (isa_x86_*.cpp, isa_arm_*.cpp) computes the
// same arithmetic, operation for operation, so every path agrees with the scalar reference bit for
// bit: the integer sums are exact, and the float epilogue, exp, the reductions and the softmax run
// the same IEEE operations (fused where the reference fuses, std::fma) in the same order. The whole
// core is compiled with -ffp-contract=off, so no compiler fuses what the reference does not.
//
// Torch binds it in torch_ops.cpp; check_kernels.cpp drives it without torch (the cross-compiled
// ARM test under qemu).

#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

#include "c_api.h"  // the layer table's plain C structs (OutriderLayer), which the layer body reads

namespace outrider_native {

constexpr int64_t kTile = 16;  // outputs per weight tile (and the width of every vector below)
constexpr int kF32Scales = 16;  // or-ed into `bits` (4, 5 or 8): d and m are fp32, not fp16
// `bits` may also carry log2(offset) << 8 for a symmetric type (w = (q - offset) d: Q8_0, Q6_K,
// Q5_0): then m is null and each minimum is -offset * d, exactly the table's value, in no bytes.
constexpr int kOffsetShift = 8;
inline int with_offset(int bits, int log2_offset) { return bits | (log2_offset << kOffsetShift); }
inline float minimum_offset(int bits) {  // -offset, or 0 where m is a table
  const int log2_offset = (bits >> kOffsetShift) & 15;
  return log2_offset ? -static_cast<float>(1 << log2_offset) : 0.f;
}

// A GGUF K type at the file's own bytes: `bits` = kSuperBlocks | 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K);
// w holds everything (no d, m tables), in super-blocks of kSuper inputs, per tile of 16 outputs:
//   Q4_K, Q5_K: d[16] fp16, dmin[16] fp16, sc[8][16] uint8, mn[8][16] uint8 (the file's 6-bit sub-block
//               scales and minimums, one byte each), then 32 octs of the 4-bit (64 B) or 5-bit (80 B)
//               layout below: 2368 or 2880 bytes, 4.625 / 5.625 bits a weight (the file: 4.5 / 5.5);
//   Q6_K:       d[16] fp16, sc[16][16] int8, then 32 octs of 96 B: the 4-bit layout's 64 bytes of low
//               nibbles, then 16 + 16 bytes of the values' 2-bit high parts (lane L of the low, then of
//               the high nibbles: byte L % 16, bits 2 (L / 16)): 3360 bytes, 6.5625 bits (the file's).
// Computed as ggml's vec_dot_q4_K_q8_K: activations in int8 per 256 with one scale and int32 sums
// per 16; per group of 32 (Q6_K: 16) the exact integer dot, times the integer sub-block scale,
// summed exactly; the minimums (Q6_K: the offset 32) through the activations' sums; then one float
// multiply-add per 256 inputs and output. Integer throughout but the last step: every kernel set
// computes the same bits.
constexpr int kSuperBlocks = 32;
constexpr int64_t kSuper = 256;
inline bool is_super(int bits) { return (bits & kSuperBlocks) != 0; }

// The simple GGUF types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with each group's scales beside its values:
// bits = kGroupBlocks | 4, 5 or 8 (| log2(offset) << kOffsetShift for a symmetric type, which has no
// minimums); per tile of 16 outputs and group of 32 inputs: d[16] fp16, m[16] fp16 (not for a
// symmetric type), then the group's values in the 4-, 5- or 8-bit layout below (4 x 64, 4 x 80 or 8 x
// 64 bytes): the file's bits a weight, and one stream of bytes a tile. Computed as the separate tables'
// layout is (matmul_tiles), operation for operation: the same results bit for bit.
constexpr int kGroupBlocks = 64;
inline bool is_group_blocks(int bits) { return (bits & kGroupBlocks) != 0; }
constexpr int64_t group_block_bytes(int bits) {
  const int layout = bits & 15;
  const int64_t values = layout == 4 ? 256 : layout == 5 ? 320 : layout == 8 ? 512 : 0;
  return values == 0 ? 0 : values + ((bits >> kOffsetShift) & 15 ? 32 : 64);
}
constexpr int64_t super_block_bytes(int layout) {
  return layout == 4 ? 2368 : layout == 5 ? 2880 : layout == 6 ? 3360 : 0;
}

// One instruction set's kernels. Weight layouts (outrider_llm.native.pack_w4a8 / pack_w8a8):
//   4-bit: w uint8 [N/16, K/8, 64]: per tile of 16 outputs, per 8 inputs k0..k0+7, byte 4i+p holds
//          q[16t+i, k0+p] in its low nibble and q[16t+i, k0+4+p] in its high nibble;
//   5-bit: w uint8 [N/16, K/8, 80]: per tile and 8 inputs, the 4-bit layout's 64 bytes of low
//          nibbles, then 16 bytes of fifth bits: bit L of bytes 0..7 for lane L of inputs k0..k0+3
//          (lane 4i+p: output i, input k0+p), bytes 8..15 the same for k0+4..k0+7 (Q5_0/Q5_1/Q5_K);
//   8-bit: w uint8 [N/16, K/4, 64]: per tile, per 4 inputs k0..k0+3, byte 4i+p holds q[16t+i, k0+p];
//   d, m   fp16 [N/16, K/G, 16]: scale and minimum of each (group, output); w = q * d + m;
//          or fp32, the same shape, where `bits` carries kF32Scales (a GGUF K type's sub-block
//          scale d * sc needs up to 18 significant bits: fp16 would round it).
struct KernelSet {
  const char* name;  // "scalar", "avx2", "avx_vnni", "avx512_vnni", "neon", "neon_dotprod", "neon_i8mm"
  // Activations to int8 per row and group of `group` (scale amax / 127, round to nearest even):
  // xq [rows, in]; per (row, group): scale, scale * sum(xq), sum(xq).
  void (*quantize_rows)(const float* x, int64_t rows, int64_t in, int64_t group, int8_t* xq, float* scale,
                        float* sum, int32_t* isum);
  // y[r, 16t .. 16t+15] for tiles t0 <= t < t1, every row: y = xq @ W.T, W in the 4- or 8-bit layout.
  void (*matmul_tiles)(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                       int64_t in, int64_t group, const uint8_t* w, const void* d, const void* m, int64_t out,
                       int bits, int64_t t0, int64_t t1, float* y, int64_t y_stride);
  // The same for a super-block layout (kSuperBlocks | 4, 5 or 6): xq quantized per 256 (scale per
  // row and 256), bsum: int32 sums of xq per row and 16 inputs.
  void (*matmul_super)(const int8_t* xq, const float* scale, const int32_t* bsum, int64_t rows, int64_t in,
                       const uint8_t* w, int layout, int64_t t0, int64_t t1, float* y, int64_t y_stride);
  // The same for a group-block layout (kGroupBlocks | ...): activations as matmul_tiles takes them, group 32.
  void (*matmul_groups)(const int8_t* xq, const float* scale, const float* sum, const int32_t* isum, int64_t rows,
                        int64_t in, const uint8_t* w, int bits, int64_t t0, int64_t t1, float* y, int64_t y_stride);
  // One row and KV head: `group` query heads (q[g * dim ..]) over the keys and values at `pos`
  // (count of them; rows of `dim` floats); scores: scratch of group * (count + 16) floats; cap > 0:
  // each score soft-capped to cap * tanh(score / cap) before the softmax (Gemma 2).
  void (*attend_group)(const float* q, int64_t group, int64_t dim, const float* keys, const float* values,
                       const int64_t* pos, int64_t count, float* scores, float* out, float cap);
  // The same over an fp16 cache (keys and values widened to fp32 as they are read).
  void (*attend_group_f16)(const float* q, int64_t group, int64_t dim, const uint16_t* keys, const uint16_t* values,
                           const int64_t* pos, int64_t count, float* scores, float* out, float cap);
  // The same over a q8_0 cache: rows of dim int8 values and dim / 32 fp16 scales (kv_row_bytes).
  void (*attend_group_q8)(const float* q, int64_t group, int64_t dim, const int8_t* keys, const int8_t* values,
                          const int64_t* pos, int64_t count, float* scores, float* out, float cap);
  void (*rms_norm_rows)(const float* x, const float* w, float eps, int64_t rows, int64_t hidden, float* y);
  void (*swiglu_rows)(const float* gate_up, int64_t rows, int64_t inter, float* y);  // silu(gate) * up
  void (*geglu_rows)(const float* gate_up, int64_t rows, int64_t inter, float* y);   // gelu_tanh(gate) * up
  void (*add_rows)(float* x, const float* y, int64_t count);                            // x += y
};

extern const KernelSet kScalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const KernelSet kAvx2, kAvxVnni, kAvx512Vnni;
#endif
#if defined(__aarch64__)
extern const KernelSet kNeon, kNeonDotprod, kNeonI8mm;
#endif

// Every kernel set this build holds, best first (the scalar reference last), and whether this CPU runs it.
int kernel_set_count();
const KernelSet& kernel_set(int index);
bool cpu_runs(const KernelSet& set);

// The set every call uses: the best this CPU runs, or the one named by OUTRIDER_NATIVE_ISA, or by
// select_kernels. select_kernels returns false (and changes nothing) for a name this CPU cannot run.
const KernelSet& active_kernels();
bool select_kernels(const char* name);

// What the CPU has, as the dispatcher read it (cpuid on x86, HWCAP on ARM): e.g. "avx2 fma f16c".
const char* cpu_features();

// Supplied by the binding (torch: at::parallel_for; check_kernels: a plain loop): fn(begin, end)
// over [0, n) in chunks, possibly on several threads.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

// ---- operations on whole tensors (ops.cpp), every one on active_kernels() ------------------------

// y [rows, out] = x [rows, in] (fp32, quantized here per row and group) @ W.T.
void a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
               const void* m, int64_t out, int bits, float* y);
// The same with row r of y at y + r * y_stride (y_stride >= out): a part of a wider output (c_api.cpp's
// layer stack fills q | k | v and gate | up side by side this way).
void a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
               const void* m, int64_t out, int bits, float* y, int64_t y_stride);

// Up to kMaxParts weights over the same x, part p into columns [its offset, + its out) of y
// (OutriderMatrix: q | k | v, gate | up) in one call: x quantized once per activation format, one
// parallel region. Every output is computed as a8_matmul computes it, bit for bit.
constexpr int kMaxParts = sizeof(OutriderMatrix::parts) / sizeof(OutriderPart);  // the layer table's parts
void a8_matmul_parts(const float* x, int64_t rows, int64_t in, const OutriderPart* parts, int count, float* y,
                     int64_t y_stride);

// fp32 -> IEEE fp16, rounded to nearest even (ops.cpp; the fp16 KV cache's writes), and fp16 -> fp32,
// exact (the scalar reference's lanes, the packer's row lookups).
uint16_t float_to_half(float value);
float half_to_float(uint16_t h);

// fp16 bits -> fp32, exactly (the same values as half_to_float: check_kernels compares all 65,536), inline: a q8_0 cache reads one scale every
// 32 values, where a call into another file cost more than the lanes' arithmetic.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa x 2^-24, normalized
    int shifts = 0;
    while (!(mantissa & 0x400u)) mantissa <<= 1, ++shifts;
    bits = sign | (static_cast<uint32_t>(113 - shifts) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}


// RoPE in place on the first `heads` heads of each row of qkv (rows of `width` floats):
// p' = p * cos + rotate_half(p) * sin, sin carrying rotate_half's sign (ops.cpp).
void rope_rows(float* qkv, const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t d,
               int64_t width);

// Bytes of a q8_0 KV row of `dim` values: the int8 values, then dim / 32 fp16 scales.
constexpr int64_t q8_row_bytes(int64_t dim) { return dim + dim / 16; }
// A row of `dim` floats (a multiple of 32) as q8_0, as ggml's quantize_row_q8_0_ref (plain C++: the
// same bytes on every path).
void quantize_q8_row(const float* x, int64_t dim, int8_t* row);

// One layer's attention for the chunks of a step (attend.cpp's contract, see ops.cpp).
struct KvLayer {
  void* data;  // [2, slots, kv_heads, capacity, dim] of fp32, fp16 (f16), or q8_0 rows (q8: bytes)
  int64_t slots, capacity, s_half, s_slot, s_head;  // strides in elements (q8: bytes)
  bool f16 = false;  // K and V stored as IEEE fp16 (rounded to nearest even as written), read widened
  // A sliding layer's ring: the row of cache index i is i % capacity, and the capacity holds the
  // window and a step's rows (checked by the caller), so no row a step reads is overwritten by it.
  bool ring = false;
  bool q8 = false;  // K and V stored as q8_0 (ggml's: per 32 values an fp16 scale amax / 127, int8 values)
};
// window > 0: a row at position p (positions[row]) sees no key at position p - window or before (a
// committed key's position is its row in the cache; a fed one's, its row's). softcap > 0: scores
// soft-capped (Gemma 2).
void attend(const float* qkv, int64_t total, const KvLayer& kv, const int64_t* chunks, int64_t chunk_count,
            const bool* visible, int64_t visible_width, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
            float* out, int64_t window = 0, const int64_t* positions = nullptr, float softcap = 0.f);

// Every decoder layer of a step (layers.cpp): the one layer body both bindings run. kv: one per layer;
// chunks and visible as attend's; cos and sin [rope_tables, rows, dim]; positions: each row's (needed by
// a layer with a window). The caller has checked the table (c_api.cpp's checks).
void decoder_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin, int64_t rope_tables,
                    const int64_t* positions, const KvLayer* kv,
                    const OutriderLayer* layers, int64_t num_layers, const int64_t* chunks, int64_t chunk_count,
                    const bool* visible, int64_t visible_width, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                    int64_t inter, float eps);

// Every decoder layer of a step on w4a8 weights (the torch ops' form: decoder_layers with one 4-bit
// part a matrix, fp16 tables, groups of `group`).
struct LayerWeights {
  const float* attn_norm;
  const float* mlp_norm;
  const uint8_t* w[4];  // qkv, o, gate_up, down
  const uint16_t* d[4];
  const uint16_t* m[4];
};
void w4a8_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin, const KvLayer* kv,
                 const LayerWeights* layers, int64_t num_layers, const int64_t* chunks, int64_t chunk_count,
                 const bool* visible, int64_t visible_width, int64_t group, int64_t num_heads, int64_t num_kv_heads,
                 int64_t dim, int64_t inter, float eps);

// ---- GGUF blocks into the kernels' layouts (gguf_pack.cpp: plain C++, the same on every path) -------

// GGML's type ids of the block types packed here.
enum GgmlType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// How `type` is packed for `cols` inputs (super blocks or group blocks: w alone): the bits code, group,
// and bytes per tile of w; false (with `why`) where it cannot be.
struct PackedShape {
  int bits;
  int64_t group, w_tile_bytes;
};
bool packed_shape(int type, int64_t cols, bool five_bit, PackedShape* shape, const char** why);

// Tiles [t0, t1) of a tensor of GGUF blocks src (src_rows rows of `cols` inputs) in the layout of
// `shape`: output row r is source row row_map[r] (row_map null: r), zeros where that is < 0 or r >=
// src_rows without a map. w: the whole output.
void pack_gguf_tiles(int type, const PackedShape& shape, const uint8_t* src, int64_t src_rows, int64_t cols,
                     const int64_t* row_map, int64_t t0, int64_t t1, uint8_t* w);

// fp32 [n, in] rows `ids` (tile * 16 + lane) of a super-block weight, as gguf-py dequantizes the file,
// or of a group-block weight (bits: its code), as q d + m (the separate tables' row lookups).
void dequantize_super_rows(const uint8_t* w, int layout, int64_t in, const int64_t* ids, int64_t n, float* out);
void dequantize_group_rows(const uint8_t* w, int bits, int64_t in, const int64_t* ids, int64_t n, float* out);

// The chunk table's checks (an error message, or empty when it fits).
// ring_window > 0: the cache is a ring for that window (a chunk's rows + window - 1 must fit the
// capacity, not its length + rows).
const char* check_chunks(const int64_t* chunks, int64_t chunk_count, int64_t total, int64_t slots, int64_t capacity,
                         int64_t visible_width, bool causal, char* message, int64_t message_size,
                         int64_t ring_window = 0);

}  // namespace outrider_native
