// The test-only twin of fused_adam_ through the emulated CUDA grid (emulated_exec.h).
#include <torch/library.h>

#include "emulated_exec.h"

TORCH_LIBRARY_IMPL(peak_emulated, CPU, m) {
  peak::register_kernels<peak::emulated_ops::EmulatedExec, peak::kAdamOps>(m);
}
