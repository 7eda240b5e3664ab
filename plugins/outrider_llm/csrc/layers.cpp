// The decoder layer body, one for both bindings: the C ABI's outrider_llama_layers (c_api.cpp, any
// block types) and the torch ops' w4a8_layers (ops.cpp, 4-bit layers) call it.
//
// Each matrix is 1 to 3 parts side by side (q | k | v in their own GGUF block types, gate | up), in one
// a8_matmul_parts call writing each part's column slice of the matrix's output, in any layout the kernels take;
// plus Qwen2's qkv bias, Qwen3's per-head q and k RMSNorm and q's scale, Gemma 3's post norms, GeGLU,
// RoPE table and sliding window, Gemma 2's attention soft-capping. Per layer: RMSNorm -> qkv -> + bias -> q, k norms -> q scale -> RoPE
// (the layer's table) -> attention (within the layer's window) -> o -> [post norm] -> + x -> RMSNorm ->
// gate_up -> SwiGLU or GeGLU -> down -> [post norm] -> + x. Every row is computed on its own, in a fixed order: its result never depends on the
// other rows of the step, on the thread count, or (kernels.h) on the instruction set.

#include <algorithm>
#include <vector>

#include "kernels.h"

namespace outrider_native {

namespace {

// y [rows, width] = x [rows, in] @ the matrix's parts, each into its column slice.
void matrix_matmul(const OutriderMatrix& matrix, const float* x, int64_t rows, int64_t in, float* y, int64_t width) {
  a8_matmul_parts(x, rows, in, matrix.parts, matrix.count, y, width);
}

}  // namespace

void decoder_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin, int64_t rope_tables,
                    const int64_t* positions, const KvLayer* kv,
                    const OutriderLayer* layers, int64_t num_layers, const int64_t* chunks, int64_t chunk_count,
                    const bool* vis, int64_t visible_width, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                    int64_t inter, float eps) {
  if (rows == 0) return;
  const int64_t q_width = num_heads * dim, width = (num_heads + 2 * num_kv_heads) * dim;
  const KernelSet& ks = active_kernels();
  const int64_t widest = std::max(std::max(hidden, inter), q_width);
  thread_local std::vector<float> h, qkv, attn, out, gate_up;
  h.resize(rows * widest);
  qkv.resize(rows * width);
  attn.resize(rows * q_width);
  out.resize(rows * hidden);
  gate_up.resize(rows * 2 * inter);
  for (int64_t li = 0; li < num_layers; ++li) {
    const OutriderLayer& L = layers[li];
    ks.rms_norm_rows(x, L.attn_norm, eps, rows, hidden, h.data());
    matrix_matmul(L.qkv, h.data(), rows, hidden, qkv.data(), width);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = qkv.data() + r * width;
      if (L.qkv_bias != nullptr) ks.add_rows(row, L.qkv_bias, width);
      if (L.q_norm != nullptr) ks.rms_norm_rows(row, L.q_norm, eps, num_heads, dim, row);  // in place
      if (L.k_norm != nullptr) ks.rms_norm_rows(row + q_width, L.k_norm, eps, num_kv_heads, dim, row + q_width);
      if (L.q_scale != 0.f)
        for (int64_t k = 0; k < q_width; ++k) row[k] *= L.q_scale;
    }
    const int64_t table = L.rope_table > 0 && L.rope_table < rope_tables ? L.rope_table : 0;
    rope_rows(qkv.data(), cos + table * rows * dim, sin + table * rows * dim, rows, num_heads + num_kv_heads, dim,
              width);
    attend(qkv.data(), rows, kv[li], chunks, chunk_count, vis, visible_width, num_heads, num_kv_heads,
           dim, attn.data(), L.window, positions, L.attn_softcap);
    matrix_matmul(L.o, attn.data(), rows, q_width, out.data(), hidden);
    if (L.attn_post_norm != nullptr) ks.rms_norm_rows(out.data(), L.attn_post_norm, eps, rows, hidden, out.data());
    ks.add_rows(x, out.data(), rows * hidden);
    ks.rms_norm_rows(x, L.mlp_norm, eps, rows, hidden, h.data());
    matrix_matmul(L.gate_up, h.data(), rows, hidden, gate_up.data(), 2 * inter);
    (L.activation == OUTRIDER_GELU_TANH ? ks.geglu_rows : ks.swiglu_rows)(gate_up.data(), rows, inter, h.data());
    matrix_matmul(L.down, h.data(), rows, inter, out.data(), hidden);
    if (L.mlp_post_norm != nullptr) ks.rms_norm_rows(out.data(), L.mlp_post_norm, eps, rows, hidden, out.data());
    ks.add_rows(x, out.data(), rows * hidden);
  }
}

}  // namespace outrider_native
