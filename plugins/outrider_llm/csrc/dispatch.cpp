// Which kernel set serves: read from the CPU once (cpuid and xgetbv on x86, HWCAP on ARM: what
// the CPU has and the OS saves), the best it runs unless OUTRIDER_NATIVE_ISA or select_kernels
// names another it runs.

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace outrider_native {
namespace {

struct Features {
  bool avx2 = false, avx_vnni = false, avx512_vnni = false, neon = false, dotprod = false, i8mm = false;
  std::string names;
};

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

Features detect() {
  Features f;
  auto add = [&](bool has, const char* name) {
    if (has) f.names += (f.names.empty() ? "" : " ") + std::string(name);
  };
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = (xcr0 & 0xE6) == 0xE6;  // + opmask, ZMM state
  unsigned b7 = 0, c7 = 0, a7_1 = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) b7 = b, c7 = c;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) a7_1 = a;
  const bool avx2 = b7 & (1u << 5), avx512f = b7 & (1u << 16), avx512dq = b7 & (1u << 17);
  const bool avx512bw = b7 & (1u << 30), avx512vl = b7 & (1u << 31), avx512vnni = c7 & (1u << 11);
  const bool avxvnni = a7_1 & (1u << 4);
  f.avx2 = os_avx && avx && avx2 && fma && f16c;
  f.avx_vnni = f.avx2 && avxvnni;
  f.avx512_vnni = f.avx2 && os_avx512 && avx512f && avx512dq && avx512bw && avx512vl && avx512vnni;
  add(avx && os_avx, "avx");
  add(avx2 && os_avx, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avxvnni && os_avx, "avx_vnni");
  add(avx512f && os_avx512, "avx512f");
  add(avx512bw && os_avx512, "avx512bw");
  add(avx512vl && os_avx512, "avx512vl");
  add(avx512dq && os_avx512, "avx512dq");
  add(avx512vnni && os_avx512, "avx512_vnni");
#elif defined(__aarch64__)
  f.neon = true;  // Advanced SIMD is part of every AArch64 CPU
#if defined(__linux__)
  const unsigned long hwcap = getauxval(AT_HWCAP);
  f.dotprod = hwcap & (1ul << 20);  // HWCAP_ASIMDDP
  f.i8mm = getauxval(AT_HWCAP2) & (1ul << 13);  // HWCAP2_I8MM
#endif
  add(true, "asimd");
  add(f.dotprod, "asimddp");
  add(f.i8mm, "i8mm");
#endif
  return f;
}

const Features& features() {
  static const Features f = detect();
  return f;
}

const KernelSet* const kSets[] = {
#if defined(__x86_64__) || defined(_M_X64)
    &kAvx512Vnni, &kAvxVnni, &kAvx2,
#endif
#if defined(__aarch64__)
    &kNeonI8mm, &kNeonDotprod, &kNeon,
#endif
    &kScalar,
};

const KernelSet* best() {
  for (const KernelSet* set : kSets)
    if (cpu_runs(*set)) return set;
  return &kScalar;
}

const KernelSet* named(const char* name) {
  for (const KernelSet* set : kSets)
    if (std::strcmp(set->name, name) == 0 && cpu_runs(*set)) return set;
  return nullptr;
}

const KernelSet* initial() {
  const char* forced = std::getenv("OUTRIDER_NATIVE_ISA");
  if (forced != nullptr && *forced != '\0') {
    if (const KernelSet* set = named(forced)) return set;
  }
  return best();
}

std::atomic<const KernelSet*> g_active{nullptr};

}  // namespace

int kernel_set_count() { return static_cast<int>(sizeof kSets / sizeof kSets[0]); }

const KernelSet& kernel_set(int index) { return *kSets[index]; }

bool cpu_runs(const KernelSet& set) {
  const Features& f = features();
  const std::string name = set.name;
  if (name == "scalar") return true;
  if (name == "avx2") return f.avx2;
  if (name == "avx_vnni") return f.avx_vnni;
  if (name == "avx512_vnni") return f.avx512_vnni;
  if (name == "neon") return f.neon;
  if (name == "neon_dotprod") return f.dotprod;
  if (name == "neon_i8mm") return f.dotprod && f.i8mm;  // its single rows are sdot's
  return false;
}

const KernelSet& active_kernels() {
  const KernelSet* set = g_active.load(std::memory_order_acquire);
  if (set == nullptr) {
    const KernelSet* chosen = initial();
    g_active.compare_exchange_strong(set, chosen);
    set = g_active.load(std::memory_order_acquire);
  }
  return *set;
}

bool select_kernels(const char* name) {
  const KernelSet* set = named(name);
  if (set == nullptr) return false;
  g_active.store(set, std::memory_order_release);
  return true;
}

const char* cpu_features() { return features().names.c_str(); }

}  // namespace outrider_native
