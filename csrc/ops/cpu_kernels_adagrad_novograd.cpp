// This CPU level's fused_adagrad_ and fused_novograd_ kernels (NOTE: [CPU kernel translation
// units] in cpu_exec.h).
#include "cpu_exec.h"

namespace peak {
PEAK_CPU_INSTANTIATE_ENTRY(fused_adagrad_entry)
PEAK_CPU_INSTANTIATE_ENTRY(fused_novograd_entry)
}  // namespace peak
