#include "checks.h"

#include <ATen/MemoryOverlap.h>

namespace peak {
namespace {

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

void check_tensor_lists(const char* op, std::initializer_list<NamedList> lists) {
  const NamedList& first = *lists.begin();
  const size_t n = first.second.size();
  for (const NamedList& l : lists) {
    TORCH_CHECK(l.second.size() == n, op, ": ", l.first, " has ", l.second.size(),
                " tensors but ", first.first, " has ", n,
                "; pass lists of the same length (one entry per tensor)");
  }
  if (n == 0) return;
  const c10::Device device = first.second[0].device();
  bool is_first = true;
  for (const NamedList& l : lists) {
    const at::ScalarType dtype = l.second[0].scalar_type();
    TORCH_CHECK(supported_dtype(dtype), op, ": ", l.first, "[0] has dtype ", dtype,
                "; supported dtypes are float32, float16 and bfloat16");
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = l.second[i];
      TORCH_CHECK(t.defined(), op, ": ", l.first, "[", i, "] is undefined (None)");
      TORCH_CHECK(t.device() == device, op, ": ", l.first, "[", i, "] is on ", t.device(),
                  " but ", first.first, "[0] is on ", device,
                  "; all tensors of one call must be on one device (group them by device)");
      TORCH_CHECK(t.scalar_type() == dtype, op, ": ", l.first, "[", i, "] has dtype ",
                  t.scalar_type(), " but ", l.first, "[0] has ", dtype,
                  "; each list must have one dtype (group tensors by dtype)");
      TORCH_CHECK(t.layout() == at::kStrided, op, ": ", l.first, "[", i, "] has layout ",
                  t.layout(), "; only dense (strided) tensors are supported");
      TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", l.first, "[", i,
                  "] is not dense (sizes ", t.sizes(), ", strides ", t.strides(),
                  "); multi-tensor ops walk memory linearly, pass t.contiguous()");
      if (is_first) continue;  // the reference list itself
      const at::Tensor& ref = first.second[i];
      TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", l.first, "[", i, "] has shape ",
                  t.sizes(), " but ", first.first, "[", i, "] has shape ", ref.sizes());
      TORCH_CHECK(t.numel() <= 1 || t.strides() == ref.strides(), op, ": ", l.first, "[", i,
                  "] has strides ", t.strides(), " but ", first.first, "[", i, "] has ",
                  ref.strides(), "; use the same memory format for corresponding tensors");
    }
    is_first = false;
  }
}

void check_no_partial_overlap(const char* op, const NamedList& outputs, const NamedList& inputs) {
  for (size_t i = 0; i < outputs.second.size(); ++i) {
    const at::Tensor& out = outputs.second[i];
    const at::Tensor& in = inputs.second[i];
    if (out.numel() == 0) continue;
    TORCH_CHECK(at::get_overlap_status(out, in) != at::MemOverlapStatus::Partial, op, ": ",
                outputs.first, "[", i, "] partially overlaps ", inputs.first, "[", i,
                "]; an output must be the input itself (in place) or separate memory");
  }
}

void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                         at::ScalarType dtype, const c10::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1 && t.device() == device, op, ": ", name,
              " must be a ", dtype, " tensor with one element on ", device, " (got ",
              t.scalar_type(), ", ", t.numel(), " elements, on ", t.device(), ")");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_flag_vector(const char* op, const char* name, const at::Tensor& t, size_t n,
                       const c10::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == static_cast<int64_t>(n) &&
                  t.device() == device && t.is_contiguous(),
              op, ": ", name, " must be a contiguous float32 tensor with one element per input (",
              n, ") on ", device, " (got ", t.scalar_type(), ", ", t.numel(), " elements, on ",
              t.device(), ")");
}

void check_chunk_size(const char* op, int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0 && chunk_size <= (int64_t{1} << 30), op,
              ": chunk_size must be in [1, 2**30], got ", chunk_size);
}

c10::Device lists_device(at::TensorList first_list, const at::Tensor& fallback) {
  return first_list.empty() ? fallback.device() : first_list[0].device();
}

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const std::optional<at::Tensor>& hysteresis_tracker,
                             at::TensorList found_infs, double growth_factor,
                             double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                             double min_scale, double max_scale) {
  constexpr const char* name = "update_scale_";
  const c10::Device device = scale.device();
  check_scalar_tensor(name, "scale", scale, at::kFloat, device);
  check_scalar_tensor(name, "growth_tracker", growth_tracker, at::kInt, device);
  TORCH_CHECK(!found_infs.empty(), name, ": found_infs is empty; pass the overflow flags of "
              "the step (at least one float32 tensor of one element)");
  for (const at::Tensor& f : found_infs) {
    check_scalar_tensor(name, "found_infs[i]", f, at::kFloat, f.device());
  }
  if (hysteresis_tracker.has_value()) {
    check_scalar_tensor(name, "hysteresis_tracker", *hysteresis_tracker, at::kInt, device);
  }
  // growth 1 and backoff 1 are allowed: a static scale that still counts clean updates.
  TORCH_CHECK(growth_factor >= 1.0, name, ": growth_factor must be >= 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor <= 1.0, name,
              ": backoff_factor must be in (0, 1], got ", backoff_factor);
  TORCH_CHECK(growth_interval >= 1, name, ": growth_interval must be >= 1, got ",
              growth_interval);
  TORCH_CHECK(hysteresis >= 1, name, ": hysteresis must be >= 1, got ", hysteresis);
  // The trackers are int32 on the device: a larger count would wrap when cast.
  TORCH_CHECK(growth_interval <= INT32_MAX && hysteresis <= INT32_MAX, name,
              ": growth_interval and hysteresis must be at most 2**31 - 1 (int32 trackers), got ",
              growth_interval, " and ", hysteresis);
  TORCH_CHECK(hysteresis == 1 || hysteresis_tracker.has_value(), name, ": hysteresis=",
              hysteresis, " needs a hysteresis_tracker (an int32 tensor of one element)");
  TORCH_CHECK(min_scale >= 0.0 && min_scale <= max_scale, name,
              ": need 0 <= min_scale <= max_scale, got min_scale=", min_scale,
              ", max_scale=", max_scale);
}

}  // namespace peak
