// The dispatcher entry points of every op, written once over a backend (Exec: CpuExec in
// cpu_exec.h, CudaExec in ops_cuda.cu, EmulatedExec in csrc/testing/ for the test twins), and the
// one list that registers them. An Exec provides: a Guard constructed from a device, apply<Op, T...>,
// finish_norms, and update_scale (host call or one-thread kernel).
#pragma once

#include <torch/library.h>

#include "../core/loss_scale_update.h"
#include "found_inf_merge.h"
#include "multi_tensor_ops.h"
#include "optimizer_ops_impl.h"

namespace peak {

template <typename Exec>
void multi_tensor_scale_entry(at::TensorList inputs, const std::optional<at::TensorList>& outputs,
                              const at::Tensor& scale, const at::Tensor& found_inf,
                              int64_t chunk_size,
                              const std::optional<at::Tensor>& per_tensor_found_inf) {
  const typename Exec::Guard guard(found_inf.device());
  Exec exec;
  const at::TensorList outs = outputs.value_or(inputs);
  const bool in_place = outs.data() == inputs.data() && outs.size() == inputs.size();
  if (walkable(inputs) && (in_place || walkable(outs))) {
    multi_tensor_scale(exec, inputs, outs, scale, found_inf, chunk_size, per_tensor_found_inf);
    return;
  }
  DenseStaging staged_in(inputs);
  if (in_place) {
    multi_tensor_scale(exec, staged_in.tensors, staged_in.tensors, scale, found_inf, chunk_size,
                       per_tensor_found_inf);
    staged_in.write_back();
    return;
  }
  DenseStaging staged_out(outs);
  multi_tensor_scale(exec, staged_in.tensors, staged_out.tensors, scale, found_inf, chunk_size,
                     per_tensor_found_inf);
  staged_out.write_back();
}

template <typename Exec>
void multi_tensor_axpby_entry(at::TensorList xs, at::TensorList ys, at::TensorList outputs,
                              const at::Tensor& a, const at::Tensor& b,
                              const at::Tensor& found_inf, int64_t check, int64_t chunk_size) {
  const typename Exec::Guard guard(found_inf.device());
  Exec exec;
  multi_tensor_axpby(exec, xs, ys, outputs, a, b, found_inf, check, chunk_size);
}

template <typename Exec>
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_entry(at::TensorList tensors,
                                                             bool per_tensor,
                                                             int64_t chunk_size) {
  TORCH_CHECK(!tensors.empty(), "multi_tensor_l2norm: tensors is empty; the norm of no tensors "
              "is 0, call it only with at least one tensor");
  const typename Exec::Guard guard(tensors[0].device());
  Exec exec;
  if (walkable(tensors)) return multi_tensor_l2norm(exec, tensors, per_tensor, chunk_size);
  const DenseStaging staged(tensors);  // read only: nothing to write back
  return multi_tensor_l2norm(exec, staged.tensors, per_tensor, chunk_size);
}

// The step's overflow flag on the scale's device: a lone flag there as it is, else merged
// (NOTE: [Merging overflow flags]).
inline at::Tensor found_inf_for_update(at::TensorList found_infs, const at::Tensor& scale) {
  if (found_infs.size() == 1 && found_infs[0].device() == scale.device()) return found_infs[0];
  return merge_found_infs(found_infs, scale.device(), {1});
}

template <typename Exec>
void update_scale_entry(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const std::optional<at::Tensor>& hysteresis_tracker,
                        at::TensorList found_infs, double growth_factor, double backoff_factor,
                        int64_t growth_interval, int64_t hysteresis, double min_scale,
                        double max_scale) {
  check_update_scale_args(scale, growth_tracker, hysteresis_tracker, found_infs, growth_factor,
                          backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  // The dispatcher picks the backend from every argument, flags included; the update runs on the
  // scale's memory, so the scale must be on the chosen backend's device type.
  TORCH_CHECK(scale.device().type() == Exec::device_type, "update_scale_: scale is on ",
              scale.device(), " but a found_infs flag is on a ", Exec::device_type,
              " device; keep the scale and its trackers on the device type of the flags (or pass "
              "the flags on the scale's device)");
  const typename Exec::Guard guard(scale.device());
  const at::Tensor found_inf = found_inf_for_update(found_infs, scale);
  Exec::update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int>(),
                     hysteresis_tracker ? hysteresis_tracker->data_ptr<int>() : nullptr,
                     found_inf.data_ptr<float>(),
                     {growth_factor, backoff_factor, static_cast<int>(growth_interval),
                      static_cast<int>(hysteresis), min_scale, max_scale});
}

// Op families, for backends that compile them in separate translation units (NOTE: [CPU kernel
// translation units] in cpu_exec.h; the CUDA files ops_cuda*.cu).
enum OpFamily : unsigned {
  kMultiTensorOps = 1u,  // scale, axpby, l2norm, check_finite, update_scale
  kAdamOps = 2u,
  kSgdOps = 4u,
  kLambOps = 8u,
  kAdagradNovoGradOps = 16u,
  kAllOps = 31u,
};

// `m` is a torch::Library, or one of the CPU dispatcher's recorders (cpu_dispatch.h), which take
// the same impl(name, &entry) calls: this list is the only one to edit when an op is added.
// `Families`: the subset to register (only their entries are named, so only they are compiled).
template <typename Exec, unsigned Families = kAllOps, typename Library = torch::Library>
void register_kernels(Library& m) {
  if constexpr ((Families & kMultiTensorOps) != 0) {
    m.impl("multi_tensor_scale_", &multi_tensor_scale_entry<Exec>);
    m.impl("multi_tensor_axpby_", &multi_tensor_axpby_entry<Exec>);
    m.impl("multi_tensor_l2norm", &multi_tensor_l2norm_entry<Exec>);
    m.impl("multi_tensor_check_finite_", &check_finite_entry<Exec>);
    m.impl("update_scale_", &update_scale_entry<Exec>);
  }
  if constexpr ((Families & kAdamOps) != 0) m.impl("fused_adam_", &fused_adam_entry<Exec>);
  if constexpr ((Families & kSgdOps) != 0) m.impl("fused_sgd_", &fused_sgd_entry<Exec>);
  if constexpr ((Families & kLambOps) != 0) m.impl("fused_lamb_", &fused_lamb_entry<Exec>);
  if constexpr ((Families & kAdagradNovoGradOps) != 0) {
    m.impl("fused_adagrad_", &fused_adagrad_entry<Exec>);
    m.impl("fused_novograd_", &fused_novograd_entry<Exec>);
  }
}

}  // namespace peak
