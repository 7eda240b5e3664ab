// Every kernel set this CPU runs against the scalar reference, bit for bit, without torch: the
// check that runs natively on x86 and, cross-compiled, under qemu-user on ARM
// (tests/test_native_isa.py builds and runs it).
//
//   check_kernels          run every check; prints one line per failure and "N passed, M failed"
//   check_kernels --active print the set the dispatcher picks here, and the CPU features it read

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels.h"

namespace outrider_native {
// Serial, in uneven chunks (as several threads would split the range).
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  for (int64_t begin = 0; begin < n; begin += 3) fn(begin, begin + 3 < n ? begin + 3 : n);
}
}  // namespace outrider_native

using namespace outrider_native;

namespace {

uint64_t g_state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {  // xorshift64*
  g_state ^= g_state >> 12;
  g_state ^= g_state << 25;
  g_state ^= g_state >> 27;
  return static_cast<uint32_t>((g_state * 0x2545F4914F6CDD1Dull) >> 32);
}
float uniform(float lo, float hi) { return lo + (hi - lo) * (next_u32() >> 8) * (1.f / 16777216.f); }
std::vector<float> floats(int64_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (float& x : v) x = uniform(lo, hi);
  return v;
}
std::vector<uint8_t> bytes(int64_t n) {
  std::vector<uint8_t> v(n);
  for (uint8_t& x : v) x = static_cast<uint8_t>(next_u32());
  return v;
}
std::vector<uint16_t> halves(int64_t n, bool negative) {  // normal fp16 values of magnitude ~2^-9 .. 2^-3
  std::vector<uint16_t> v(n);
  for (uint16_t& h : v) {
    const uint32_t r = next_u32();
    h = static_cast<uint16_t>(((negative && (r & 1)) ? 0x8000 : 0) | ((6 + (r >> 1) % 7) << 10) | ((r >> 8) & 0x3FF));
  }
  return v;
}

int g_passed = 0, g_failed = 0;

template <class T>
void expect_same(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) {
    ++g_passed;
    return;
  }
  ++g_failed;
  size_t first = 0;
  while (first < got.size() && std::memcmp(&got[first], &want[first], sizeof(T)) == 0) ++first;
  std::printf("FAIL %s: differs from scalar at element %zu of %zu\n", what.c_str(), first, got.size());
}

using Run = std::function<std::vector<float>()>;

// Runs `run` on the scalar reference and on `set`, and compares the bytes.
void against_scalar(const KernelSet& set, const std::string& what, const Run& run) {
  select_kernels("scalar");
  const std::vector<float> want = run();
  select_kernels(set.name);
  const std::vector<float> got = run();
  expect_same(std::string(set.name) + " " + what, got, want);
}

// A random super-block weight (kernels.h kSuperBlocks | layout) of `out` outputs and `in` inputs: random
// bytes, with normal fp16 values at d (and dmin); `fill` (when not 0) every other byte.
std::vector<uint8_t> super_weight(int layout, int64_t out, int64_t in, int fill) {
  const int64_t block = super_block_bytes(layout), blocks = out / 16 * (in / kSuper);
  std::vector<uint8_t> w = fill ? std::vector<uint8_t>(blocks * block, static_cast<uint8_t>(fill)) : bytes(blocks * block);
  for (int64_t b = 0; b < blocks; ++b) {
    const std::vector<uint16_t> d = halves(layout == 6 ? 16 : 32, true);
    std::memcpy(w.data() + b * block, d.data(), d.size() * 2);
  }
  return w;
}

void check_super(const KernelSet& set) {
  const int64_t out = 80;  // 5 tiles: AVX-512's 4-tile step and its tail
  for (int layout : {4, 5, 6}) {
    for (int64_t in : {256, 512, 1536}) {
      const std::vector<uint8_t> w = super_weight(layout, out, in, 0);
      for (int64_t rows : {1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25}) {
        const std::vector<float> x = floats(rows * in, -3.f, 3.f);
        against_scalar(set, "matmul super-block Q" + std::to_string(layout) + "_K rows " + std::to_string(rows) +
                                " in " + std::to_string(in), [&] {
          std::vector<float> y(rows * out);
          a8_matmul(x.data(), rows, in, kSuper, w.data(), nullptr, nullptr, out, kSuperBlocks | layout, y.data());
          return y;
        });
      }
    }
    for (float value : {1.f, -1.f}) {  // the largest sums: every value and scale at its top
      const std::vector<uint8_t> w = super_weight(layout, out, 512, 0xFF);
      const std::vector<float> x(2 * 512, value);
      against_scalar(set, "matmul super-block Q" + std::to_string(layout) + "_K extreme x " + std::to_string(value), [&] {
        std::vector<float> y(2 * out);
        a8_matmul(x.data(), 2, 512, kSuper, w.data(), nullptr, nullptr, out, kSuperBlocks | layout, y.data());
        return y;
      });
    }
  }
}

// A group-block weight (kernels.h kGroupBlocks, code `bits`, `block` bytes a block) of `out` outputs
// and `in` inputs: random bytes, or `fill` (when not 0) in every byte, with normal fp16 values in each
// block's header (scale, and minimum where has_m).
std::vector<uint8_t> group_weight(int64_t block, bool has_m, int64_t out, int64_t in, int fill) {
  const int64_t blocks = out / 16 * (in / 32);
  std::vector<uint8_t> w = fill ? std::vector<uint8_t>(blocks * block, static_cast<uint8_t>(fill)) : bytes(blocks * block);
  for (int64_t b = 0; b < blocks; ++b) {
    const std::vector<uint16_t> header = halves(has_m ? 32 : 16, true);
    std::memcpy(w.data() + b * block, header.data(), header.size() * 2);
  }
  return w;
}

// The simple GGUF types at their file's bytes (kernels.h kGroupBlocks): random values, normal fp16
// scales (and minimums) in each block's header; with and without minimums (Q4_1 / Q4_0 and kin).
void check_groups(const KernelSet& set) {
  const int64_t out = 80;
  for (int layout : {4, 5, 8}) {
    for (bool has_m : {true, false}) {
      const int bits = kGroupBlocks | (has_m ? layout : with_offset(layout, layout == 4 ? 3 : layout == 5 ? 4 : 7));
      const int64_t block = group_block_bytes(bits);
      for (int64_t in : {32, 576}) {
        const std::vector<uint8_t> w = group_weight(block, has_m, out, in, 0);
        for (int64_t rows : {1, 2, 5, 8, 9, 12, 13, 17, 25}) {
          const std::vector<float> x = floats(rows * in, -3.f, 3.f);
          against_scalar(set, "matmul group blocks w" + std::to_string(layout) + (has_m ? " with minimums" : "") +
                                  " rows " + std::to_string(rows) + " in " + std::to_string(in), [&] {
            std::vector<float> y(rows * out);
            a8_matmul(x.data(), rows, in, 32, w.data(), nullptr, nullptr, out, bits, y.data());
            return y;
          });
        }
      }
      for (float value : {1.f, -1.f}) {  // the largest sums a path may hold (AVX2 sums in 16 bits)
        const int64_t in = 256;
        const std::vector<uint8_t> w = group_weight(block, has_m, out, in, 0xFF);
        const std::vector<float> x(4 * in, value);
        against_scalar(set, "matmul group blocks w" + std::to_string(layout) + (has_m ? " with minimums" : "") +
                                " extreme x " + std::to_string(value), [&] {
          std::vector<float> y(4 * out);
          a8_matmul(x.data(), 4, in, 32, w.data(), nullptr, nullptr, out, bits, y.data());
          return y;
        });
      }
    }
  }
}

void check_set(const KernelSet& set) {
  check_super(set);
  check_groups(set);
  // Quantization of activations, and the matmuls on 4- and 8-bit weights.
  const int64_t out = 80;  // 5 tiles: AVX-512's 4-tile step and its tail
  for (int64_t in : {64, 576, 1536}) {
    const int64_t group = 32;
    for (int bits : {4, 5, 8}) {
      const std::vector<uint8_t> w = bytes(out * in * bits / 8);
      const std::vector<uint16_t> d = halves(out * in / group, false), m = halves(out * in / group, true);
      for (int64_t rows : {1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25}) {
        const std::vector<float> x = floats(rows * in, -3.f, 3.f);
        against_scalar(set, "matmul w" + std::to_string(bits) + " rows " + std::to_string(rows) + " in " +
                                std::to_string(in), [&] {
          std::vector<float> y(rows * out);
          a8_matmul(x.data(), rows, in, group, w.data(), d.data(), m.data(), out, bits, y.data());
          return y;
        });
      }
    }
    for (int bits : {4, 5, 8}) {  // fp32 scale tables (kF32Scales: GGUF K types), groups of 32 and 16 (Q6_K)
      for (int64_t g : {int64_t(32), int64_t(16)}) {
        const std::vector<uint8_t> w = bytes(out * in * bits / 8);
        const std::vector<float> d = floats(out * in / g, 1e-4f, 2e-2f), m = floats(out * in / g, -0.3f, 0.3f);
        for (int64_t rows : {1, 5, 9}) {
          const std::vector<float> x = floats(rows * in, -3.f, 3.f);
          against_scalar(set, "matmul w" + std::to_string(bits) + " fp32 scales group " + std::to_string(g) +
                                  " rows " + std::to_string(rows) + " in " + std::to_string(in), [&] {
            std::vector<float> y(rows * out);
            a8_matmul(x.data(), rows, in, g, w.data(), d.data(), m.data(), out, bits | kF32Scales, y.data());
            return y;
          });
        }
      }
    }
    for (int bits : {5, 8}) {  // symmetric types: no minimums table, m = -offset d in the kernel
      const std::vector<uint8_t> w = bytes(out * in * bits / 8);
      const std::vector<uint16_t> d = halves(out * in / group, false);
      for (int f32 : {0, 1}) {
        const std::vector<float> d32 = floats(out * in / group, 1e-4f, 2e-2f);
        const std::vector<float> x = floats(3 * in, -3.f, 3.f);
        against_scalar(set, "matmul w" + std::to_string(bits) + " symmetric" + (f32 ? " fp32" : "") + " in " +
                                std::to_string(in), [&] {
          std::vector<float> y(3 * out);
          const void* dp = f32 ? static_cast<const void*>(d32.data()) : static_cast<const void*>(d.data());
          a8_matmul(x.data(), 3, in, group, w.data(), dp, nullptr, out,
                    with_offset(bits | (f32 ? kF32Scales : 0), bits == 8 ? 7 : 4), y.data());
          return y;
        });
      }
    }
    for (uint8_t fill : {uint8_t(0xFF), uint8_t(0x00)}) {  // the largest sums a path may have to hold
      for (float value : {1.f, -1.f}) {
        const std::vector<uint8_t> w(out * in, fill);
        const std::vector<uint16_t> d = halves(out * in / group, false), m = halves(out * in / group, true);
        const std::vector<float> x(2 * in, value);
        for (int bits : {4, 5, 8})
          against_scalar(set, "matmul w" + std::to_string(bits) + " extreme " + std::to_string(fill) + " x " +
                                  std::to_string(value) + " in " + std::to_string(in), [&] {
            std::vector<float> y(2 * out);
            a8_matmul(x.data(), 2, in, group, w.data(), d.data(), m.data(), out, bits, y.data());
            return y;
          });
      }
    }
    const int64_t rows = 3;
    std::vector<float> x = floats(rows * in, -2.f, 2.f);
    x[5] = 0.f;
    for (int64_t k = 0; k < group; ++k) x[in + k] = 0.f;  // an all-zero group (scale 0)
    auto quantized = [&](const KernelSet& ks) {
      std::vector<int8_t> xq(rows * in);
      std::vector<float> scale(rows * in / group), sum(rows * in / group);
      std::vector<int32_t> isum(rows * in / group);
      ks.quantize_rows(x.data(), rows, in, group, xq.data(), scale.data(), sum.data(), isum.data());
      std::vector<float> all(xq.begin(), xq.end());
      all.insert(all.end(), scale.begin(), scale.end());
      all.insert(all.end(), sum.begin(), sum.end());
      all.insert(all.end(), isum.begin(), isum.end());
      return all;
    };
    expect_same(std::string(set.name) + " quantize in " + std::to_string(in), quantized(set), quantized(kScalar));
  }

  // Attention of one row and KV head over a subset of the keys.
  for (int64_t dim : {16, 32, 64, 128, 256}) {
    for (int64_t group : {1, 3, 4, 5}) {
      for (int64_t count : {1, 7, 16, 17, 33, 300}) {
        const int64_t keys = count + 11;
        const std::vector<float> k = floats(keys * dim, -1.f, 1.f), v = floats(keys * dim, -1.f, 1.f);
        const std::vector<float> q = floats(group * dim, -4.f, 4.f);
        std::vector<int64_t> pos;
        for (int64_t i = 0; i < keys && static_cast<int64_t>(pos.size()) < count; ++i)
          if (next_u32() % 8 || keys - i <= count - static_cast<int64_t>(pos.size())) pos.push_back(i);
        const std::string what = "attend dim " + std::to_string(dim) + " group " + std::to_string(group) +
                                 " keys " + std::to_string(count);
        auto run = [&](const KernelSet& ks, float cap) {
          std::vector<float> scores(group * (count + 16)), out(group * dim);
          ks.attend_group(q.data(), group, dim, k.data(), v.data(), pos.data(), count, scores.data(), out.data(),
                          cap);
          return out;
        };
        expect_same(std::string(set.name) + " " + what, run(set, 0.f), run(kScalar, 0.f));
        expect_same(std::string(set.name) + " soft-capped " + what, run(set, 2.5f), run(kScalar, 2.5f));
        std::vector<uint16_t> k16(k.size()), v16(v.size());  // the same over an fp16 cache
        for (size_t i = 0; i < k.size(); ++i) k16[i] = float_to_half(k[i]), v16[i] = float_to_half(v[i]);
        auto run16 = [&](const KernelSet& ks) {
          std::vector<float> scores(group * (count + 16)), out(group * dim);
          ks.attend_group_f16(q.data(), group, dim, k16.data(), v16.data(), pos.data(), count, scores.data(),
                              out.data(), 0.f);
          return out;
        };
        expect_same(std::string(set.name) + " fp16 cache " + what, run16(set), run16(kScalar));
        if (dim % 32 == 0) {  // the same over a q8_0 cache (rows quantized as attend writes them)
          const int64_t bytes = q8_row_bytes(dim);
          std::vector<int8_t> k8(keys * bytes), v8(keys * bytes);
          for (int64_t i = 0; i < keys; ++i) {
            quantize_q8_row(k.data() + i * dim, dim, k8.data() + i * bytes);
            quantize_q8_row(v.data() + i * dim, dim, v8.data() + i * bytes);
          }
          auto run8 = [&](const KernelSet& ks) {
            std::vector<float> scores(group * (count + 16)), out(group * dim);
            ks.attend_group_q8(q.data(), group, dim, k8.data(), v8.data(), pos.data(), count, scores.data(),
                               out.data(), 0.f);
            return out;
          };
          expect_same(std::string(set.name) + " q8_0 cache " + what, run8(set), run8(kScalar));
        }
      }
    }
  }

  // RMSNorm, SwiGLU and GeGLU (gates far enough out to reach exp's clamps), the residual add.
  {
    const int64_t rows = 3, hidden = 576, inter = 1536;
    const std::vector<float> x = floats(rows * hidden, -5.f, 5.f), w = floats(hidden, -1.f, 1.f);
    const std::vector<float> gu = floats(rows * 2 * inter, -100.f, 100.f);
    auto norm = [&](const KernelSet& ks) {
      std::vector<float> y(rows * hidden);
      ks.rms_norm_rows(x.data(), w.data(), 1e-5f, rows, hidden, y.data());
      return y;
    };
    auto swiglu = [&](const KernelSet& ks) {
      std::vector<float> y(rows * inter);
      ks.swiglu_rows(gu.data(), rows, inter, y.data());
      return y;
    };
    auto geglu = [&](const KernelSet& ks) {
      std::vector<float> y(rows * inter);
      ks.geglu_rows(gu.data(), rows, inter, y.data());
      return y;
    };
    auto add = [&](const KernelSet& ks) {
      std::vector<float> y(x);
      ks.add_rows(y.data(), gu.data(), 37);
      return y;
    };
    expect_same(std::string(set.name) + " rms_norm", norm(set), norm(kScalar));
    expect_same(std::string(set.name) + " swiglu", swiglu(set), swiglu(kScalar));
    expect_same(std::string(set.name) + " geglu", geglu(set), geglu(kScalar));
    expect_same(std::string(set.name) + " add", add(set), add(kScalar));
  }

  // A whole step of a small model: two sequences, one decoding a token, one verifying a tree of 4.
  {
    const int64_t hidden = 64, inter = 128, heads = 4, kv_heads = 2, dim = 16, num_layers = 2, group = 32;
    const int64_t width = (heads + 2 * kv_heads) * dim, slots = 2, capacity = 40;
    struct Owned {
      std::vector<uint8_t> w[4];
      std::vector<uint16_t> d[4], m[4];
      std::vector<float> norms[2];
    } owned[num_layers];
    std::vector<LayerWeights> layers(num_layers);
    const int64_t shapes[4][2] = {{width, hidden}, {hidden, heads * dim}, {2 * inter, hidden}, {hidden, inter}};
    for (int64_t li = 0; li < num_layers; ++li) {
      for (int j = 0; j < 4; ++j) {
        owned[li].w[j] = bytes(shapes[j][0] * shapes[j][1] / 2);
        owned[li].d[j] = halves(shapes[j][0] * shapes[j][1] / group, false);
        owned[li].m[j] = halves(shapes[j][0] * shapes[j][1] / group, true);
        layers[li].w[j] = owned[li].w[j].data();
        layers[li].d[j] = owned[li].d[j].data();
        layers[li].m[j] = owned[li].m[j].data();
      }
      owned[li].norms[0] = floats(hidden, 0.5f, 1.5f);
      owned[li].norms[1] = floats(hidden, 0.5f, 1.5f);
      layers[li].attn_norm = owned[li].norms[0].data();
      layers[li].mlp_norm = owned[li].norms[1].data();
    }
    const int64_t rows = 5;
    const std::vector<float> x0 = floats(rows * hidden, -1.f, 1.f);
    const std::vector<float> cos = floats(rows * dim, -1.f, 1.f), sin = floats(rows * dim, -1.f, 1.f);
    const std::vector<float> kv0 = floats(num_layers * 2 * slots * kv_heads * capacity * dim, -1.f, 1.f);
    const int64_t chunks[8] = {0, 0, 1, 12, 1, 1, 4, 20};  // (slot, start, n, length)
    std::vector<char> visible_store(rows * 4, 0);
    const int tree[4][4] = {{1, 0, 0, 0}, {1, 1, 0, 0}, {1, 0, 1, 0}, {1, 1, 0, 1}};
    visible_store[0] = 1;
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) visible_store[(1 + r) * 4 + c] = static_cast<char>(tree[r][c]);
    const bool* visible = reinterpret_cast<const bool*>(visible_store.data());
    auto step = [&]() {
      std::vector<float> x(x0), kv(kv0);
      std::vector<KvLayer> cache(num_layers);
      const int64_t per_layer = 2 * slots * kv_heads * capacity * dim;
      for (int64_t li = 0; li < num_layers; ++li)
        cache[li] = {kv.data() + li * per_layer, slots, capacity, slots * kv_heads * capacity * dim,
                     kv_heads * capacity * dim, capacity * dim};
      w4a8_layers(x.data(), rows, hidden, cos.data(), sin.data(), cache.data(), layers.data(), num_layers, chunks, 2,
                  visible, 4, group, heads, kv_heads, dim, inter, 1e-5f);
      x.insert(x.end(), kv.begin(), kv.end());
      return x;
    };
    against_scalar(set, "w4a8_layers", step);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--active") == 0) {
    std::printf("%s\n%s\n", active_kernels().name, cpu_features());
    return 0;
  }
  // The inline fp16 conversion (a q8_0 cache's scales) against the reference, on every bit pattern.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = half_bits_to_float(static_cast<uint16_t>(h)), b = half_to_float(static_cast<uint16_t>(h));
    if (std::memcmp(&a, &b, sizeof a) != 0) {
      std::printf("FAIL half_bits_to_float(0x%04x)\n", h);
      ++g_failed;
    }
  }
  int ran = 0;
  for (int i = 0; i < kernel_set_count(); ++i) {
    const KernelSet& set = kernel_set(i);
    if (std::strcmp(set.name, "scalar") == 0) continue;
    if (!cpu_runs(set)) {
      std::printf("skip %s: this CPU lacks it\n", set.name);
      continue;
    }
    std::printf("check %s\n", set.name);
    check_set(set);
    ++ran;
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 && ran > 0 ? 0 : 1;
}
