// CUDA kernels of the peak ops: the shared op bodies (multi_tensor_ops.h) over the CUDA launcher.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cub/device/device_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>

#include "../core/cuda_apply.cuh"
#include "../core/loss_scale_update.h"
#include "multi_tensor_ops.h"
#include "optimizer_ops_impl.h"

namespace peak {
namespace {

__global__ void sqrt_norms_kernel(float* total, float* per_tensor, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n && per_tensor != nullptr) per_tensor[i] = sqrtf(per_tensor[i]);
  if (i == 0) *total = sqrtf(*total);
}

struct CudaExec {
  using Guard = c10::cuda::CUDAGuard;
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size, const Op& op,
             const BlockSink& sink) {
    cuda::apply<Op, T...>(lists, chunk_size, op, sink);
  }

  // Per-tensor sums of the chunk partials with CUB's segmented reduce, the total with CUB's
  // reduce over those sums (the same order of summation as finish_norms_on_host), then sqrt.
  // The segment offsets reach the device through pinned memory and an async copy: no sync.
  void finish_norms(const at::Tensor& partials, const std::vector<int64_t>& offsets,
                    at::Tensor& total, at::Tensor* per_tensor) {
    const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
    const auto device = partials.device();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    at::Tensor host_offsets =
        at::empty({n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::copy(offsets.begin(), offsets.end(), host_offsets.data_ptr<int64_t>());
    at::Tensor dev_offsets = host_offsets.to(device, /*non_blocking=*/true);
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
};

void multi_tensor_scale_cuda(at::TensorList inputs, const std::optional<at::TensorList>& outputs,
                             const at::Tensor& scale, const at::Tensor& found_inf,
                             int64_t chunk_size, const std::optional<at::Tensor>& per_tensor_found_inf) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  CudaExec exec;
  multi_tensor_scale(exec, inputs, outputs.value_or(inputs), scale, found_inf, chunk_size,
                     per_tensor_found_inf);
}

void multi_tensor_axpby_cuda(at::TensorList xs, at::TensorList ys, at::TensorList outputs,
                             const at::Tensor& a, const at::Tensor& b, const at::Tensor& found_inf,
                            int64_t check,
                             int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  CudaExec exec;
  multi_tensor_axpby(exec, xs, ys, outputs, a, b, found_inf, check, chunk_size);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors,
                                                            bool per_tensor,
                                                            int64_t chunk_size) {
  TORCH_CHECK(!tensors.empty(), "multi_tensor_l2norm: tensors is empty");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  CudaExec exec;
  return multi_tensor_l2norm(exec, tensors, per_tensor, chunk_size);
}

__global__ void update_scale_kernel(float* scale, int* growth_tracker, int* hysteresis_tracker,
                                    const float* found_inf, LossScaleParams params) {
  update_loss_scale(scale, growth_tracker, hysteresis_tracker, found_inf, params);
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const c10::optional<at::Tensor>& hysteresis_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale,
                       double max_scale) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                          backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  const c10::cuda::CUDAGuard guard(scale.device());
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int>(),
      hysteresis_tracker ? hysteresis_tracker->data_ptr<int>() : nullptr,
      found_inf.data_ptr<float>(),
      {growth_factor, backoff_factor, static_cast<int>(growth_interval),
       static_cast<int>(hysteresis), min_scale, max_scale});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(peak, CUDA, m) {
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cuda);
  m.impl("multi_tensor_axpby_", &multi_tensor_axpby_cuda);
  m.impl("multi_tensor_l2norm", &multi_tensor_l2norm_cuda);
  m.impl("update_scale_", &update_scale_cuda);
  m.impl("multi_tensor_check_finite_", &check_finite_entry<CudaExec>);
  m.impl("fused_adam_", &fused_adam_entry<CudaExec>);
  m.impl("fused_sgd_", &fused_sgd_entry<CudaExec>);
  m.impl("fused_lamb_", &fused_lamb_entry<CudaExec>);
}

}  // namespace peak
