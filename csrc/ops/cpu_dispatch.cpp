// The CPU dispatcher: which levels this build has, which of them the CPU runs, which one is in
// use. Compiled with the baseline flags (it must run on any x86-64 to find out what else can).
//
// NOTE: [CPU levels]
// A wheel must run on any x86-64, yet the kernels are memory-bound loops that gain from wide
// vectors and F16C conversions. As ATen does (DispatchStub, CPU_CAPABILITY), the kernel
// translation units (cpu_kernels*.cpp, one per op family, + cpu_apply.h + the functor headers:
// NOTE: [CPU kernel translation units] in cpu_exec.h) are compiled once per level, each copy in
// a namespace of its own, and the copy to run is chosen when first needed:
//   baseline  -march=x86-64 (SSE2)
//   avx2      -march=x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE)
//   avx512    -march=x86-64-v4 (+ AVX-512 F, BW, CD, DQ, VL), 512-bit vectors preferred
// No AVX-512-BF16 or -FP16 level: the math is fp32 whatever the storage, so their arithmetic is
// unused, and the one instruction that would serve (VCVTNEPS2BF16, fp32 -> bf16 stores) flushes
// subnormal inputs and outputs to zero, which would break the bit-for-bit promise below. fp16 conversions
// are F16C/AVX-512F, already in avx2/avx512.
// Every level computes the same bits: the math rounds explicitly (fmaf, no contraction: NOTE:
// [No FP contraction]; baseline calls libm's correctly rounded fmaf), the l2norm's lanes are
// fixed in number and merge order (NOTE: [CPU lanes]), and conversions round to nearest even.
// tests/ops/test_cpu_levels.py runs the kernels at every level this CPU has and compares the bits.
// (Except a NaN computed from two NaN/inf operands: NaN at every level, but which operand's sign
// and payload it carries depends on the operand order the compiler picked; IEEE leaves it open.)
//
// The other copy problem: inline functions of shared headers (c10, std, peak's functors)
// compiled into an AVX-512 object are link-once (COMDAT) symbols, and the linker keeps the
// first copy it meets for the whole module. CMake puts every baseline object before the level
// objects on the link line (baseline level first among them), so a function that any baseline
// object also emits is the baseline copy; one that only a level object emits is called only from
// that level's code. tests/ops/test_cpu_levels.py checks the built module: every function holding
// AVX instructions is named after a level. Static initialisers of the level objects run on any
// CPU; they only register nothing (the registrar is the baseline object).
#include "cpu_dispatch.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace peak {
namespace cpu {
#define PEAK_DECLARE_LEVEL(level) \
  namespace level {               \
  const cpu_dispatch::KernelTable& kernel_table(); \
  }
#if PEAK_CPU_LEVEL_baseline
PEAK_DECLARE_LEVEL(baseline)
#endif
#if PEAK_CPU_LEVEL_avx2
PEAK_DECLARE_LEVEL(avx2)
#endif
#if PEAK_CPU_LEVEL_avx512
PEAK_DECLARE_LEVEL(avx512)
#endif
#if PEAK_CPU_LEVEL_native
PEAK_DECLARE_LEVEL(native)
#endif
#undef PEAK_DECLARE_LEVEL
}  // namespace cpu

namespace cpu_dispatch {
namespace {

constexpr const char* kVariable = "PEAK_CPU_LEVEL";

bool cpu_has(const char* feature_level) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(feature_level, "x86-64-v3") == 0) return __builtin_cpu_supports("x86-64-v3");
  if (std::strcmp(feature_level, "x86-64-v4") == 0) return __builtin_cpu_supports("x86-64-v4");
#endif
  return false;
}

struct Level {
  const char* name;
  const char* needs;  // for the error when the CPU lacks it
  bool (*supported)();
  const KernelTable& (*table)();
};

// Lowest first; the best supported one is the default.
const std::vector<Level>& levels() {
  static const std::vector<Level> all = {
#if PEAK_CPU_LEVEL_baseline
      {"baseline", "x86-64", [] { return true; }, &cpu::baseline::kernel_table},
#endif
#if PEAK_CPU_LEVEL_avx2
      {"avx2", "AVX2, FMA, F16C, BMI1/2, LZCNT and MOVBE (x86-64-v3)",
       [] { return cpu_has("x86-64-v3"); }, &cpu::avx2::kernel_table},
#endif
#if PEAK_CPU_LEVEL_avx512
      {"avx512", "AVX-512 F, BW, CD, DQ and VL besides x86-64-v3 (x86-64-v4)",
       [] { return cpu_has("x86-64-v4"); }, &cpu::avx512::kernel_table},
#endif
#if PEAK_CPU_LEVEL_native
      // Built with -march=native for the machine that built it (PEAK_CPU_ISA=native): there is
      // nothing to check it against here.
      {"native", "the build machine's instruction set (-march=native)", [] { return true; },
       &cpu::native::kernel_table},
#endif
  };
  return all;
}

// Tests only: PEAK_TESTING_CPU_MAX_LEVEL=<level> makes the levels above <level> count as absent
// from this CPU, so that the refusal and the fallback can be seen on a CPU that has them all.
bool runs_here(const Level& level) {
  if (!level.supported()) return false;
  const char* cap = std::getenv("PEAK_TESTING_CPU_MAX_LEVEL");
  if (cap == nullptr || *cap == '\0') return true;
  for (const Level& l : levels()) {
    if (std::strcmp(l.name, cap) == 0) return &level <= &l;  // levels() is lowest first
  }
  return true;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::vector<std::string> compiled_names() {
  std::vector<std::string> out;
  for (const Level& l : levels()) out.push_back(l.name);
  return out;
}

std::vector<std::string> supported_names() {
  std::vector<std::string> out;
  for (const Level& l : levels()) {
    if (runs_here(l)) out.push_back(l.name);
  }
  return out;
}

// The level for `name` ("auto": the best this CPU runs), or a runtime_error saying why not.
// `source` names where the request came from, for the message.
const Level& find_level(const std::string& name, const std::string& source) {
  if (name == "auto" || name.empty()) {
    const Level* best = nullptr;
    for (const Level& l : levels()) {
      if (runs_here(l)) best = &l;
    }
    if (best == nullptr) throw std::runtime_error("peak: no CPU level of this build runs here");
    return *best;
  }
  for (const Level& l : levels()) {
    if (name != l.name) continue;
    if (!runs_here(l)) {
      throw std::runtime_error(
          "peak: " + source + "=" + name + ", but this CPU lacks " + l.needs +
          ". Levels this CPU runs: " + join(supported_names()) + " (or auto).");
    }
    return l;
  }
  throw std::runtime_error(
      "peak: " + source + "=" + name + " is not a CPU level of this build. Accepted values: auto, " +
      join(compiled_names()) +
      " (the levels compiled in; the full set baseline, avx2, avx512 comes with the default "
      "build, PEAK_CPU_ISA=dispatch).");
}

const KernelTable& checked_table(const Level& level) {
  const KernelTable& t = level.table();
  const std::vector<const char*>& expected = registered_names();
  bool same = t.names.size() == expected.size();
  for (size_t i = 0; same && i < expected.size(); ++i) same = std::strcmp(t.names[i], expected[i]) == 0;
  if (!same) {
    throw std::runtime_error(std::string("peak: internal error: the op table of CPU level ") +
                             level.name + " does not list the registered ops in order");
  }
  return t;
}

std::mutex g_mutex;
std::atomic<const KernelTable*> g_active{nullptr};
std::string g_active_name;  // under g_mutex
std::string g_forced;       // under g_mutex

void select_from_environment() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_active.load() != nullptr) return;
  const char* env = std::getenv(kVariable);
  std::string requested = env != nullptr ? env : "";
  for (char& c : requested) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const Level& level = find_level(requested, kVariable);
  const KernelTable& table = checked_table(level);
  g_active_name = level.name;
  g_forced = requested == "auto" ? "" : requested;
  g_active.store(&table);
}

}  // namespace

std::vector<const char*>& registered_names() {
  static std::vector<const char*> names;
  return names;
}

const KernelTable& active_table() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t != nullptr) return *t;
  select_from_environment();
  return *g_active.load();
}

LevelReport report() {
  active_table();
  std::lock_guard<std::mutex> lock(g_mutex);
  return {g_active_name, compiled_names(), supported_names(), g_forced};
}

std::string set_level(const std::string& name) {
  active_table();
  const Level& level = find_level(name, "level");
  const KernelTable& table = checked_table(level);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string previous = g_active_name;
  g_active_name = level.name;
  g_forced = "";
  g_active.store(&table);
  return previous;
}

}  // namespace cpu_dispatch
}  // namespace peak
