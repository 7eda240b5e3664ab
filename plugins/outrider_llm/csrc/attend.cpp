// Attention for the chunks of one forward step, each row over exactly the keys it may see, in
// key order: a row's output does not depend on the other rows of the step, on how many keys are
// hidden from it, or on the thread count.
//
// Why it exists: speculative decoding is lossless only if verifying a draft tree computes, for
// each node, the logits a one-token step would compute after the same prefix. torch's batched
// matmul and softmax reduce over every key of the chunk (the masked ones add zeros, but the
// vectorised sums group the keys differently for a different count), so a tree row and a decode
// row differ in their last bits, and int8 or bf16 activations downstream turn some of those bits
// into whole rounding steps. Here the visible keys of a row are gathered first (the committed
// prefix, then its ancestors in the tree, in position order: exactly the keys a one-token step
// would read, in the same order) and everything after runs on that list.
//
// Per step: every chunk's K and V are written into the cache, then for each (row, head):
//   s_i = q . k_i over visible keys i; p_i = exp(s_i - max s) / sum; out = sum_i p_i v_i.
// (q is pre-scaled by 1/sqrt(d) in the weights.)
//
// qkv     fp32 [T, (H + 2 KV) * D], RoPE applied to q and k;
// kv      fp32 [2, slots, KV, capacity, D] (one layer's cache; inner [capacity, D] contiguous);
// chunks  int64 [C, 4]: (slot, first row in qkv, rows n, committed length L) per chunk;
// visible bool [T, W] (W >= n of every chunk): row start + r sees fed token c of its chunk when
//         visible[start + r, c]; an empty tensor means causal (c <= r) for every chunk.
// Output fp32 [T, H * D].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "native.h"

namespace {

#define OUTRIDER_ATTEND_TARGET OUTRIDER_AVX512

using outrider_native::exp_ps;

// Lane j of the result = the sum of v[j]'s 16 lanes (a transpose tree: ~3 operations per vector
// instead of a full horizontal sum each). Every vector goes through the same additions.
OUTRIDER_ATTEND_TARGET inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j)
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d lo = _mm512_castps_pd(a[2 * j]), hi = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // b[j]: per 128-bit lane L, vectors 4j..4j+3 summed over their lane L.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// scores[i] = q . k[pos[i]] for one head (D = 16 * C), then softmax in place.
template <int C>
OUTRIDER_ATTEND_TARGET void softmax_scores(const float* q, const float* keys, const int64_t* pos, int64_t count,
                                           float* scores) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i0 = 0; i0 < count; i0 += 16) {
    const int m = count - i0 >= 16 ? 16 : static_cast<int>(count - i0);
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= m) {
        v[j] = _mm512_setzero_ps();
        continue;
      }
      const float* k = keys + pos[i0 + j] * (16 * C);
      v[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int c = 1; c < C; ++c) v[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), v[j]);
    }
    const __mmask16 lanes = m == 16 ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
    const __m512 s = sum16(v);
    _mm512_mask_storeu_ps(scores + i0, lanes, s);
    top = _mm512_mask_max_ps(top, lanes, top, s);
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + i), shift));
    _mm512_mask_storeu_ps(scores + i, lanes, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 lanes = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    _mm512_mask_storeu_ps(scores + i, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, scores + i), inv));
  }
}

// out[g] = sum_i probs[g][i] v[pos[i]] for G heads that share these values (one load of v each).
template <int C, int G>
OUTRIDER_ATTEND_TARGET void weighted_values(const float* values, const int64_t* pos, int64_t count,
                                            const float* const* probs, float* const* out) {
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const float* v = values + pos[i] * (16 * C);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g][i]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + 16 * c, acc[g][c]);
}

// One row and KV head: the `group` query heads q[g] over the visible positions `pos`.
template <int C>
OUTRIDER_ATTEND_TARGET void attend_group(const float* q, int64_t group, const float* keys, const float* values,
                                         const int64_t* pos, int64_t count, float* scores, float* out) {
  constexpr int64_t d = 16 * C;
  for (int64_t g = 0; g < group; ++g) softmax_scores<C>(q + g * d, keys, pos, count, scores + g * (count + 16));
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const float* probs[4];
    float* outs[4];
    const int64_t n = group - g0 < 4 ? group - g0 : 4;
    for (int64_t g = 0; g < n; ++g) {
      probs[g] = scores + (g0 + g) * (count + 16);
      outs[g] = out + (g0 + g) * d;
    }
    switch (n) {
      case 1: weighted_values<C, 1>(values, pos, count, probs, outs); break;
      case 2: weighted_values<C, 2>(values, pos, count, probs, outs); break;
      case 3: weighted_values<C, 3>(values, pos, count, probs, outs); break;
      default: weighted_values<C, 4>(values, pos, count, probs, outs); break;
    }
  }
}

using GroupFn = void (*)(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, float*, float*);

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

namespace outrider_native {

at::Tensor attend(const at::Tensor& qkv, const at::Tensor& kv, const at::Tensor& chunks, const at::Tensor& visible,
                  int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(cpu_supported(), "outrider::attend needs AVX-512 (F, BW, VL, DQ), which this CPU lacks");
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == at::kFloat && kv.size(0) == 2 && kv.size(2) == num_kv_heads &&
                  kv.stride(4) == 1 && kv.stride(3) == kv.size(4),
              "outrider::attend: kv must be fp32 [2, slots, ", num_kv_heads, ", capacity, D] with rows of D "
              "contiguous, got ", kv.sizes(), " ", kv.scalar_type());
  const int64_t d = kv.size(4), slots = kv.size(1), capacity = kv.size(3);
  TORCH_CHECK((d == 16 || d == 32 || d == 64 || d == 128) && num_heads % num_kv_heads == 0, "outrider::attend: "
              "head_dim must be 16, 32, 64 or 128 and heads a multiple of kv heads, got ", d, ", ", num_heads, ", ",
              num_kv_heads);
  const GroupFn attend_fn = d == 16 ? attend_group<1> : d == 32 ? attend_group<2> : d == 64 ? attend_group<4>
                                                                                             : attend_group<8>;
  const int64_t width = (num_heads + 2 * num_kv_heads) * d, total = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && qkv.size(1) == width,
              "outrider::attend: qkv must be contiguous fp32 [T, ", width, "], got ", qkv.sizes());
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 4 && chunks.scalar_type() == at::kLong && chunks.is_contiguous(),
              "outrider::attend: chunks must be contiguous int64 [C, 4], got ", chunks.sizes());
  const bool causal = visible.numel() == 0;
  TORCH_CHECK(causal || (visible.dim() == 2 && visible.scalar_type() == at::kBool && visible.is_contiguous() &&
                         visible.size(0) == total),
              "outrider::attend: visible must be contiguous bool [", total, ", W] or empty, got ", visible.sizes());
  const int64_t group = num_heads / num_kv_heads, q_width = num_heads * d;
  const int64_t count = chunks.size(0);
  const int64_t* ch = chunks.data_ptr<int64_t>();
  const float* qp = qkv.data_ptr<float>();
  float* kvp = kv.data_ptr<float>();
  const int64_t s_half = kv.stride(0), s_slot = kv.stride(1), s_head = kv.stride(2);
  // Each row's chunk, and the checks that keep every index inside its tensor.
  std::vector<int64_t> row_chunk(total, -1);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
    TORCH_CHECK(slot >= 0 && slot < slots && start >= 0 && n >= 1 && start + n <= total && length >= 0 &&
                    length + n <= capacity && (causal || n <= visible.size(1)),
                "outrider::attend: chunk ", c, " (slot ", slot, ", rows ", start, "+", n, ", length ", length,
                ") does not fit ", total, " rows, ", slots, " slots of ", capacity);
    for (int64_t r = start; r < start + n; ++r) {
      TORCH_CHECK(row_chunk[r] < 0, "outrider::attend: row ", r, " is in two chunks");
      row_chunk[r] = c;
    }
  }
  // K and V of every fed token into the cache, before any row reads them.
  for (int64_t c = 0; c < count; ++c) {
    const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          std::copy_n(qp + (start + r) * width + q_width + (half * num_kv_heads + h) * d, d,
                      kvp + half * s_half + slot * s_slot + h * s_head + (length + r) * d);
  }
  at::Tensor out = at::zeros({total, q_width}, qkv.options());
  float* op = out.data_ptr<float>();
  const bool* vis = causal ? nullptr : visible.data_ptr<bool>();
  const int64_t vis_width = causal ? 0 : visible.size(1);
  at::parallel_for(0, total * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int64_t> pos;
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / num_kv_heads, kv_head = task % num_kv_heads, c = row_chunk[row];
      if (c < 0) continue;  // a row no chunk owns stays zero
      const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
      const int64_t r = row - start;
      pos.resize(length + n);
      int64_t seen = 0;
      for (int64_t i = 0; i < length; ++i) pos[seen++] = i;
      for (int64_t j = 0; j < n; ++j)
        if (causal ? j <= r : vis[row * vis_width + j]) pos[seen++] = length + j;
      if (seen == 0) continue;  // sees nothing (a visible row without its own token): zeros
      scores.resize(group * (seen + 16));
      const float* base = kvp + slot * s_slot + kv_head * s_head;
      attend_fn(qp + row * width + kv_head * group * d, group, base, base + s_half, pos.data(), seen, scores.data(),
                op + row * q_width + kv_head * group * d);
    }
  });
  return out;
}

}  // namespace outrider_native

TORCH_LIBRARY_FRAGMENT(outrider, lib) {
  lib.def("attend(Tensor qkv, Tensor(a!) kv, Tensor chunks, Tensor visible, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(outrider, CPU, lib) { lib.impl("attend", outrider_native::attend); }
