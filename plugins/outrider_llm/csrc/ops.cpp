// Whole-tensor operations on the active kernel set: the int8-activation matmul, the attention of
// a step's chunks, and the fused decoder layer stack. Plain pointers; torch_ops.cpp checks shapes
// and binds them.
//
// attend: each row over exactly the keys it may see, in key order. Speculative decoding is
// lossless only if verifying a draft tree computes, for each node, the logits a one-token step
// would compute after the same prefix; batched attention reduces over every key of the chunk (the
// masked ones add zeros, but vectorised sums group the keys differently for a different count),
// so a tree row and a decode row would differ in their last bits, and the int8 activations
// downstream turn some of those bits into whole rounding steps. Here the visible keys of a row
// are gathered first (the committed prefix, then its ancestors in the tree, in position order:
// exactly the keys a one-token step reads, in the same order) and everything after runs on that
// list, one row at a time.
//
// Per step: every chunk's K and V are written into the cache, then for each (row, head):
//   s_i = q . k_i over visible keys i; p_i = exp(s_i - max s) / sum; out = sum_i p_i v_i
// (q is pre-scaled by 1/sqrt(d) in the weights).
//   qkv     [T, (H + 2 KV) * D], RoPE applied to q and k;
//   chunks  [C, 4]: (slot, first row in qkv, rows n, committed length L) per chunk;
//   visible [T, W] (W >= n of every chunk): row start + r sees fed token c of its chunk when
//           visible[start + r, c]; null means causal (c <= r) for every chunk.
//
// w4a8_layers: every decoder layer of a Llama step in one call, for the torch binding: the one layer
// body (layers.cpp) on 4-bit weights. With the matmuls this fast, a one-token step of SmolLM2 spent
// a third of its time dispatching torch's ~30 small operations per layer; here a layer is plain
// loops over a few KB of activations.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace outrider_native {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t magnitude = x & 0x7FFFFFFF;
  if (magnitude >= 0x7F800000)  // inf, nan (kept a nan)
    return static_cast<uint16_t>(sign | 0x7C00 | (magnitude > 0x7F800000 ? 0x200 : 0));
  if (magnitude >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds past 65504: inf
  if (magnitude < 0x38800000) {  // a subnormal half (or zero): the value in units of 2^-24, to nearest even
    if (magnitude < 0x33000000) return sign;  // under half of the smallest subnormal
    const uint32_t shift = 126 - (magnitude >> 23), mantissa = (magnitude & 0x7FFFFF) | 0x800000;
    uint32_t h = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((magnitude >> 13) - (112u << 10));  // rebias the exponent, keep 10 bits of mantissa
  const uint32_t rest = magnitude & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry rounds into the exponent, as it must
  return static_cast<uint16_t>(sign | h);
}

namespace {

// x quantized to int8 as one activation format takes it: a K type's super blocks per 256 inputs (one
// scale each) with their int32 sums per 16, which carry the minimums (Q6_K: its offset of 32) to the
// result; group blocks per 32; the separate-table layouts per their group.
struct QuantizedRows {
  std::vector<int32_t> xq_words;  // int32 words: 4-byte aligned int8 rows
  std::vector<float> scale, sum;
  std::vector<int32_t> isum, bsum;
  bool super = false;
  int64_t group = 0;

  const int8_t* xq() const { return reinterpret_cast<const int8_t*>(xq_words.data()); }

  void quantize(const KernelSet& ks, const float* x, int64_t rows, int64_t in, bool super_blocks, int64_t g) {
    super = super_blocks;
    group = g;
    const int64_t groups = in / group;
    xq_words.resize((rows * in + 3) / 4);
    scale.resize(rows * groups);
    sum.resize(rows * groups);
    isum.resize(rows * groups);
    int8_t* q = reinterpret_cast<int8_t*>(xq_words.data());
    ks.quantize_rows(x, rows, in, group, q, scale.data(), sum.data(), isum.data());
    if (super) {
      bsum.resize(rows * in / 16);
      for (int64_t i = 0; i < rows * in / 16; ++i) {
        int32_t total = 0;
        for (int k = 0; k < 16; ++k) total += q[16 * i + k];
        bsum[i] = total;
      }
    }
  }
};

int64_t activation_group(int bits, int64_t group) {
  return is_super(bits) ? kSuper : is_group_blocks(bits) ? 32 : group;
}

// Bytes of one tile (16 outputs) of a weight: the share of a thread's reads it stands for.
int64_t tile_bytes(int bits, int64_t in, int64_t group) {
  if (is_super(bits)) return in / kSuper * super_block_bytes(bits & 15);
  if (is_group_blocks(bits)) return in / 32 * group_block_bytes(bits);
  const int64_t scales = in / group * 16 * ((bits & kF32Scales) ? 4 : 2) * (minimum_offset(bits) == 0.f ? 2 : 1);
  return in * 2 * (bits & 15) + scales;
}

// Tiles [t0, t1) of one weight, every row, on activations quantized for it.
void matmul_range(const KernelSet& ks, const QuantizedRows& q, int64_t rows, int64_t in, const OutriderPart& part,
                  int64_t t0, int64_t t1, float* y, int64_t y_stride) {
  if (q.super)
    ks.matmul_super(q.xq(), q.scale.data(), q.bsum.data(), rows, in, part.w, part.bits & 15, t0, t1, y, y_stride);
  else if (is_group_blocks(part.bits))
    ks.matmul_groups(q.xq(), q.scale.data(), q.sum.data(), q.isum.data(), rows, in, part.w, part.bits, t0, t1, y,
                     y_stride);
  else
    ks.matmul_tiles(q.xq(), q.scale.data(), q.sum.data(), q.isum.data(), rows, in, part.group, part.w, part.d,
                    part.m, part.out, part.bits, t0, t1, y, y_stride);
}

}  // namespace

// One parallel region for all parts, its threads each taking an equal share of their weights' bytes
// (a tile goes to the thread whose share holds its first byte), and x quantized once per activation
// format: a separate call per part quantized x again for each and ended each at a barrier where
// the threads waited on the slower one (q | k | v: three barriers a layer, two of them on small k and v).
void a8_matmul_parts(const float* x, int64_t rows, int64_t in, const OutriderPart* parts, int count, float* y,
                     int64_t y_stride) {
  if (rows == 0 || count == 0) return;
  const KernelSet& ks = active_kernels();
  thread_local QuantizedRows quantized[kMaxParts];  // kept between calls: an allocation costs more than a small matmul
  const QuantizedRows* input[kMaxParts];
  int64_t column[kMaxParts], first_byte[kMaxParts + 1], bytes[kMaxParts];
  first_byte[0] = 0;
  int formats = 0;
  for (int p = 0; p < count; ++p) {
    const OutriderPart& part = parts[p];
    const bool super = is_super(part.bits);
    const int64_t group = activation_group(part.bits, part.group);
    input[p] = nullptr;
    for (int f = 0; f < formats; ++f)
      if (quantized[f].super == super && quantized[f].group == group) input[p] = &quantized[f];
    if (input[p] == nullptr) {
      quantized[formats].quantize(ks, x, rows, in, super, group);
      input[p] = &quantized[formats++];
    }
    column[p] = p == 0 ? 0 : column[p - 1] + parts[p - 1].out;
    bytes[p] = count == 1 ? 1 : tile_bytes(part.bits, in, group);  // one part: its tiles split evenly
    first_byte[p + 1] = first_byte[p] + part.out / kTile * bytes[p];
  }
  parallel_for(first_byte[count], [&](int64_t begin, int64_t end) {
    for (int p = 0; p < count; ++p) {
      // The tiles whose first byte lies in [begin, end): ceil((at - first) / bytes), within the part.
      const int64_t tiles = parts[p].out / kTile;
      auto tile_at = [&](int64_t at) {
        return std::min(tiles, std::max<int64_t>(0, (at - first_byte[p] + bytes[p] - 1) / bytes[p]));
      };
      const int64_t t0 = tile_at(begin), t1 = tile_at(end);
      if (t0 < t1) matmul_range(ks, *input[p], rows, in, parts[p], t0, t1, y + column[p], y_stride);
    }
  });
}

void a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
               const void* m, int64_t out, int bits, float* y, int64_t y_stride) {
  const OutriderPart part{w, d, m, out, group, bits};
  a8_matmul_parts(x, rows, in, &part, 1, y, y_stride);
}

void a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
               const void* m, int64_t out, int bits, float* y) {
  a8_matmul(x, rows, in, group, w, d, m, out, bits, y, out);
}

const char* check_chunks(const int64_t* ch, int64_t count, int64_t total, int64_t slots, int64_t capacity,
                         int64_t visible_width, bool causal, char* message, int64_t message_size,
                         int64_t ring_window) {
  std::vector<char> owned(total, 0);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
    // A ring holds the window and a step's rows once it is full size; until then (a short sequence's
    // ring, grown with it) it has not wrapped, and holds every row like a plain cache.
    const bool fits = length + n <= capacity || (ring_window > 0 && n + ring_window - 1 <= capacity);
    if (!(slot >= 0 && slot < slots && start >= 0 && n >= 1 && start + n <= total && length >= 0 && fits &&
          (causal || n <= visible_width))) {
      std::snprintf(message, message_size,
                    "chunk %lld (slot %lld, rows %lld+%lld, length %lld) does not fit %lld rows, %lld slots of %lld",
                    static_cast<long long>(c), static_cast<long long>(slot), static_cast<long long>(start),
                    static_cast<long long>(n), static_cast<long long>(length), static_cast<long long>(total),
                    static_cast<long long>(slots), static_cast<long long>(capacity));
      return message;
    }
    for (int64_t r = start; r < start + n; ++r) {
      if (owned[r]) {
        std::snprintf(message, message_size, "row %lld is in two chunks", static_cast<long long>(r));
        return message;
      }
      owned[r] = 1;
    }
  }
  return "";
}

void attend(const float* qkv, int64_t total, const KvLayer& kv, const int64_t* ch, int64_t count,
            const bool* visible, int64_t visible_width, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
            float* out, int64_t window, const int64_t* positions, float softcap) {
  const KernelSet& ks = active_kernels();
  const int64_t width = (num_heads + 2 * num_kv_heads) * dim, q_width = num_heads * dim;
  const int64_t group = num_heads / num_kv_heads;
  std::vector<int64_t> row_chunk(total, -1);
  for (int64_t c = 0; c < count; ++c)
    for (int64_t r = ch[4 * c + 1]; r < ch[4 * c + 1] + ch[4 * c + 2]; ++r) row_chunk[r] = c;
  // The row of cache index i: itself, or in a sliding layer's ring i % capacity.
  const int64_t ring = kv.ring ? kv.capacity : 0;
  auto row_of = [ring](int64_t i) { return ring ? i % ring : i; };
  const int64_t row_size = kv.q8 ? q8_row_bytes(dim) : dim;  // elements (q8_0: bytes) a row
  // K and V of every fed token into the cache, before any row reads them (fp16: rounded to nearest
  // even here, in plain C++, so every kernel set reads the same bits).
  for (int64_t c = 0; c < count; ++c) {
    const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t at = half * kv.s_half + slot * kv.s_slot + h * kv.s_head + row_of(length + r) * row_size;
          const float* from = qkv + (start + r) * width + q_width + (half * num_kv_heads + h) * dim;
          if (kv.q8) {
            quantize_q8_row(from, dim, static_cast<int8_t*>(kv.data) + at);
          } else if (kv.f16) {
            uint16_t* to = static_cast<uint16_t*>(kv.data) + at;
            for (int64_t k = 0; k < dim; ++k) to[k] = float_to_half(from[k]);
          } else {
            std::memcpy(static_cast<float*>(kv.data) + at, from, dim * sizeof(float));
          }
        }
  }
  std::memset(out, 0, sizeof(float) * total * q_width);  // a row no chunk owns stays zero
  parallel_for(total * num_kv_heads, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int64_t> pos;
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / num_kv_heads, kv_head = task % num_kv_heads, c = row_chunk[row];
      if (c < 0) continue;
      const int64_t slot = ch[4 * c], start = ch[4 * c + 1], n = ch[4 * c + 2], length = ch[4 * c + 3];
      const int64_t r = row - start;
      pos.resize(length + n);
      int64_t seen = 0;
      // A sliding layer's row at position p sees keys at positions above p - window: committed key i is
      // at position i, a fed one at its row's.
      const int64_t first = window > 0 ? positions[row] - window + 1 : 0;
      for (int64_t i = first > 0 ? first : 0; i < length; ++i) pos[seen++] = row_of(i);
      for (int64_t j = 0; j < n; ++j)
        if ((visible == nullptr ? j <= r : visible[row * visible_width + j]) &&
            (window <= 0 || positions[start + j] >= first))
          pos[seen++] = row_of(length + j);
      if (seen == 0) continue;  // sees nothing (a visible row without its own token): zeros
      scores.resize(group * (seen + 16));
      const int64_t at = slot * kv.s_slot + kv_head * kv.s_head;
      const float* q = qkv + row * width + kv_head * group * dim;
      float* o = out + row * q_width + kv_head * group * dim;
      if (kv.q8) {
        const int8_t* base = static_cast<const int8_t*>(kv.data) + at;
        ks.attend_group_q8(q, group, dim, base, base + kv.s_half, pos.data(), seen, scores.data(), o, softcap);
      } else if (kv.f16) {
        const uint16_t* base = static_cast<const uint16_t*>(kv.data) + at;
        ks.attend_group_f16(q, group, dim, base, base + kv.s_half, pos.data(), seen, scores.data(), o, softcap);
      } else {
        const float* base = static_cast<const float*>(kv.data) + at;
        ks.attend_group(q, group, dim, base, base + kv.s_half, pos.data(), seen, scores.data(), o, softcap);
      }
    }
  });
}

void quantize_q8_row(const float* x, int64_t dim, int8_t* row) {
  for (int64_t b = 0; b < dim / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.f;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int k = 0; k < 32; ++k) row[32 * b + k] = static_cast<int8_t>(std::round(v[k] * id));
    const uint16_t scale = float_to_half(d);
    std::memcpy(row + dim + 2 * b, &scale, sizeof scale);
  }
}

// RoPE in place on the first `heads` heads of each row: p' = p * cos + rotate_half(p) * sin
// (sin carries the sign of rotate_half's first half). Plain C++: the same on every path. Shared
// with c_api.cpp's llama_layers (declared there).
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

void w4a8_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin, const KvLayer* kv,
                 const LayerWeights* layers, int64_t num_layers, const int64_t* chunks, int64_t chunk_count,
                 const bool* visible, int64_t visible_width, int64_t group, int64_t num_heads, int64_t num_kv_heads,
                 int64_t dim, int64_t inter, float eps) {
  const int64_t width = (num_heads + 2 * num_kv_heads) * dim;
  const int64_t outs[4] = {width, hidden, 2 * inter, hidden};
  std::vector<OutriderLayer> table(num_layers);
  for (int64_t li = 0; li < num_layers; ++li) {
    OutriderLayer& L = table[li];
    L = OutriderLayer{};
    L.attn_norm = layers[li].attn_norm;
    L.mlp_norm = layers[li].mlp_norm;
    OutriderMatrix* matrices[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
    for (int j = 0; j < 4; ++j) {
      matrices[j]->count = 1;
      matrices[j]->parts[0] = OutriderPart{layers[li].w[j], layers[li].d[j], layers[li].m[j], outs[j], group, 4};
    }
  }
  decoder_layers(x, rows, hidden, cos, sin, 1, nullptr, kv, table.data(), num_layers, chunks, chunk_count, visible,
                 visible_width, num_heads, num_kv_heads, dim, inter, eps);
}

}  // namespace outrider_native
