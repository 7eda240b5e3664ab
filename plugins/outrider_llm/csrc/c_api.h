/* Outrider's native CPU kernels as a plain C ABI (c_api.cpp), built into outrider_llm._native_c
 * without torch and loaded with ctypes (outrider_llm/native_c.py mirrors these structs). Plain C:
 * fixed-width fields only, so a ctypes.Structure of the same fields in the same order matches.
 *
 * Sizes are int64_t. A function whose checks can fail returns 0 on success, or nonzero with a
 * message (NUL-terminated, truncated to err_size) in err; it then computed nothing.
 *
 * `bits` of a weight: 4, 5 or 8 (its layout, kernels.h), or-ed with 16 (OUTRIDER_F32_TABLES: d and m
 * are fp32, not fp16) and with log2(offset) << 8 for a symmetric type (w = (q - offset) d, offset a
 * power of two from 2 to 32768: Q8_0 128, Q6_K 32, Q5_0 16, Q4_0 8); then m is NULL and every
 * minimum is -offset * d. As the torch ops form it (torch_ops.cpp, a8_mm).
 */
#ifndef OUTRIDER_C_API_H
#define OUTRIDER_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is compiled with -fvisibility=hidden: only these functions are exported, and the core's
 * C++ symbols bind inside it. (The torch extension `_native` holds the same core's symbols: were they
 * visible and either library loaded RTLD_GLOBAL, this one's calls to parallel_for or active_kernels
 * could bind to the other's copy, torch's thread pool and kernel choice.) */
#define OUTRIDER_API __attribute__((visibility("default")))

#define OUTRIDER_F32_TABLES 16 /* kernels.h kF32Scales */
#define OUTRIDER_GROUP_BLOCKS 64 /* kernels.h kGroupBlocks: | 4, 5 or 8 (| log2(offset) << 8), Q4_0 .. Q8_0 with
                                  their scales beside their values, group 32, w [out/16, in/32, bytes], d and m NULL */
#define OUTRIDER_SUPER_BLOCKS 32 /* kernels.h kSuperBlocks: | 4 Q4_K, 5 Q5_K, 6 Q6_K at the file's bytes, group 256,
                                  w [out/16, in/256, 2368 | 2880 | 3360], d and m NULL */
#define OUTRIDER_OFFSET_SHIFT 8 /* kernels.h kOffsetShift */

/* One weight matrix, or a part of one: uint8 w in the layout of its bits (kernels.h), tables d and m
 * [out/16, in/group, 16] (fp16 or fp32, per bits), `out` outputs (a multiple of 16), groups of
 * `group` inputs (a multiple of 16 dividing the inputs). */
typedef struct {
  const uint8_t* w;
  const void* d;
  const void* m;
  int64_t out;
  int64_t group;
  int32_t bits;
} OutriderPart;

/* Parts side by side along the outputs (q | k | v, or gate | up): part p fills columns
 * [sum of the outs before it, + its out) of the matrix's output; count 1 to 3. */
typedef struct {
  OutriderPart parts[3];
  int32_t count;
} OutriderMatrix;

/* One decoder layer (Llama; Qwen2 with qkv_bias; Qwen3 with q_norm and k_norm; Gemma 3 with the
 * post norms, GeGLU, its own RoPE table and a window on its sliding layers). Norm weights fp32.
 *   qkv [(H + 2 KV) D, hidden], o [hidden, H D], gate_up [2 inter, hidden], down [hidden, inter];
 *   qkv_bias: NULL or fp32 [(H + 2 KV) D], added after the qkv matmul;
 *   q_norm, k_norm: NULL or fp32 [D]: RMSNorm of each q (k) head after the bias, before RoPE, with
 *   the layer norms' eps. Attention takes q pre-scaled by 1/sqrt(D): in the q weights, or (with
 *   q_norm) in q_norm's weights.
 *   attn_post_norm, mlp_post_norm: NULL or fp32 [hidden]: RMSNorm of the attention's (the MLP's)
 *   output before it is added to x (Gemma 2 and 3's sandwich norms).
 *   activation: OUTRIDER_SILU (SwiGLU) or OUTRIDER_GELU_TANH (GeGLU, GELU's tanh approximation).
 *   rope_table: which of the step's RoPE tables rotates this layer's q and k (Gemma 3's sliding layers
 *   have their own base).
 *   window: 0, or the sliding window: a key `window` or more positions before its query is not seen.
 *   attn_softcap: 0, or the attention scores' soft cap (Gemma 2). */
typedef struct {
  const float* attn_norm;
  const float* mlp_norm;
  OutriderMatrix qkv, o, gate_up, down;
  const float* qkv_bias;
  const float* q_norm;
  const float* k_norm;
  float q_scale; /* 0: q comes pre-scaled (above); else q is multiplied by it after the bias and q_norm */
  int32_t activation;
  const float* attn_post_norm;
  const float* mlp_post_norm;
  int64_t rope_table;
  int64_t window;
  float attn_softcap; /* 0, or Gemma 2's: attention scores soft-capped to cap * tanh(score / cap) */
} OutriderLayer;

#define OUTRIDER_SILU 0
#define OUTRIDER_GELU_TANH 1

/* One layer's KV cache: data [2, slots, KV, capacity, D] (rows of D contiguous) with the strides of
 * its first three dimensions in floats (kernels.h KvLayer). */
typedef struct {
  void* data;
  int64_t slots, capacity, s_half, s_slot, s_head; /* strides in elements */
  int64_t f16; /* 1: the cache holds IEEE fp16 (written rounded to nearest even), 0: fp32 */
  int64_t ring; /* 1: a sliding layer's ring (its layer has a window): cache index i is row i % capacity,
                   and a chunk's rows + the window - 1 must fit the capacity */
  int64_t q8; /* 1: the cache holds q8_0 rows (f16 0): D int8 values then D / 32 fp16 scales, D + D / 16
                 bytes a row (D a multiple of 32); strides in bytes */
} OutriderKv;

/* Kernel sets and threads. */
OUTRIDER_API const char* outrider_kernels(void);              /* the set every call uses now */
OUTRIDER_API int outrider_kernel_set_count(void);             /* sets this build holds, best first, scalar last */
OUTRIDER_API const char* outrider_kernel_set_name(int index); /* NULL out of range */
OUTRIDER_API int outrider_cpu_runs(int index);                /* 1 where this CPU runs set `index` */
OUTRIDER_API int outrider_select(const char* name);           /* 1: now in use; 0: not a set this CPU runs */
OUTRIDER_API const char* outrider_cpu_features(void);
OUTRIDER_API void outrider_set_threads(int threads); /* threads of every parallel part; <= 0: the default */
OUTRIDER_API int outrider_threads(void);             /* default: omp_get_num_procs() */
/* sizeof the struct named ("OutriderPart", "OutriderMatrix", "OutriderLayer", "OutriderKv"), else 0:
 * a binding checks its mirrors of them against these at load. */
OUTRIDER_API int64_t outrider_struct_size(const char* name);

/* y[r * y_stride + j] (j < out, y_stride >= out) = x [rows, in] (quantized to int8 per row and
 * group) @ W.T. */
OUTRIDER_API int outrider_a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w,
                                    const void* d, const void* m, int64_t out, int bits, float* y, int64_t y_stride,
                                    char* err, int64_t err_size);

/* y [rows, hidden] = x / sqrt(mean(x^2) + eps) * w (hidden a multiple of 16; y may be x). */
OUTRIDER_API int outrider_rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t hidden, float* y,
                                   char* err, int64_t err_size);
/* y [rows, inter] = act(gate) * up of gate_up [rows, 2 inter] = [gate | up] (inter a multiple of 16);
 * act: silu, or with gelu_tanh GELU's tanh approximation (GeGLU). */
OUTRIDER_API int outrider_swiglu(const float* gate_up, int64_t rows, int64_t inter, float* y, char* err,
                                 int64_t err_size);
OUTRIDER_API int outrider_geglu(const float* gate_up, int64_t rows, int64_t inter, float* y, char* err,
                                int64_t err_size);
/* x[i] += y[i], i < n. */
OUTRIDER_API void outrider_add(float* x, const float* y, int64_t n);

/* One layer's attention for a step's chunks (ops.cpp attend): qkv [total, (H + 2 KV) D] with RoPE
 * applied; chunks [chunk_count, 4] (slot, first row, rows, committed length); visible: NULL (causal)
 * or bool bytes (0 or 1) [total, visible_width]; out [total, H D]. Writes the chunks' K and V into kv. */
OUTRIDER_API int outrider_attend(const float* qkv, int64_t total, const OutriderKv* kv, const int64_t* chunks,
                                 int64_t chunk_count, const uint8_t* visible, int64_t visible_width,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t dim, float* out, char* err,
                                 int64_t err_size);

/* Every decoder layer of a step, x [rows, hidden] in place (see c_api.cpp): cos and sin [rope_tables,
 * rows, D] (a layer rotates by its rope_table); positions: NULL, or int64 [rows], each row's position
 * (required where a layer has a window: a committed key's position is its row in the cache);
 * kv and layers: one per layer; chunks and visible as outrider_attend's, for every layer. */
OUTRIDER_API int outrider_llama_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin,
                                       int64_t rope_tables, const int64_t* positions,
                                       const OutriderKv* kv, const OutriderLayer* layers, int64_t num_layers,
                                       const int64_t* chunks, int64_t chunk_count, const uint8_t* visible,
                                       int64_t visible_width, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                       int64_t inter, float eps, char* err, int64_t err_size);

/* GGUF tensors into the kernels' layouts (gguf_pack.cpp), from the file's blocks as they are (a mapped
 * file: nothing is copied but one tile's values at a time): K types as super blocks, the simple types as
 * group blocks, w alone either way. `type` is GGML's type id (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8,
 * Q4_K 12, Q5_K 13, Q6_K 14); `five_bit` 0 packs Q5_0/Q5_1 in 8-bit group blocks.
 * outrider_packed_shape: the bits code, group and bytes of w per tile of 16 outputs. */
OUTRIDER_API int outrider_packed_shape(int type, int64_t cols, int five_bit, int32_t* bits, int64_t* group,
                                       int64_t* w_tile_bytes, char* err, int64_t err_size);
/* Packs `rows_out` rows (a multiple of 16) of src (src_rows rows of the type's blocks, `cols` inputs each):
 * output row r is source row row_map[r] (row_map NULL: r; < 0 or past src_rows: zeros). w sized
 * rows_out / 16 x the tile bytes of outrider_packed_shape. */
OUTRIDER_API int outrider_pack_gguf(int type, const uint8_t* src, int64_t src_rows, int64_t cols,
                                    const int64_t* row_map, int64_t rows_out, int five_bit, uint8_t* w, char* err,
                                    int64_t err_size);
/* fp32 [n, in] rows `ids` of a super-block weight (bits OUTRIDER_SUPER_BLOCKS | layout): as gguf-py
 * dequantizes the file's blocks; or of a group-block weight (OUTRIDER_GROUP_BLOCKS | ...): q d + m. ids must be < the weight's outputs (checked by the caller). */
OUTRIDER_API int outrider_dequantize_super_rows(const uint8_t* w, int bits, int64_t in, const int64_t* ids, int64_t n,
                                                float* out, char* err, int64_t err_size);

#ifdef __cplusplus
}
#endif

#endif /* OUTRIDER_C_API_H */
