// GGUF blocks into the kernels' tile layouts (kernels.h), straight from the file's bytes: a load maps
// the GGUF and packs it tensor by tensor, tile by tile, with nothing but one tile's values on the side
// (llama.cpp's CPU_REPACK does the same per tensor). Plain C++: the same bytes on every CPU.
//
// What each type becomes (every value and scale copied, none recomputed, so the packed weights are
// exactly the file's):
//   Q4_0, Q4_1        4-bit group blocks (kernels.h kGroupBlocks): fp16 d (Q4_1: and m; Q4_0: offset 8);
//   Q5_0, Q5_1        5-bit group blocks (8-bit ones where five_bit is false), offset 16 / m;
//   Q8_0              8-bit group blocks (q + 128), offset 128;
//   Q4_K, Q5_K, Q6_K  their super-block layouts (kernels.h kSuperBlocks).

#include <cstring>
#include <vector>

#include "kernels.h"

namespace outrider_native {

namespace {

uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

struct BlockType {
  int64_t elements, bytes;
};

BlockType block_type(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// One row's values and scales, as the file holds them: q (Q8_0: q + 128), and per group of 32 (K
// types: per super-block) the raw fp16 d and m / dmin, and per sub-block the K types' sc and mn.
struct Row {
  std::vector<uint8_t> q;
  std::vector<uint16_t> d, m;    // per group (legacy) or super-block (K)
  std::vector<int32_t> sc, mn;   // per sub-block (K): Q4_K/Q5_K 8 per super-block, Q6_K 16 (sc only)
};

// Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) pairs: pair j (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, int32_t* sc, int32_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void decode_row(int type, const uint8_t* src, int64_t cols, Row& row) {
  const BlockType bt = block_type(type);
  const int64_t blocks = cols / bt.elements;
  row.q.assign(cols, 0);
  row.d.assign(blocks, 0);
  row.m.assign(blocks, 0);
  row.sc.assign(blocks * 16, 0);
  row.mn.assign(blocks * 16, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = src + b * bt.bytes;
    uint8_t* q = row.q.data() + b * bt.elements;
    switch (type) {
      case kQ4_0:
      case kQ4_1: {
        const uint8_t* qs = blk + (type == kQ4_0 ? 2 : 4);
        row.d[b] = read_u16(blk);
        if (type == kQ4_1) row.m[b] = read_u16(blk + 2);
        for (int j = 0; j < 16; ++j) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
        break;
      }
      case kQ5_0:
      case kQ5_1: {
        const int at = type == kQ5_0 ? 2 : 4;
        row.d[b] = read_u16(blk);
        if (type == kQ5_1) row.m[b] = read_u16(blk + 2);
        uint32_t qh;
        std::memcpy(&qh, blk + at, 4);
        const uint8_t* qs = blk + at + 4;
        for (int j = 0; j < 16; ++j) {
          q[j] = static_cast<uint8_t>((qs[j] & 15) | (((qh >> j) & 1) << 4));
          q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        break;
      }
      case kQ8_0:
        row.d[b] = read_u16(blk);
        for (int j = 0; j < 32; ++j) q[j] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + j]) + 128);
        break;
      case kQ4_K:
      case kQ5_K: {
        row.d[b] = read_u16(blk);
        row.m[b] = read_u16(blk + 2);
        for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &row.sc[b * 16 + j], &row.mn[b * 16 + j]);
        const uint8_t* qh = blk + 16;                         // Q5_K: bit j of byte l: sub-block j, element l
        const uint8_t* qs = blk + (type == kQ4_K ? 16 : 48);  // 4 x 32 bytes: sub-blocks 2i (low), 2i+1 (high)
        for (int i = 0; i < 4; ++i)
          for (int l = 0; l < 32; ++l) {
            uint8_t lo = qs[32 * i + l] & 15, hi = qs[32 * i + l] >> 4;
            if (type == kQ5_K) {
              lo |= static_cast<uint8_t>(((qh[l] >> (2 * i)) & 1) << 4);
              hi |= static_cast<uint8_t>(((qh[l] >> (2 * i + 1)) & 1) << 4);
            }
            q[64 * i + l] = lo;
            q[64 * i + 32 + l] = hi;
          }
        break;
      }
      case kQ6_K: {
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        for (int j = 0; j < 16; ++j) row.sc[b * 16 + j] = static_cast<int8_t>(blk[192 + j]);
        row.d[b] = read_u16(blk + 208);
        for (int n = 0; n < 2; ++n)  // two halves of 128 (ggml's dequantize_row_q6_K)
          for (int l = 0; l < 32; ++l) {
            const uint8_t* a = ql + 64 * n;
            const uint8_t h = qh[32 * n + l];
            uint8_t* o = q + 128 * n;
            o[l] = static_cast<uint8_t>((a[l] & 15) | ((h & 3) << 4));
            o[l + 32] = static_cast<uint8_t>((a[l + 32] & 15) | (((h >> 2) & 3) << 4));
            o[l + 64] = static_cast<uint8_t>((a[l] >> 4) | (((h >> 4) & 3) << 4));
            o[l + 96] = static_cast<uint8_t>((a[l + 32] >> 4) | (((h >> 6) & 3) << 4));
          }
        break;
      }
      default: break;
    }
  }
}

// The 4-bit layout's 64 bytes of oct j of a tile (q: 16 rows of values).
void nibble_oct(const Row* rows, int64_t j, uint8_t* out) {
  for (int i = 0; i < 16; ++i)
    for (int p = 0; p < 4; ++p)
      out[4 * i + p] = static_cast<uint8_t>((rows[i].q[8 * j + p] & 15) | ((rows[i].q[8 * j + 4 + p] & 15) << 4));
}

// Bit 4 of each lane's value (lane L = 4i + p) into the 8 + 8 byte plane of the 5-bit layout.
void fifth_bits(const Row* rows, int64_t j, uint8_t* out) {
  std::memset(out, 0, 16);
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < 16; ++i)
      for (int p = 0; p < 4; ++p) {
        const int lane = 4 * i + p;
        if ((rows[i].q[8 * j + 4 * half + p] >> 4) & 1) out[8 * half + lane / 8] |= static_cast<uint8_t>(1 << (lane % 8));
      }
}

// Q6_K's 2-bit high parts of oct j: 16 bytes for the low nibbles' lanes, 16 for the high ones'.
void crumbs(const Row* rows, int64_t j, uint8_t* out) {
  std::memset(out, 0, 32);
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < 16; ++i)
      for (int p = 0; p < 4; ++p) {
        const int lane = 4 * i + p;
        const int crumb = (rows[i].q[8 * j + 4 * half + p] >> 4) & 3;
        out[16 * half + lane % 16] |= static_cast<uint8_t>(crumb << (2 * (lane / 16)));
      }
}

}  // namespace

bool packed_shape(int type, int64_t cols, bool five_bit, PackedShape* shape, const char** why) {
  const BlockType bt = block_type(type);
  if (bt.elements == 0) {
    *why = "is not a block type the kernels take (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)";
    return false;
  }
  if (cols <= 0 || cols % bt.elements != 0) {
    *why = "has rows that are not a whole number of its blocks";
    return false;
  }
  switch (type) {
    case kQ4_0: *shape = {kGroupBlocks | with_offset(4, 3), 32, 0}; break;
    case kQ4_1: *shape = {kGroupBlocks | 4, 32, 0}; break;
    case kQ5_0: *shape = {kGroupBlocks | with_offset(five_bit ? 5 : 8, 4), 32, 0}; break;
    case kQ5_1: *shape = {kGroupBlocks | (five_bit ? 5 : 8), 32, 0}; break;
    case kQ8_0: *shape = {kGroupBlocks | with_offset(8, 7), 32, 0}; break;
    default: *shape = {kSuperBlocks | (type == kQ4_K ? 4 : type == kQ5_K ? 5 : 6), kSuper, 0};
  }
  shape->w_tile_bytes = cols / shape->group * (is_super(shape->bits) ? super_block_bytes(shape->bits & 15)
                                                                      : group_block_bytes(shape->bits));
  return true;
}

void pack_gguf_tiles(int type, const PackedShape& shape, const uint8_t* src, int64_t src_rows, int64_t cols,
                     const int64_t* row_map, int64_t t0, int64_t t1, uint8_t* w) {
  const BlockType bt = block_type(type);
  const int64_t row_bytes = cols / bt.elements * bt.bytes;
  const int layout = shape.bits & 15;
  Row rows[16];
  for (int64_t t = t0; t < t1; ++t) {
    for (int i = 0; i < 16; ++i) {
      const int64_t r = 16 * t + i;
      const int64_t s = row_map != nullptr ? row_map[r] : (r < src_rows ? r : -1);
      if (s >= 0 && s < src_rows) {
        decode_row(type, src + s * row_bytes, cols, rows[i]);
      } else {  // padding: zero weights (every scale 0)
        const int64_t blocks = cols / bt.elements;
        rows[i].q.assign(cols, 0);
        rows[i].d.assign(blocks, 0);
        rows[i].m.assign(blocks, 0);
        rows[i].sc.assign(blocks * 16, 0);
        rows[i].mn.assign(blocks * 16, 0);
      }
    }
    uint8_t* wt = w + t * shape.w_tile_bytes;
    if (is_group_blocks(shape.bits)) {
      const int64_t block_bytes = group_block_bytes(shape.bits);
      const bool has_m = ((shape.bits >> kOffsetShift) & 15) == 0;
      for (int64_t g = 0; g < cols / 32; ++g) {
        uint8_t* out = wt + g * block_bytes;
        for (int i = 0; i < 16; ++i) {
          std::memcpy(out + 2 * i, &rows[i].d[g], 2);
          if (has_m) std::memcpy(out + 32 + 2 * i, &rows[i].m[g], 2);
        }
        uint8_t* values = out + (has_m ? 64 : 32);
        if (layout == 8) {
          for (int64_t k = 0; k < 8; ++k)
            for (int i = 0; i < 16; ++i)
              for (int p = 0; p < 4; ++p) values[64 * k + 4 * i + p] = rows[i].q[32 * g + 4 * k + p];
        } else {
          const int oct_bytes = layout == 5 ? 80 : 64;
          for (int64_t o = 0; o < 4; ++o) {
            nibble_oct(rows, 4 * g + o, values + o * oct_bytes);
            if (layout == 5) fifth_bits(rows, 4 * g + o, values + o * oct_bytes + 64);
          }
        }
      }
    } else {  // super blocks
      const int64_t block_bytes = super_block_bytes(layout), octs = kSuper / 8;
      const int oct_bytes = layout == 4 ? 64 : layout == 5 ? 80 : 96;
      for (int64_t b = 0; b < cols / kSuper; ++b) {
        uint8_t* out = wt + b * block_bytes;
        for (int i = 0; i < 16; ++i) std::memcpy(out + 2 * i, &rows[i].d[b], 2);
        uint8_t* octs_at;
        if (layout == 6) {
          for (int g = 0; g < 16; ++g)
            for (int i = 0; i < 16; ++i) out[32 + 16 * g + i] = static_cast<uint8_t>(rows[i].sc[b * 16 + g]);
          octs_at = out + 288;
        } else {
          for (int i = 0; i < 16; ++i) std::memcpy(out + 32 + 2 * i, &rows[i].m[b], 2);
          for (int g = 0; g < 8; ++g)
            for (int i = 0; i < 16; ++i) {
              out[64 + 16 * g + i] = static_cast<uint8_t>(rows[i].sc[b * 16 + g]);
              out[192 + 16 * g + i] = static_cast<uint8_t>(rows[i].mn[b * 16 + g]);
            }
          octs_at = out + 320;
        }
        for (int64_t o = 0; o < octs; ++o) {
          const int64_t j = b * octs + o;
          uint8_t* oct = octs_at + o * oct_bytes;
          nibble_oct(rows, j, oct);
          if (layout == 5) fifth_bits(rows, j, oct + 64);
          if (layout == 6) crumbs(rows, j, oct + 64);
        }
      }
    }
  }
}

void dequantize_group_rows(const uint8_t* w, int bits, int64_t in, const int64_t* ids, int64_t n, float* out) {
  const int64_t block_bytes = group_block_bytes(bits), groups = in / 32;
  const int layout = bits & 15, log2_offset = (bits >> kOffsetShift) & 15;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = ids[r] / 16, i = ids[r] % 16;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* block = w + (t * groups + g) * block_bytes;
      const float d = half_to_float(read_u16(block + 2 * i));
      // As the separate tables' lookups (native_model._Rows): w = q d + m, m = -offset d for a symmetric type.
      const float m = log2_offset ? -static_cast<float>(1 << log2_offset) * d : half_to_float(read_u16(block + 32 + 2 * i));
      const uint8_t* values = block + (log2_offset ? 32 : 64);
      float* y = out + r * in + g * 32;
      for (int k = 0; k < 32; ++k) {
        int q;
        if (layout == 8) {
          q = values[64 * (k / 4) + 4 * i + k % 4];
        } else {
          const int oct_bytes = layout == 5 ? 80 : 64, half = (k % 8) / 4, p = k % 4, lane = static_cast<int>(4 * i + p);
          const uint8_t* oct = values + (k / 8) * oct_bytes;
          q = half ? oct[lane] >> 4 : oct[lane] & 15;
          if (layout == 5) q |= ((oct[64 + 8 * half + lane / 8] >> (lane % 8)) & 1) << 4;
        }
        y[k] = static_cast<float>(q) * d + m;
      }
    }
  }
}

void dequantize_super_rows(const uint8_t* w, int layout, int64_t in, const int64_t* ids, int64_t n, float* out) {
  const int64_t block_bytes = super_block_bytes(layout), blocks = in / kSuper;
  const int oct_bytes = layout == 4 ? 64 : layout == 5 ? 80 : 96;
  const int64_t octs_at = layout == 6 ? 288 : 320;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = ids[r] / 16, i = ids[r] % 16;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + (t * blocks + b) * block_bytes;
      const float d = half_to_float(read_u16(blk + 2 * i));
      const float dmin = layout == 6 ? 0.f : half_to_float(read_u16(blk + 32 + 2 * i));
      float* y = out + r * in + b * kSuper;
      for (int k = 0; k < kSuper; ++k) {
        const uint8_t* oct = blk + octs_at + (k / 8) * oct_bytes;
        const int half = (k % 8) / 4, p = k % 4, lane = static_cast<int>(4 * i + p);
        int q = half ? oct[lane] >> 4 : oct[lane] & 15;
        if (layout == 5) q |= ((oct[64 + 8 * half + lane / 8] >> (lane % 8)) & 1) << 4;
        if (layout == 6) q |= ((oct[64 + 16 * half + lane % 16] >> (2 * (lane / 16))) & 3) << 4;
        if (layout == 6) {
          const float scale = d * static_cast<float>(static_cast<int8_t>(blk[32 + 16 * (k / 16) + i]));
          y[k] = scale * static_cast<float>(q - 32);
        } else {
          const float scale = d * static_cast<float>(blk[64 + 16 * (k / 32) + i]);
          const float minimum = dmin * static_cast<float>(blk[192 + 16 * (k / 32) + i]);
          y[k] = scale * static_cast<float>(q) - minimum;
        }
      }
    }
  }
}

}  // namespace outrider_native
