// Every decoder layer of a Llama forward step on w4a8 weights, in one call: RMSNorm, the int8
// quantization of activations, the four int4 x int8 matmuls (w4a8_mm.cpp), RoPE, attention
// (attend.cpp), SwiGLU and the residual adds.
//
// Why it exists: with the matmuls on VNNI, a one-token step of SmolLM2 spent about a third of its
// time dispatching the ~30 small torch operations per layer (RMSNorm alone is six); here a layer
// is plain loops over a few KB of activations, and a step is one call. The arithmetic is the
// model's definition wherever the w4a8 kernel serves (every forward of such a model runs here),
// and every row is computed on its own, in a fixed order: a row's result never depends on the
// other rows of the step or on the thread count.
//
// x       fp32 [T, hidden], the residual stream, updated in place;
// cos/sin fp32 [T, head_dim]: RoPE per row (sin carries the sign of rotate_half's first half);
// kv, chunks, visible: as outrider::attend, kv for every layer [layers, 2, slots, KV, capacity, D];
// per layer i: norms[2i], norms[2i + 1] (attention and MLP RMSNorm weights); packed/scales/minimums
// [4i + j] for j = qkv (q pre-scaled by 1/sqrt(D)), o, gate_up (gate rows first), down, in the
// w4a8 layout (native.pack_w4a8).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "native.h"

namespace {

using outrider_native::exp_ps;

// y = x * (1 / sqrt(mean(x^2) + eps)) * w per row; hidden % 16 == 0.
OUTRIDER_AVX512 void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t hidden, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < hidden; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hidden) + eps));
    for (int64_t k = 0; k < hidden; k += 16)
      _mm512_storeu_ps(y + r * hidden + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + k), inv),
                                                         _mm512_loadu_ps(w + k)));
  }
}

// RoPE in place on the first `heads` heads of each row: p' = p * cos + rotate_half(p) * sin.
void rope_rows(float* qkv, const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t d,
               int64_t width) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = qkv + r * width + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        p[i] = a * c[i] + b * s[i];
        p[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// y = silu(gate) * up per row of gu = [gate | up] (each `inter` wide, inter % 16 == 0).
OUTRIDER_AVX512 void swiglu_rows(const float* gu, int64_t rows, int64_t inter, float* y) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    for (int64_t k = 0; k < inter; k += 16) {
      const __m512 gate = _mm512_loadu_ps(g + k);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
      _mm512_storeu_ps(y + r * inter + k, _mm512_mul_ps(_mm512_mul_ps(gate, sig), _mm512_loadu_ps(g + inter + k)));
    }
  }
}

OUTRIDER_AVX512 void add_rows(float* x, const float* y, int64_t count) {
  int64_t k = 0;
  for (; k + 16 <= count; k += 16) _mm512_storeu_ps(x + k, _mm512_add_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(y + k)));
  for (; k < count; ++k) x[k] += y[k];
}

struct Weights {
  const uint8_t* w;
  const uint16_t* d;
  const uint16_t* m;
};

Weights checked(const at::Tensor& w, const at::Tensor& d, const at::Tensor& m, int64_t out, int64_t in,
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
  return {w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
          reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>())};
}

void w4a8_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv, const at::Tensor& chunks,
                 const at::Tensor& visible, at::TensorList norms, at::TensorList packed, at::TensorList scales,
                 at::TensorList minimums, int64_t group, int64_t num_heads, int64_t num_kv_heads, int64_t inter,
                 double eps) {
  TORCH_CHECK(outrider_native::vnni_supported(), "outrider::w4a8_layers needs AVX512-VNNI, which this CPU lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "outrider::w4a8_layers: x must be contiguous fp32 [T, hidden], got ", x.sizes());
  TORCH_CHECK(kv.dim() == 6, "outrider::w4a8_layers: kv must be [layers, 2, slots, KV, capacity, D], got ", kv.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1), layers = kv.size(0), d = kv.size(5);
  const int64_t q_width = num_heads * d, width = (num_heads + 2 * num_kv_heads) * d;
  TORCH_CHECK(hidden % 16 == 0 && inter % 16 == 0 && group % 16 == 0 && hidden % group == 0 && inter % group == 0 &&
                  q_width % group == 0,
              "outrider::w4a8_layers: hidden (", hidden, "), intermediate (", inter, ") and heads x head_dim (",
              q_width, ") must be multiples of the group (", group, "), itself a multiple of 16");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == d,
                "outrider::w4a8_layers: cos and sin must be contiguous fp32 [", rows, ", ", d, "], got ", t->sizes());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(packed.size()) == 4 * layers &&
                  scales.size() == packed.size() && minimums.size() == packed.size(),
              "outrider::w4a8_layers: ", layers, " layers need ", 2 * layers, " norms and ", 4 * layers,
              " packed weights, scales and minimums");
  for (const at::Tensor& norm : norms)
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden,
                "outrider::w4a8_layers: norm weights must be contiguous fp32 [", hidden, "]");
  if (rows == 0) return;

  const int64_t widest = std::max({hidden, inter, q_width});
  auto f32 = x.options();
  at::Tensor h = at::empty({rows, widest}, f32), qkv = at::empty({rows, width}, f32);
  at::Tensor out = at::empty({rows, hidden}, f32), gate_up = at::empty({rows, 2 * inter}, f32);
  at::Tensor xq = at::empty({rows * widest + 64}, f32.dtype(at::kChar));
  at::Tensor xs = at::empty({2, rows * widest / group}, f32);
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* gup = gate_up.data_ptr<float>();
  int8_t* qp = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xq.data_ptr<int8_t>()) + 63) & ~uintptr_t(63));
  float* scale = xs[0].data_ptr<float>();
  float* sum = xs[1].data_ptr<float>();
  // y [rows, n_out] = a [rows, n_in] @ W.T, with a's rows quantized first.
  auto matmul = [&](const float* a, int64_t n_in, const Weights& wt, int64_t n_out, float* y) {
    outrider_native::quantize_rows_fp32(a, rows, n_in, group, qp, scale, sum);
    outrider_native::a8_matmul(qp, scale, sum, rows, n_in, group, wt.w, wt.d, wt.m, n_out, 4, y);
  };
  for (int64_t li = 0; li < layers; ++li) {
    const Weights wqkv = checked(packed[4 * li], scales[4 * li], minimums[4 * li], width, hidden, group, "qkv", li);
    const Weights wo = checked(packed[4 * li + 1], scales[4 * li + 1], minimums[4 * li + 1], hidden, q_width, group,
                               "o", li);
    const Weights wgu = checked(packed[4 * li + 2], scales[4 * li + 2], minimums[4 * li + 2], 2 * inter, hidden,
                                group, "gate_up", li);
    const Weights wdown = checked(packed[4 * li + 3], scales[4 * li + 3], minimums[4 * li + 3], hidden, inter, group,
                                  "down", li);
    rms_norm_rows(xp, norms[2 * li].data_ptr<float>(), static_cast<float>(eps), rows, hidden, hp);
    matmul(hp, hidden, wqkv, width, qkvp);
    rope_rows(qkvp, cos.data_ptr<float>(), sin.data_ptr<float>(), rows, num_heads + num_kv_heads, d, width);
    const at::Tensor attn = outrider_native::attend(qkv, kv.select(0, li), chunks, visible, num_heads, num_kv_heads);
    matmul(attn.data_ptr<float>(), q_width, wo, hidden, op);
    add_rows(xp, op, rows * hidden);
    rms_norm_rows(xp, norms[2 * li + 1].data_ptr<float>(), static_cast<float>(eps), rows, hidden, hp);
    matmul(hp, hidden, wgu, 2 * inter, gup);
    swiglu_rows(gup, rows, inter, hp);
    matmul(hp, inter, wdown, hidden, op);
    add_rows(xp, op, rows * hidden);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(outrider, lib) {
  lib.def("w4a8_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) kv, Tensor chunks, Tensor visible, "
          "Tensor[] norms, Tensor[] packed, Tensor[] scales, Tensor[] minimums, int group_size, int num_heads, "
          "int num_kv_heads, int intermediate, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(outrider, CPU, lib) { lib.impl("w4a8_layers", w4a8_layers); }
