// The CPU kernels of the peak ops, compiled once per CPU level (NOTE: [CPU levels]): CMake builds
// this file into one object per level with that level's flags and PEAK_CPU_CAPABILITY set to the
// level's name (baseline, avx2, avx512; or a single level for PEAK_CPU_ISA=native|avx2|baseline).
// The math is the functor headers' (csrc/core/*.h), the loops cpu_apply.h's: nothing here is
// written per level. Each level exports its table of op entries; the level named by
// PEAK_CPU_REGISTRAR also registers the dispatcher's forwarders (cpu_dispatch.h). This file
// compiles the multi-tensor ops; the optimizers are compiled by family in files of their own
// (NOTE: [CPU kernel translation units] in cpu_exec.h).
#include "cpu_dispatch.h"
#include "cpu_exec.h"

#ifndef PEAK_CPU_REGISTRAR
#define PEAK_CPU_REGISTRAR 0
#endif

namespace peak {
namespace cpu {
inline namespace PEAK_CPU_CAPABILITY {

// Called only once the CPU is known to run this level: even building the vector runs code
// compiled with the level's flags.
const cpu_dispatch::KernelTable& kernel_table() {
  static const cpu_dispatch::KernelTable table = [] {
    cpu_dispatch::KernelTable t;
    cpu_dispatch::TableRecorder recorder{t};
    register_kernels<CpuExec>(recorder);
    return t;
  }();
  return table;
}

}  // namespace PEAK_CPU_CAPABILITY
}  // namespace cpu
}  // namespace peak

#if PEAK_CPU_REGISTRAR
// Only the signatures of this level's entries are used here (the forwarders are plain code
// compiled with this object's flags, which CMake makes the baseline's).
TORCH_LIBRARY_IMPL(peak, CPU, m) {
  peak::cpu_dispatch::ForwardingRegistrar registrar{m};
  peak::register_kernels<peak::cpu::CpuExec>(registrar);
}
#endif
