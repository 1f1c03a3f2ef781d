// The launch half of the CUDA Exec (op_entries.h), shared by the CUDA translation units, which
// are split by op family so that nvcc compiles them in parallel: ops_cuda.cu (the multi-tensor
// ops and LAMB, which need the norm epilogue and the loss-scale kernel of its CudaExec),
// ops_cuda_adam.cu, ops_cuda_sgd.cu, ops_cuda_adagrad_novograd.cu. Each file registers its
// family's kernels with a TORCH_LIBRARY_IMPL block of its own (the dispatcher takes them by name,
// in any order).
#pragma once

#include <c10/cuda/CUDAGuard.h>

#include "../core/cuda_apply.cuh"
#include "op_entries.h"

namespace peak {
namespace cuda {

struct LaunchExec {
  using Guard = c10::cuda::CUDAGuard;
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
             const Op& op, const BlockSink& sink) {
    cuda::apply<Op, T...>(lists, chunk_size, op, sink);
  }
};

}  // namespace cuda
}  // namespace peak
