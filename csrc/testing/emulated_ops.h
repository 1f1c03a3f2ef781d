// The multi-tensor ops run through the CUDA launcher's plan and block code, emulated on the CPU
// (see core/emulated_grid.h). Test-only entry points (PEAK_TEST_TWINS=ON), bound in
// peak._C.emulated.
#pragma once

#include <ATen/ATen.h>

#include <pybind11/pybind11.h>

#include <tuple>

namespace peak {
namespace emulated_ops {

// The shape used by the peak_emulated ops on this thread (0 = the CUDA launcher's value).
void set_grid_shape(int64_t max_tensors, int64_t max_blocks, int64_t threads);

void scale(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
           const at::Tensor& found_inf, int64_t chunk_size, int64_t max_tensors,
           int64_t max_blocks, int64_t threads,
           const std::optional<at::Tensor>& per_tensor_found_inf);

void axpby(at::TensorList xs, at::TensorList ys, at::TensorList outputs, const at::Tensor& a,
           const at::Tensor& b, const at::Tensor& found_inf, int64_t check, int64_t chunk_size, int64_t max_tensors,
           int64_t max_blocks, int64_t threads);

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, bool per_tensor,
                                          int64_t chunk_size, int64_t max_tensors,
                                          int64_t max_blocks, int64_t threads);

// Adds the submodule `emulated` (the functions above) to peak._C.
void register_bindings(pybind11::module_& parent);

}  // namespace emulated_ops
}  // namespace peak
