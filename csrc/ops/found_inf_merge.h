// The one merge of overflow flags (op merge_found_infs, and update_scale_'s list argument).
//
// NOTE: [Merging overflow flags] A step's flags come one per device (and per optimizer or loss
// scaler); whoever hands one flag on (a fused step's found_inf, a scale update) merges them here.
// The merge is "any": 1 where some flag is set, else 0 -- not the sum, because a step that takes
// found_inf may test it for exactly 1 (torch's fused optimizers do). The flags meet on the target
// device with non-blocking copies: no host sync.
#pragma once

#include <ATen/ATen.h>

namespace peak {

inline at::Tensor merge_found_infs(at::TensorList found_infs, at::Device device,
                                   at::IntArrayRef shape) {
  at::Tensor merged = at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const at::Tensor& flag : found_infs) {
    TORCH_CHECK(flag.numel() == 1, "merge_found_infs: every flag must have one element, got ",
                "shape ", flag.sizes(), "; pass the found_inf tensors the kernels write");
    // Onto the CPU the copy must land before it is read: non-blocking only to a device.
    at::maximum_out(merged, merged, flag.reshape(shape).to(device, at::kFloat,
                                                           /*non_blocking=*/!device.is_cpu()));
  }
  return merged;
}

}  // namespace peak
