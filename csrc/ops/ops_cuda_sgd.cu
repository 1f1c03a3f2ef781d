// The CUDA kernels of fused_sgd_ (the CUDA files are split by op family: cuda_exec.cuh).
#include <torch/library.h>

#include "cuda_exec.cuh"

namespace peak {

TORCH_LIBRARY_IMPL(peak, CUDA, m) { register_kernels<cuda::LaunchExec, kSgdOps>(m); }

}  // namespace peak
