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
  static constexpr c10::DeviceType device_type = c10::DeviceType::CUDA;
  // The device guard is set only for a CUDA device. An op dispatched here with a CPU argument
  // among CUDA ones (found_inf, lr) then reaches the op's validation, whose message names the
  // argument and the fix, instead of failing in c10's guard first; a valid call's guard device is
  // always a CUDA device.
  struct Guard {
    explicit Guard(const c10::Device& device) {
      if (device.is_cuda()) guard.set_device(device);
    }
    c10::cuda::OptionalCUDAGuard guard;
  };
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
             const Op& op, const BlockSink& sink) {
    cuda::apply<Op, T...>(lists, chunk_size, op, sink);
  }
};

}  // namespace cuda
}  // namespace peak
