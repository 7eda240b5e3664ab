// The native core (kernels.h) as torch ops `outrider::*`: shape and dtype checks with messages
// that name what was expected, then plain pointers. Torch's thread pool runs the parallel parts.
//
//   w4a8_mm / w8a8_mm  fp32 [rows, out] = x (fp32 or bf16, quantized to int8 per row and group) @ W.T
//   attend             one layer's attention for a step's chunks (ops.cpp)
//   w4a8_layers        every decoder layer of a step in one call (ops.cpp)
//   native_kernels     the kernel set in use; native_kernel_sets: every set this CPU runs, best
//                      first; native_select(name): use that set; native_cpu_features

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "kernels.h"

namespace outrider_native {

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n > 0) at::parallel_for(0, n, 1, fn);
}

}  // namespace outrider_native

namespace {

using namespace outrider_native;

const uint16_t* half_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

void check_scales(const at::Tensor& t, int64_t tiles, int64_t groups, const char* op) {
  TORCH_CHECK((t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat) && t.is_contiguous() && t.dim() == 3 &&
                  t.size(0) == tiles && t.size(1) == groups && t.size(2) == kTile,
              op, ": scales and minimums must be contiguous fp16 or fp32 [", tiles, ", ", groups, ", 16], got ",
              t.sizes(), " ", t.scalar_type());
}

at::Tensor a8_mm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                 int64_t group_size, int64_t bits, int64_t offset = 0) {
  const char* op = bits == 4 ? "outrider::w4a8_mm" : bits == 5 ? "outrider::w5a8_mm" : "outrider::w8a8_mm";
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              op, ": x must be fp32 or bf16 [rows, in], got ", x_in.sizes(), " ", x_in.scalar_type());
  // Inputs per block of one tile, and its bytes: 8 in 64 (4-bit), 8 in 80 (5-bit: nibbles, then the
  // fifth bits), 4 in 64 (8-bit).
  const int64_t per_block = bits == 8 ? 4 : 8, block_bytes = bits == 5 ? 80 : 64;
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == block_bytes && w.is_contiguous(),
              op, ": w must be contiguous uint8 [out/16, in/", per_block, ", ", block_bytes, "], got ", w.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  const int64_t rows = x.size(0), in = x.size(1), tiles = w.size(0), out = tiles * kTile;
  TORCH_CHECK(w.size(1) * per_block == in, op, ": w holds ", w.size(1) * per_block, " inputs, x has ", in);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && in % group_size == 0,
              op, ": group_size must be a multiple of 16 dividing ", in, ", got ", group_size);
  check_scales(d, tiles, in / group_size, op);
  // offset > 0: a symmetric type (w = (q - offset) d), no minimums table (m empty).
  int log2_offset = 0;
  while (log2_offset < 15 && (int64_t{1} << log2_offset) < offset) ++log2_offset;
  TORCH_CHECK(offset == 0 || (offset >= 2 && (int64_t{1} << log2_offset) == offset),
              op, ": offset must be 0 or a power of two from 2 to 32768, got ", offset);
  if (offset == 0) {
    check_scales(m, tiles, in / group_size, op);
    TORCH_CHECK(d.scalar_type() == m.scalar_type(), op, ": scales and minimums must share a dtype, got ",
                d.scalar_type(), " and ", m.scalar_type());
  } else {
    TORCH_CHECK(m.numel() == 0, op, ": with an offset the minimums come from it; m must be empty, got ", m.sizes());
  }
  // fp32 tables: a GGUF K type's sub-block scales, which fp16 would round.
  const bool f32 = d.scalar_type() == at::kFloat;
  const int code = with_offset(static_cast<int>(bits) | (f32 ? kF32Scales : 0), offset ? log2_offset : 0);
  at::Tensor y = at::empty({rows, out}, x.options());
  a8_matmul(x.data_ptr<float>(), rows, in, group_size, w.data_ptr<uint8_t>(), d.data_ptr(),
            offset ? nullptr : m.data_ptr(), out, code, y.data_ptr<float>());
  return y;
}

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size) {
  return a8_mm(x, w, d, m, group_size, 4);
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size, int64_t offset) {
  return a8_mm(x, w, d, m, group_size, 8, offset);
}

at::Tensor w5a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d, const at::Tensor& m,
                   int64_t group_size, int64_t offset) {
  return a8_mm(x, w, d, m, group_size, 5, offset);
}

// kv: one layer [2, slots, KV, capacity, D] with rows of D contiguous.
KvLayer kv_layer(const at::Tensor& kv, int64_t num_kv_heads, const char* op) {
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == at::kFloat && kv.size(0) == 2 && kv.size(2) == num_kv_heads &&
                  kv.stride(4) == 1 && kv.stride(3) == kv.size(4),
              op, ": kv must be fp32 [2, slots, ", num_kv_heads, ", capacity, D] with rows of D contiguous, got ",
              kv.sizes(), " ", kv.scalar_type());
  return {kv.data_ptr<float>(), kv.size(1), kv.size(3), kv.stride(0), kv.stride(1), kv.stride(2)};
}

// The chunk table and visibility mask, checked; returns (visible pointer or null, its width).
std::pair<const bool*, int64_t> checked_chunks(const at::Tensor& chunks, const at::Tensor& visible, int64_t total,
                                               const KvLayer& kv, const char* op) {
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 4 && chunks.scalar_type() == at::kLong && chunks.is_contiguous(),
              op, ": chunks must be contiguous int64 [C, 4], got ", chunks.sizes());
  const bool causal = visible.numel() == 0;
  TORCH_CHECK(causal || (visible.dim() == 2 && visible.scalar_type() == at::kBool && visible.is_contiguous() &&
                         visible.size(0) == total),
              op, ": visible must be contiguous bool [", total, ", W] or empty, got ", visible.sizes());
  const int64_t width = causal ? 0 : visible.size(1);
  char message[256];
  const char* error = check_chunks(chunks.data_ptr<int64_t>(), chunks.size(0), total, kv.slots, kv.capacity, width,
                                   causal, message, sizeof message);
  TORCH_CHECK(*error == '\0', op, ": ", error);
  return {causal ? nullptr : visible.data_ptr<bool>(), width};
}

void check_heads(int64_t d, int64_t num_heads, int64_t num_kv_heads, const char* op) {
  TORCH_CHECK((d == 16 || d == 32 || d == 64 || d == 128) && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              op, ": head_dim must be 16, 32, 64 or 128 and heads a multiple of kv heads, got ", d, ", ", num_heads,
              ", ", num_kv_heads);
}

at::Tensor attend_op(const at::Tensor& qkv, const at::Tensor& kv, const at::Tensor& chunks, const at::Tensor& visible,
                  int64_t num_heads, int64_t num_kv_heads) {
  const char* op = "outrider::attend";
  const KvLayer layer = kv_layer(kv, num_kv_heads, op);
  const int64_t d = kv.size(4);
  check_heads(d, num_heads, num_kv_heads, op);
  const int64_t width = (num_heads + 2 * num_kv_heads) * d, total = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && qkv.size(1) == width,
              op, ": qkv must be contiguous fp32 [T, ", width, "], got ", qkv.sizes());
  const auto [vis, vis_width] = checked_chunks(chunks, visible, total, layer, op);
  at::Tensor out = at::empty({total, num_heads * d}, qkv.options());
  outrider_native::attend(qkv.data_ptr<float>(), total, layer, chunks.data_ptr<int64_t>(), chunks.size(0), vis,
                          vis_width, num_heads, num_kv_heads, d, out.data_ptr<float>());
  return out;
}

void check_weight(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t out, int64_t in,
                  int64_t group, const char* what, int64_t layer) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) * 16 == out &&
                  w.size(1) * 8 == in && w.size(2) == 64,
              "outrider::w4a8_layers: layer ", layer, " ", what, " weights must be uint8 [", out / 16, ", ", in / 8,
              ", 64], got ", w.sizes());
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) * 16 == out &&
                    t->size(1) * group == in && t->size(2) == 16,
                "outrider::w4a8_layers: layer ", layer, " ", what, " scales must be fp16 [", out / 16, ", ",
                in / group, ", 16], got ", t->sizes());
}

void w4a8_layers_op(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, const at::Tensor& chunks,
                 const at::Tensor& visible, at::TensorList norms, at::TensorList packed, at::TensorList scales,
                 at::TensorList minimums, int64_t group, int64_t num_heads, int64_t num_kv_heads, int64_t inter,
                 double eps) {
  const char* op = "outrider::w4a8_layers";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              op, ": x must be contiguous fp32 [T, hidden], got ", x.sizes());
  TORCH_CHECK(kv.dim() == 6, op, ": kv must be [layers, 2, slots, KV, capacity, D], got ", kv.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1), layers = kv.size(0), d = kv.size(5);
  check_heads(d, num_heads, num_kv_heads, op);
  const int64_t q_width = num_heads * d, width = (num_heads + 2 * num_kv_heads) * d;
  TORCH_CHECK(group > 0 && hidden % 16 == 0 && inter % 16 == 0 && group % 16 == 0 && hidden % group == 0 &&
                  inter % group == 0 && q_width % group == 0,
              op, ": hidden (", hidden, "), intermediate (", inter, ") and heads x head_dim (", q_width,
              ") must be multiples of the group (", group, "), itself a multiple of 16");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == d,
                op, ": cos and sin must be contiguous fp32 [", rows, ", ", d, "], got ", t->sizes());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(packed.size()) == 4 * layers &&
                  scales.size() == packed.size() && minimums.size() == packed.size(),
              op, ": ", layers, " layers need ", 2 * layers, " norms and ", 4 * layers,
              " packed weights, scales and minimums");
  for (const at::Tensor& norm : norms)
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden,
                op, ": norm weights must be contiguous fp32 [", hidden, "]");
  std::vector<KvLayer> cache(layers);
  for (int64_t li = 0; li < layers; ++li) cache[li] = kv_layer(kv.select(0, li), num_kv_heads, op);
  const auto [vis, vis_width] = checked_chunks(chunks, visible, rows, cache.empty() ? KvLayer{} : cache[0], op);
  const int64_t shapes[4][2] = {{width, hidden}, {hidden, q_width}, {2 * inter, hidden}, {hidden, inter}};
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  std::vector<LayerWeights> weights(layers);
  for (int64_t li = 0; li < layers; ++li) {
    weights[li].attn_norm = norms[2 * li].data_ptr<float>();
    weights[li].mlp_norm = norms[2 * li + 1].data_ptr<float>();
    for (int j = 0; j < 4; ++j) {
      const at::Tensor &w = packed[4 * li + j], &s = scales[4 * li + j], &mn = minimums[4 * li + j];
      check_weight(w, s, mn, shapes[j][0], shapes[j][1], group, names[j], li);
      weights[li].w[j] = w.data_ptr<uint8_t>();
      weights[li].d[j] = half_ptr(s);
      weights[li].m[j] = half_ptr(mn);
    }
  }
  if (rows == 0 || layers == 0) return;
  outrider_native::w4a8_layers(x.data_ptr<float>(), rows, hidden, cos.data_ptr<float>(), sin.data_ptr<float>(),
                               cache.data(), weights.data(), layers, chunks.data_ptr<int64_t>(), chunks.size(0), vis,
                               vis_width, group, num_heads, num_kv_heads, d, inter, static_cast<float>(eps));
}

std::string native_kernels() { return active_kernels().name; }

std::vector<std::string> native_kernel_sets() {
  std::vector<std::string> names;
  for (int i = 0; i < kernel_set_count(); ++i)
    if (cpu_runs(kernel_set(i))) names.emplace_back(kernel_set(i).name);
  return names;
}

bool native_select(const std::string& name) { return select_kernels(name.c_str()); }

std::string native_cpu_features() { return cpu_features(); }

}  // namespace

TORCH_LIBRARY(outrider, lib) {
  lib.def("w4a8_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size) -> Tensor");
  lib.def("w8a8_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size, int offset=0) -> Tensor");
  lib.def("w5a8_mm(Tensor x, Tensor w, Tensor d, Tensor m, int group_size, int offset=0) -> Tensor");
  lib.def("attend(Tensor qkv, Tensor(a!) kv, Tensor chunks, Tensor visible, int num_heads, int num_kv_heads) -> Tensor");
  lib.def("w4a8_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) kv, Tensor chunks, Tensor visible, "
          "Tensor[] norms, Tensor[] packed, Tensor[] scales, Tensor[] minimums, int group_size, int num_heads, "
          "int num_kv_heads, int intermediate, float eps) -> ()");
  lib.def("native_kernels", &native_kernels);
  lib.def("native_kernel_sets", &native_kernel_sets);
  lib.def("native_select", &native_select);
  lib.def("native_cpu_features", &native_cpu_features);
}

TORCH_LIBRARY_IMPL(outrider, CPU, lib) {
  lib.impl("w4a8_mm", w4a8_mm);
  lib.impl("w8a8_mm", w8a8_mm);
  lib.impl("w5a8_mm", w5a8_mm);
  lib.impl("attend", attend_op);
  lib.impl("w4a8_layers", w4a8_layers_op);
}
