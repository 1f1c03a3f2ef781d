// Argument validation shared by every backend. Messages name the op, the argument and the fix.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace peak {

using NamedList = std::pair<const char*, at::TensorList>;

// Lists walked element by element together: same length; per list one device and one dtype in
// {float32, float16, bfloat16}; dense (non-overlapping) and, index by index, the same shape and
// strides as the first list so that linear memory positions correspond.
void check_tensor_lists(const char* op, std::initializer_list<NamedList> lists);

// An output may be exactly an input (in place) or separate from it, never a partial overlap:
// see NOTE: [In place] in core/cpu_apply.h.
void check_no_partial_overlap(const char* op, const NamedList& outputs, const NamedList& inputs);

// A 1-element float32 tensor on `device` (the overflow flag, a scale).
void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                         at::ScalarType dtype, const c10::Device& device);

// A float32 tensor of `n` elements on `device` (per-tensor overflow flags).
void check_flag_vector(const char* op, const char* name, const at::Tensor& t, size_t n,
                       const c10::Device& device);

void check_chunk_size(const char* op, int64_t chunk_size);

// The device the lists live on, or the fallback's when the lists are empty.
c10::Device lists_device(at::TensorList first_list, const at::Tensor& fallback);

// update_scale_'s arguments (shared by every backend's entry, op_entries.h).
void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const std::optional<at::Tensor>& hysteresis_tracker,
                             at::TensorList found_infs, double growth_factor,
                             double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                             double min_scale, double max_scale);

}  // namespace peak
