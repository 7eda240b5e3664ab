// The native core (kernels.h) as a plain C ABI (c_api.h) for a process without torch: built into
// outrider_llm._native_c (setup.py) from the torch-free sources and loaded with ctypes
// (native_c.py). Serving a GGUF model this way skips torch's import (~260 MB, seconds).
//
// The core's parallel_for here is OpenMP's: [0, n) in contiguous chunks, one per thread, in a
// team of outrider_set_threads' count (a process-global: the kernels run on whichever thread
// calls them, not the one that configured; omp_set_num_threads would bind only the latter).
//
// Every check a caller's arguments can fail (shapes, divisibility, the bits code, the chunk table)
// runs before anything is computed and returns its message: nothing here aborts on bad input.
// Pointers are taken as given: the binding owns the memory and sizes it (native_c.py checks the
// arrays' dtypes, contiguity and shapes against these sizes).
//
// outrider_llama_layers checks its layer table and runs the one decoder layer body (layers.cpp),
// which the torch binding's w4a8_layers runs too.

#include "c_api.h"

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

namespace outrider_native {

namespace {

std::atomic<int> g_threads{0};  // 0: not set, the processors this process may use

int default_threads() {
#ifdef _OPENMP
  return std::max(1, omp_get_num_procs());  // libgomp counts the affinity mask's CPUs
#else
  return 1;
#endif
}

int thread_count() {
  const int set = g_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : default_threads();
}

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t chunks = std::min<int64_t>(thread_count(), n);
  if (chunks < 2) {
    fn(0, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    // The team may be smaller than asked (nested, OMP_THREAD_LIMIT): split by the team it got.
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = n * t / team, end = n * (t + 1) / team;
    if (begin < end) fn(begin, end);
  }
#else
  fn(0, n);
#endif
}

}  // namespace outrider_native

namespace {

using namespace outrider_native;

// Writes the message into err (when there is room) and returns 1: `return fail(...)`.
int fail(char* err, int64_t err_size, const char* format, ...) __attribute__((format(printf, 3, 4)));
int fail(char* err, int64_t err_size, const char* format, ...) {
  if (err != nullptr && err_size > 0) {
    va_list args;
    va_start(args, format);
    std::vsnprintf(err, static_cast<size_t>(err_size), format, args);
    va_end(args);
  }
  return 1;
}

using ll = long long;

// What a message names ("a8_matmul", "layer 3", "layer 3 qkv part 1"): formatted only into a
// message (a layer stack's checks run every call; formatting each part's name cost ~20 us).
struct Where {
  const char* op;
  int64_t layer = -1;
  const char* matrix = nullptr;
  int part = -1;
};

struct Name {
  char text[96];
  explicit Name(const Where& where) {
    if (where.layer < 0)
      std::snprintf(text, sizeof text, "%s", where.op);
    else if (where.matrix == nullptr)
      std::snprintf(text, sizeof text, "layer %lld", static_cast<ll>(where.layer));
    else if (where.part < 0)
      std::snprintf(text, sizeof text, "layer %lld %s", static_cast<ll>(where.layer), where.matrix);
    else
      std::snprintf(text, sizeof text, "layer %lld %s part %d", static_cast<ll>(where.layer), where.matrix,
                    where.part);
  }
};

// Inputs per block of one tile in the layout of `bits` (4- and 5-bit: 8, 8-bit: 4), or 0 for a code
// that is not one the kernels take; `why` says what is wrong with it.
int64_t layout_block(int bits, bool has_m, const char** why) {
  const int layout = bits & 15, log2_offset = (bits >> kOffsetShift) & 15;
  const int known = 15 | kF32Scales | (15 << kOffsetShift);
  if (bits < 0 || (bits & ~known) != 0 || (layout != 4 && layout != 5 && layout != 8)) {
    *why = "must be 4, 5 or 8, or-ed with 16 (fp32 tables) and log2(offset) << 8";
    return 0;
  }
  if (log2_offset == 0 && !has_m) {
    *why = "has no offset (log2(offset) << 8), so the minimums table m must be given";
    return 0;
  }
  if (log2_offset != 0 && has_m) {
    *why = "carries an offset (a symmetric type: m = -offset * d), so m must be NULL";
    return 0;
  }
  return layout == 8 ? 4 : 8;
}

// The checks of one weight [out, in] in groups of `group`; 0 or fail()'s 1, the message prefixed
// with `where`'s name.
int check_weight(const uint8_t* w, const void* d, const void* m, int64_t out, int64_t in, int64_t group, int bits,
                 const Where& where, char* err, int64_t err_size) {
  if (bits >= 0 && is_group_blocks(bits)) {  // a simple type's group blocks: w alone, groups of 32
    if ((bits & ~(kGroupBlocks | 15 | (15 << kOffsetShift))) != 0 || group_block_bytes(bits) == 0)
      return fail(err, err_size, "%s: bits 0x%x: a group-block layout is 64 | 4, 5 or 8 (| log2(offset) << 8)",
                  Name(where).text, static_cast<unsigned>(bits));
    if (w == nullptr || d != nullptr || m != nullptr)
      return fail(err, err_size, "%s: a group-block weight is w alone (d and m NULL)", Name(where).text);
    if (out <= 0 || out % kTile != 0)
      return fail(err, err_size, "%s: outputs must be a positive multiple of 16, got %lld", Name(where).text,
                  static_cast<ll>(out));
    if (in <= 0 || in % 32 != 0 || group != 32)
      return fail(err, err_size, "%s: a group-block weight takes inputs in multiples of 32 and group 32, got %lld, %lld",
                  Name(where).text, static_cast<ll>(in), static_cast<ll>(group));
    return 0;
  }
  if (bits >= 0 && is_super(bits)) {  // a K type at the file's bytes: w alone, groups of 256
    const int layout = bits & 15;
    if (bits != (kSuperBlocks | layout) || super_block_bytes(layout) == 0)
      return fail(err, err_size, "%s: bits 0x%x: a super-block layout is 32 | 4 (Q4_K), 5 (Q5_K) or 6 (Q6_K)",
                  Name(where).text, static_cast<unsigned>(bits));
    if (w == nullptr || d != nullptr || m != nullptr)
      return fail(err, err_size, "%s: a super-block weight is w alone (d and m NULL)", Name(where).text);
    if (out <= 0 || out % kTile != 0)
      return fail(err, err_size, "%s: outputs must be a positive multiple of 16, got %lld", Name(where).text,
                  static_cast<ll>(out));
    if (in <= 0 || in % kSuper != 0 || group != kSuper)
      return fail(err, err_size, "%s: a super-block weight takes inputs in multiples of 256 and group 256, got %lld, %lld",
                  Name(where).text, static_cast<ll>(in), static_cast<ll>(group));
    return 0;
  }
  const char* why = "";
  const int64_t block = layout_block(bits, m != nullptr, &why);
  if (block == 0) return fail(err, err_size, "%s: bits 0x%x %s", Name(where).text, static_cast<unsigned>(bits), why);
  if (w == nullptr || d == nullptr)
    return fail(err, err_size, "%s: the weights w and scales d must be given", Name(where).text);
  if (out <= 0 || out % kTile != 0)
    return fail(err, err_size, "%s: outputs must be a positive multiple of 16, got %lld", Name(where).text,
                static_cast<ll>(out));
  if (in <= 0 || in % block != 0)
    return fail(err, err_size, "%s: inputs must be a positive multiple of %lld (the %d-bit layout's block), got %lld",
                Name(where).text, static_cast<ll>(block), bits & 15, static_cast<ll>(in));
  if (group <= 0 || group % 16 != 0 || in % group != 0)
    return fail(err, err_size, "%s: group must be a multiple of 16 dividing the %lld inputs, got %lld",
                Name(where).text, static_cast<ll>(in), static_cast<ll>(group));
  return 0;
}

int check_heads(int64_t dim, int64_t num_heads, int64_t num_kv_heads, const Where& where, char* err,
                int64_t err_size) {
  if ((dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256) && num_kv_heads > 0 && num_heads > 0 &&
      num_heads % num_kv_heads == 0)
    return 0;
  return fail(err, err_size,
              "%s: head_dim must be 16, 32, 64, 128 or 256 and heads a positive multiple of kv heads, got %lld, %lld, %lld",
              Name(where).text, static_cast<ll>(dim), static_cast<ll>(num_heads), static_cast<ll>(num_kv_heads));
}

int check_kv(const OutriderKv* kv, int64_t dim, const Where& where, char* err, int64_t err_size) {
  if (kv == nullptr || kv->data == nullptr) return fail(err, err_size, "%s: no KV cache given", Name(where).text);
  if (kv->q8 && (kv->f16 || dim % 32 != 0))
    return fail(err, err_size, "%s: a q8_0 KV cache needs head_dim a multiple of 32 (got %lld) and not f16 too",
                Name(where).text, static_cast<ll>(dim));
  // Rows of dim values, capacity rows a head: the strides must at least hold what they step over.
  const int64_t row = kv->q8 ? q8_row_bytes(dim) : dim;
  if (kv->slots <= 0 || kv->capacity <= 0 || kv->s_head < kv->capacity * row || kv->s_slot <= 0 || kv->s_half <= 0)
    return fail(err, err_size,
                "%s: KV cache of %lld slots of %lld rows (strides half %lld, slot %lld, head %lld) does not hold rows "
                "of %lld floats",
                Name(where).text, static_cast<ll>(kv->slots), static_cast<ll>(kv->capacity),
                static_cast<ll>(kv->s_half), static_cast<ll>(kv->s_slot), static_cast<ll>(kv->s_head),
                static_cast<ll>(dim));
  return 0;
}

int check_chunk_table(const int64_t* chunks, int64_t chunk_count, int64_t total, const OutriderKv& kv,
                      const uint8_t* visible, int64_t visible_width, const Where& where, char* err,
                      int64_t err_size, int64_t ring_window = 0) {
  if (chunk_count < 0 || (chunk_count > 0 && chunks == nullptr))
    return fail(err, err_size, "%s: %lld chunks without a table", Name(where).text, static_cast<ll>(chunk_count));
  if (visible != nullptr && visible_width < 0)
    return fail(err, err_size, "%s: visible width %lld", Name(where).text, static_cast<ll>(visible_width));
  char message[256];
  const char* error = check_chunks(chunks, chunk_count, total, kv.slots, kv.capacity,
                                   visible == nullptr ? 0 : visible_width, visible == nullptr, message, sizeof message,
                                   ring_window);
  if (*error != '\0') return fail(err, err_size, "%s: %s", Name(where).text, error);
  return 0;
}

KvLayer kv_layer(const OutriderKv& kv) {
  return {kv.data, kv.slots, kv.capacity, kv.s_half, kv.s_slot, kv.s_head, kv.f16 != 0, kv.ring != 0, kv.q8 != 0};
}

// A matrix [width, in] of parts: each part checked, their outputs summing to width.
int check_matrix(const OutriderMatrix& matrix, int64_t width, int64_t in, int64_t layer, const char* name,
                 const char* expected, char* err, int64_t err_size) {
  if (matrix.count < 1 || matrix.count > 3)
    return fail(err, err_size, "layer %lld %s: 1 to 3 parts, got %d", static_cast<ll>(layer), name, matrix.count);
  int64_t total = 0;
  for (int p = 0; p < matrix.count; ++p) {
    const OutriderPart& part = matrix.parts[p];
    if (check_weight(part.w, part.d, part.m, part.out, in, part.group, part.bits, Where{nullptr, layer, name, p}, err,
                     err_size))
      return 1;
    total += part.out;
  }
  if (total != width)
    return fail(err, err_size, "layer %lld %s: the parts' outputs sum to %lld, expected %s = %lld",
                static_cast<ll>(layer), name, static_cast<ll>(total), expected, static_cast<ll>(width));
  return 0;
}

template <class Fn>
int guarded(char* err, int64_t err_size, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& exc) {  // an allocation of the scratch, mostly
    return fail(err, err_size, "%s", exc.what());
  }
}

}  // namespace

extern "C" {

const char* outrider_kernels(void) { return active_kernels().name; }

int outrider_kernel_set_count(void) { return kernel_set_count(); }

const char* outrider_kernel_set_name(int index) {
  return index >= 0 && index < kernel_set_count() ? kernel_set(index).name : nullptr;
}

int outrider_cpu_runs(int index) { return index >= 0 && index < kernel_set_count() && cpu_runs(kernel_set(index)); }

int outrider_select(const char* name) { return name != nullptr && select_kernels(name) ? 1 : 0; }

const char* outrider_cpu_features(void) { return cpu_features(); }

void outrider_set_threads(int threads) { g_threads.store(threads > 0 ? threads : 0, std::memory_order_relaxed); }

int outrider_threads(void) { return thread_count(); }

int64_t outrider_struct_size(const char* name) {
  if (name == nullptr) return 0;
  const std::string n = name;
  if (n == "OutriderPart") return sizeof(OutriderPart);
  if (n == "OutriderMatrix") return sizeof(OutriderMatrix);
  if (n == "OutriderLayer") return sizeof(OutriderLayer);
  if (n == "OutriderKv") return sizeof(OutriderKv);
  return 0;
}

int outrider_a8_matmul(const float* x, int64_t rows, int64_t in, int64_t group, const uint8_t* w, const void* d,
                       const void* m, int64_t out, int bits, float* y, int64_t y_stride, char* err,
                       int64_t err_size) {
  if (rows < 0) return fail(err, err_size, "a8_matmul: %lld rows", static_cast<ll>(rows));
  if (check_weight(w, d, m, out, in, group, bits, Where{"a8_matmul"}, err, err_size)) return 1;
  if (y_stride < out)
    return fail(err, err_size, "a8_matmul: the output's row stride %lld is under its %lld outputs",
                static_cast<ll>(y_stride), static_cast<ll>(out));
  if (rows == 0) return 0;
  if (x == nullptr || y == nullptr) return fail(err, err_size, "a8_matmul: x and y must be given");
  return guarded(err, err_size, [&] {
    a8_matmul(x, rows, in, group, w, d, m, out, bits, y, y_stride);
    return 0;
  });
}

int outrider_rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t hidden, float* y, char* err,
                      int64_t err_size) {
  if (rows < 0 || hidden <= 0 || hidden % 16 != 0)
    return fail(err, err_size, "rms_norm: hidden must be a positive multiple of 16 (got %lld, %lld rows)",
                static_cast<ll>(hidden), static_cast<ll>(rows));
  if (rows > 0 && (x == nullptr || w == nullptr || y == nullptr))
    return fail(err, err_size, "rms_norm: x, w and y must be given");
  if (rows > 0) active_kernels().rms_norm_rows(x, w, eps, rows, hidden, y);
  return 0;
}

int outrider_swiglu(const float* gate_up, int64_t rows, int64_t inter, float* y, char* err, int64_t err_size) {
  if (rows < 0 || inter <= 0 || inter % 16 != 0)
    return fail(err, err_size, "swiglu: the intermediate size must be a positive multiple of 16 (got %lld, %lld rows)",
                static_cast<ll>(inter), static_cast<ll>(rows));
  if (rows > 0 && (gate_up == nullptr || y == nullptr))
    return fail(err, err_size, "swiglu: gate_up and y must be given");
  if (rows > 0) active_kernels().swiglu_rows(gate_up, rows, inter, y);
  return 0;
}

int outrider_geglu(const float* gate_up, int64_t rows, int64_t inter, float* y, char* err, int64_t err_size) {
  if (rows < 0 || inter <= 0 || inter % 16 != 0)
    return fail(err, err_size, "geglu: the intermediate size must be a positive multiple of 16 (got %lld, %lld rows)",
                static_cast<ll>(inter), static_cast<ll>(rows));
  if (rows > 0 && (gate_up == nullptr || y == nullptr))
    return fail(err, err_size, "geglu: gate_up and y must be given");
  if (rows > 0) active_kernels().geglu_rows(gate_up, rows, inter, y);
  return 0;
}

void outrider_add(float* x, const float* y, int64_t n) {
  if (n > 0 && x != nullptr && y != nullptr) active_kernels().add_rows(x, y, n);
}

int outrider_attend(const float* qkv, int64_t total, const OutriderKv* kv, const int64_t* chunks,
                    int64_t chunk_count, const uint8_t* visible, int64_t visible_width, int64_t num_heads,
                    int64_t num_kv_heads, int64_t dim, float* out, char* err, int64_t err_size) {
  const Where op{"attend"};
  if (check_heads(dim, num_heads, num_kv_heads, op, err, err_size)) return 1;
  if (total < 0) return fail(err, err_size, "attend: %lld rows", static_cast<ll>(total));
  if (check_kv(kv, dim, op, err, err_size)) return 1;
  if (kv->ring) return fail(err, err_size, "attend: a ring KV cache needs its layer's window (llama_layers)");
  if (check_chunk_table(chunks, chunk_count, total, *kv, visible, visible_width, op, err, err_size)) return 1;
  if (total == 0) return 0;
  if (qkv == nullptr || out == nullptr) return fail(err, err_size, "attend: qkv and out must be given");
  return guarded(err, err_size, [&] {
    attend(qkv, total, kv_layer(*kv), chunks, chunk_count, reinterpret_cast<const bool*>(visible), visible_width,
           num_heads, num_kv_heads, dim, out);
    return 0;
  });
}

int outrider_llama_layers(float* x, int64_t rows, int64_t hidden, const float* cos, const float* sin,
                          int64_t rope_tables, const int64_t* positions, const OutriderKv* kv, const OutriderLayer* layers, int64_t num_layers,
                          const int64_t* chunks, int64_t chunk_count, const uint8_t* visible, int64_t visible_width,
                          int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t inter, float eps, char* err,
                          int64_t err_size) {
  if (check_heads(dim, num_heads, num_kv_heads, Where{"llama_layers"}, err, err_size)) return 1;
  if (rows < 0 || num_layers < 0)
    return fail(err, err_size, "llama_layers: %lld rows, %lld layers", static_cast<ll>(rows),
                static_cast<ll>(num_layers));
  if (hidden <= 0 || hidden % 16 != 0 || inter <= 0 || inter % 16 != 0)
    return fail(err, err_size, "llama_layers: hidden (%lld) and intermediate (%lld) must be positive multiples of 16",
                static_cast<ll>(hidden), static_cast<ll>(inter));
  if (rope_tables < 1) return fail(err, err_size, "llama_layers: %lld RoPE tables", static_cast<ll>(rope_tables));
  if (num_layers == 0) return 0;
  if (layers == nullptr || kv == nullptr) return fail(err, err_size, "llama_layers: no layers or KV caches given");
  if (rows > 0 && (x == nullptr || cos == nullptr || sin == nullptr))
    return fail(err, err_size, "llama_layers: x, cos and sin must be given");
  const int64_t q_width = num_heads * dim, width = (num_heads + 2 * num_kv_heads) * dim;
  for (int64_t li = 0; li < num_layers; ++li) {
    const OutriderLayer& L = layers[li];
    const Where what{nullptr, li};  // "layer 3"
    if (L.attn_norm == nullptr || L.mlp_norm == nullptr)
      return fail(err, err_size, "layer %lld: both norm weights must be given", static_cast<ll>(li));
    if (L.activation != OUTRIDER_SILU && L.activation != OUTRIDER_GELU_TANH)
      return fail(err, err_size, "layer %lld: activation %d (expected %d SiLU or %d GELU tanh)", static_cast<ll>(li),
                  L.activation, OUTRIDER_SILU, OUTRIDER_GELU_TANH);
    if (L.rope_table < 0 || L.rope_table >= rope_tables)
      return fail(err, err_size, "layer %lld: RoPE table %lld of %lld", static_cast<ll>(li),
                  static_cast<ll>(L.rope_table), static_cast<ll>(rope_tables));
    if (!(L.attn_softcap >= 0.f))
      return fail(err, err_size, "layer %lld: attention soft cap %g (expected 0 or positive)", static_cast<ll>(li),
                  static_cast<double>(L.attn_softcap));
    if (L.window < 0 || (L.window > 0 && rows > 0 && positions == nullptr))
      return fail(err, err_size, "layer %lld: a window of %lld needs the rows' positions", static_cast<ll>(li),
                  static_cast<ll>(L.window));
    if (check_kv(&kv[li], dim, what, err, err_size)) return 1;
    if (kv[li].ring && L.window <= 0)
      return fail(err, err_size, "layer %lld: a ring KV cache needs a layer with a window", static_cast<ll>(li));
    // The table against every layer's cache (each may have its own slots and capacity, or be a ring).
    if (li == 0 || kv[li].slots != kv[li - 1].slots || kv[li].capacity != kv[li - 1].capacity ||
        kv[li].ring != kv[li - 1].ring || (kv[li].ring && L.window != layers[li - 1].window))
      if (check_chunk_table(chunks, chunk_count, rows, kv[li], visible, visible_width, what, err, err_size,
                            kv[li].ring ? L.window : 0))
        return 1;
    if (check_matrix(L.qkv, width, hidden, li, "qkv", "(heads + 2 kv heads) x head_dim", err, err_size) ||
        check_matrix(L.o, hidden, q_width, li, "o", "hidden", err, err_size) ||
        check_matrix(L.gate_up, 2 * inter, hidden, li, "gate_up", "2 x intermediate", err, err_size) ||
        check_matrix(L.down, hidden, inter, li, "down", "hidden", err, err_size))
      return 1;
  }
  if (rows == 0) return 0;
  return guarded(err, err_size, [&] {
    std::vector<KvLayer> caches(num_layers);
    for (int64_t li = 0; li < num_layers; ++li) caches[li] = kv_layer(kv[li]);
    decoder_layers(x, rows, hidden, cos, sin, rope_tables, positions, caches.data(), layers, num_layers, chunks, chunk_count,
                   reinterpret_cast<const bool*>(visible), visible_width, num_heads, num_kv_heads, dim, inter, eps);
    return 0;
  });
}

int outrider_packed_shape(int type, int64_t cols, int five_bit, int32_t* bits, int64_t* group, int64_t* w_tile_bytes,
                          char* err, int64_t err_size) {
  PackedShape shape{};
  const char* why = "";
  if (!packed_shape(type, cols, five_bit != 0, &shape, &why))
    return fail(err, err_size, "GGML type %d of rows of %lld: %s", type, static_cast<ll>(cols), why);
  *bits = shape.bits;
  *group = shape.group;
  *w_tile_bytes = shape.w_tile_bytes;
  return 0;
}

int outrider_pack_gguf(int type, const uint8_t* src, int64_t src_rows, int64_t cols, const int64_t* row_map,
                       int64_t rows_out, int five_bit, uint8_t* w, char* err, int64_t err_size) {
  PackedShape shape{};
  const char* why = "";
  if (!packed_shape(type, cols, five_bit != 0, &shape, &why))
    return fail(err, err_size, "GGML type %d of rows of %lld: %s", type, static_cast<ll>(cols), why);
  if (rows_out <= 0 || rows_out % kTile != 0 || src_rows < 0)
    return fail(err, err_size, "pack_gguf: rows_out must be a positive multiple of 16, got %lld (%lld source rows)",
                static_cast<ll>(rows_out), static_cast<ll>(src_rows));
  if (src == nullptr || w == nullptr) return fail(err, err_size, "pack_gguf: src and w must be given");
  return guarded(err, err_size, [&] {
    parallel_for(rows_out / kTile, [&](int64_t begin, int64_t end) {
      pack_gguf_tiles(type, shape, src, src_rows, cols, row_map, begin, end, w);
    });
    return 0;
  });
}

int outrider_dequantize_super_rows(const uint8_t* w, int bits, int64_t in, const int64_t* ids, int64_t n, float* out,
                                   char* err, int64_t err_size) {
  const int layout = bits & 15;
  const bool group_blocks = bits >= 0 && is_group_blocks(bits) && group_block_bytes(bits) != 0 && in > 0 && in % 32 == 0;
  if (!group_blocks && (bits != (kSuperBlocks | layout) || super_block_bytes(layout) == 0 || in <= 0 ||
                        in % kSuper != 0))
    return fail(err, err_size, "dequantize_rows: bits 0x%x, %lld inputs: expected a super-block layout of inputs in "
                "multiples of 256 or a group-block layout of inputs in multiples of 32", static_cast<unsigned>(bits),
                static_cast<ll>(in));
  if (n < 0 || (n > 0 && (w == nullptr || ids == nullptr || out == nullptr)))
    return fail(err, err_size, "dequantize_rows: w, ids and out must be given");
  if (group_blocks)
    dequantize_group_rows(w, bits, in, ids, n, out);
  else
    dequantize_super_rows(w, layout, in, ids, n, out);
  return 0;
}

}  // extern "C"
