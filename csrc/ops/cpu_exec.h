// The CPU launcher as an Exec (op_entries.h), compiled once per CPU level (NOTE: [CPU levels]),
// and where each op family's entries of the level are compiled.
//
// NOTE: [CPU kernel translation units]
// The entries of a level are split by op family into translation units of their own
// (cpu_kernels.cpp: the multi-tensor ops, the level's table and the registrar; one file per
// optimizer family: cpu_kernels_<family>.cpp), so that the compiler runs on them in parallel and
// no single job holds every kernel. Each family file explicitly instantiates its entries over the
// level's CpuExec; every other file of the level sees the explicit instantiation declarations
// below, so that register_kernels' `&entry<CpuExec>` (the table and the forwarders) names those
// instantiations instead of compiling another copy. The files are members of the level's static
// library (CMakeLists.txt), so they carry its flags and link after the baseline objects.
#pragma once

#include "../core/cpu_apply.h"
#include "host_exec.h"
#include "op_entries.h"

namespace peak {
namespace cpu {
inline namespace PEAK_CPU_CAPABILITY {

// A named type per level (not an anonymous one), so that every instantiation over it carries
// the level's name: see the symbol check in tests/ops/test_cpu_levels.py.
struct CpuExec : HostExecBase {
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
             const Op& op, const BlockSink& sink) {
    if constexpr (q8_count<T...> > 0) {
      cpu::apply<Op, T...>(lists, chunk_size, op, sink, 0u);
    } else {
      // NOTE: [CPU tiled lists]: fp32 and fp16 lists share one instantiation.
      cpu::apply<Op, CpuListType<T>...>(
          lists, chunk_size, op, sink,
          half_list_bits<T...>(std::make_index_sequence<sizeof...(T)>{}));
    }
  }
};

}  // namespace PEAK_CPU_CAPABILITY
}  // namespace cpu

#define PEAK_CPU_DECLARE_ENTRY(entry) \
  extern template decltype(entry<cpu::CpuExec>) entry<cpu::CpuExec>;
#define PEAK_CPU_INSTANTIATE_ENTRY(entry) template decltype(entry<cpu::CpuExec>) entry<cpu::CpuExec>;

// (One line per optimizer entry: the family files instantiate them.)
PEAK_CPU_DECLARE_ENTRY(fused_adam_entry)
PEAK_CPU_DECLARE_ENTRY(fused_sgd_entry)
PEAK_CPU_DECLARE_ENTRY(fused_lamb_entry)
PEAK_CPU_DECLARE_ENTRY(fused_adagrad_entry)
PEAK_CPU_DECLARE_ENTRY(fused_novograd_entry)

}  // namespace peak
