// CUDA kernels of the peak ops: the shared op bodies (multi_tensor_ops.h) over the CUDA launcher.
// This file: the multi-tensor ops and LAMB; the other optimizers: cuda_exec.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>

#include "../core/loss_scale_update.h"
#include "cuda_exec.cuh"

namespace peak {
namespace {

__global__ void sqrt_norms_kernel(float* total, float* per_tensor, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && per_tensor != nullptr) per_tensor[i] = sqrtf(per_tensor[i]);
  if (i == 0) *total = sqrtf(*total);
}

__global__ void update_scale_kernel(float* scale, int* growth_tracker, int* hysteresis_tracker,
                                    const float* found_inf, LossScaleParams params) {
  update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, params);
}

// Up to this many segment offsets travel in one kernel's arguments (4 KB at most).
constexpr int kOffsetsPerLaunch = 480;

struct OffsetsArg {
  int64_t values[kOffsetsPerLaunch];
};

// Writes offsets that came by value, in the kernel's arguments: a CUDA graph captures the
// arguments with the launch, so a replay reads no host memory (a copy from a pinned host buffer
// would read it after the buffer was freed and reused).
__global__ void store_offsets_kernel(const __grid_constant__ OffsetsArg arg, int64_t* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = arg.values[i];
}

struct CudaExec : cuda::LaunchExec {

  // Per-tensor sums of the chunk partials with CUB's segmented reduce, the total with CUB's
  // reduce over those sums (the same order of summation as finish_norms_on_host), then sqrt.
  // The segment offsets reach the device in kernel arguments (store_offsets_kernel): no sync,
  // and nothing a CUDA-graph replay would read from freed host memory.
  void finish_norms(const at::Tensor& partials, const std::vector<int64_t>& offsets,
                    at::Tensor& total, at::Tensor* per_tensor) {
    const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    at::Tensor dev_offsets = at::empty({n + 1}, partials.options().dtype(at::kLong));
    for (size_t first = 0; first < offsets.size(); first += kOffsetsPerLaunch) {
      const int count =
          static_cast<int>(std::min<size_t>(kOffsetsPerLaunch, offsets.size() - first));
      OffsetsArg arg;
      std::copy(offsets.begin() + first, offsets.begin() + first + count, arg.values);
      store_offsets_kernel<<<1, 256, 0, stream>>>(arg, dev_offsets.data_ptr<int64_t>() + first,
                                                  count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    at::Tensor sums = at::empty({n}, partials.options());
    const int64_t* begin = dev_offsets.data_ptr<int64_t>();

    size_t seg_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceSegmentedReduce::Sum(nullptr, seg_bytes, partials.data_ptr<float>(),
                                                   sums.data_ptr<float>(), n, begin, begin + 1,
                                                   stream));
    size_t red_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, red_bytes, sums.data_ptr<float>(),
                                          total.data_ptr<float>(), n, stream));
    at::Tensor scratch = at::empty({static_cast<int64_t>(std::max(seg_bytes, red_bytes)) + 1},
                                   partials.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceSegmentedReduce::Sum(scratch.data_ptr(), seg_bytes,
                                                   partials.data_ptr<float>(),
                                                   sums.data_ptr<float>(), n, begin, begin + 1,
                                                   stream));
    C10_CUDA_CHECK(cub::DeviceReduce::Sum(scratch.data_ptr(), red_bytes, sums.data_ptr<float>(),
                                          total.data_ptr<float>(), n, stream));
    float* per = nullptr;
    if (per_tensor != nullptr) {
      per_tensor->copy_(sums);
      per = per_tensor->data_ptr<float>();
    }
    const int threads = 256;
    const int64_t blocks = std::max<int64_t>(1, (n + threads - 1) / threads);
    sqrt_norms_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        total.data_ptr<float>(), per, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // One thread: the state is a handful of scalars, and the step never waits for the host.
  static void update_scale(float* scale, int* growth, int* hysteresis, const float* found_inf,
                           const LossScaleParams& params) {
    update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(scale, growth, hysteresis,
                                                                       found_inf, params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

// The other optimizers are in files of their own (cuda_exec.cuh).
TORCH_LIBRARY_IMPL(peak, CUDA, m) { register_kernels<CudaExec, kMultiTensorOps | kLambOps>(m); }

}  // namespace peak
