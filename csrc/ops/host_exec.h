// What the two CPU backends (the production launcher, cpu_kernels.cpp, and the emulated CUDA
// grid, csrc/testing/emulated_ops.cpp) share of the Exec interface (op_entries.h): no device
// guard, the norm epilogue and the loss-scale update run on the host.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "../core/loss_scale_update.h"
#include "multi_tensor_ops.h"

namespace peak {

struct HostExecBase {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CPU;
  struct Guard {
    explicit Guard(const c10::Device&) {}
  };
  void finish_norms(const at::Tensor& partials, const std::vector<int64_t>& offsets,
                    at::Tensor& total, at::Tensor* per_tensor) {
    finish_norms_on_host(partials.data_ptr<float>(), offsets, total.data_ptr<float>(),
                         per_tensor ? per_tensor->data_ptr<float>() : nullptr);
  }
  static void update_scale(float* scale, int* growth, int* hysteresis, const float* found_inf,
                           const LossScaleParams& params) {
    update_loss_scale(scale, growth, hysteresis, found_inf, params);
  }
};

}  // namespace peak
