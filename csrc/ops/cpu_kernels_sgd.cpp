// This CPU level's fused_sgd_ kernels (NOTE: [CPU kernel translation units] in cpu_exec.h).
#include "cpu_exec.h"

namespace peak {
PEAK_CPU_INSTANTIATE_ENTRY(fused_sgd_entry)
}  // namespace peak
