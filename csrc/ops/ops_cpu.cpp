// The emulated-grid variants of the peak ops used by tests, and the host epilogues. (The CPU
// kernels themselves: cpu_kernels.cpp, per CPU level.)
#include <torch/library.h>

#include <cmath>

#include "../core/emulated_grid.h"
#include "../core/loss_scale_update.h"
#include "emulated_ops.h"
#include "host_exec.h"
#include "op_entries.h"
#include "../bindings/fused_schemas.h"

namespace peak {

void finish_norms_on_host(const float* partials, const std::vector<int64_t>& offsets,
                          float* total, float* per_tensor) {
  float sum = 0.0f;
  for (size_t t = 0; t + 1 < offsets.size(); ++t) {
    float tensor_sum = 0.0f;
    for (int64_t c = offsets[t]; c < offsets[t + 1]; ++c) tensor_sum += partials[c];
    if (per_tensor != nullptr) per_tensor[t] = std::sqrt(tensor_sum);
    sum += tensor_sum;
  }
  *total = std::sqrt(sum);
}

void check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                             const c10::optional<at::Tensor>& hysteresis_tracker,
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
  TORCH_CHECK(hysteresis == 1 || hysteresis_tracker.has_value(), name, ": hysteresis=",
              hysteresis, " needs a hysteresis_tracker (an int32 tensor of one element)");
  TORCH_CHECK(min_scale >= 0.0 && min_scale <= max_scale, name,
              ": need 0 <= min_scale <= max_scale, got min_scale=", min_scale,
              ", max_scale=", max_scale);
}

namespace {

// The grid shape the peak_emulated ops use (0: the real CUDA launcher's value).
thread_local emulated::GridShape g_emulated_shape{0, 0, 0};

struct EmulatedExec : HostExecBase {
  emulated::GridShape shape = g_emulated_shape;
  template <typename Op, typename... T>
  void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
             const Op& op, const BlockSink& sink) {
    constexpr int kMax = MetadataFor<Op, T...>::kMaxTensors;
    emulated::GridShape s = shape;
    if (s.max_tensors == 0) s.max_tensors = kMax;
    if (s.max_blocks == 0) s.max_blocks = kMaxBlocksPerLaunch;
    if (s.threads_per_block == 0) s.threads_per_block = kThreadsPerBlock;
    TORCH_CHECK(s.max_tensors >= 1 && s.max_tensors <= kMax,
                "emulated grid: max_tensors must be in [1, ", kMax, "]");
    TORCH_CHECK(s.max_blocks >= 1 && s.max_blocks <= kMaxBlocksPerLaunch,
                "emulated grid: max_blocks must be in [1, ", kMaxBlocksPerLaunch, "]");
    TORCH_CHECK(s.threads_per_block >= 1, "emulated grid: threads_per_block must be >= 1");
    emulated::apply<Op, T...>(lists, chunk_size, op, sink, s);
  }
};

}  // namespace

namespace emulated_ops {

void set_grid_shape(int64_t max_tensors, int64_t max_blocks, int64_t threads) {
  g_emulated_shape = {static_cast<int>(max_tensors), static_cast<int>(max_blocks),
                      static_cast<int>(threads)};
}

static EmulatedExec make_exec(int64_t max_tensors, int64_t max_blocks, int64_t threads) {
  EmulatedExec exec;
  exec.shape = {static_cast<int>(max_tensors), static_cast<int>(max_blocks),
                static_cast<int>(threads)};
  return exec;
}

void scale(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
           const at::Tensor& found_inf, int64_t chunk_size, int64_t max_tensors,
           int64_t max_blocks, int64_t threads,
           const std::optional<at::Tensor>& per_tensor_found_inf) {
  auto exec = make_exec(max_tensors, max_blocks, threads);
  multi_tensor_scale(exec, inputs, outputs, scale, found_inf, chunk_size, per_tensor_found_inf);
}

void axpby(at::TensorList xs, at::TensorList ys, at::TensorList outputs, const at::Tensor& a,
           const at::Tensor& b, const at::Tensor& found_inf, int64_t check, int64_t chunk_size, int64_t max_tensors,
           int64_t max_blocks, int64_t threads) {
  auto exec = make_exec(max_tensors, max_blocks, threads);
  multi_tensor_axpby(exec, xs, ys, outputs, a, b, found_inf, check, chunk_size);
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList tensors, bool per_tensor,
                                          int64_t chunk_size, int64_t max_tensors,
                                          int64_t max_blocks, int64_t threads) {
  auto exec = make_exec(max_tensors, max_blocks, threads);
  return multi_tensor_l2norm(exec, tensors, per_tensor, chunk_size);
}

}  // namespace emulated_ops

// The CPU kernels of the peak ops are registered by cpu_kernels.cpp (one copy per CPU level,
// chosen at run time: cpu_dispatch.cpp).

}  // namespace peak

// Test-only twins of the fused optimizer ops that run through the emulated CUDA grid (launch
// plan, metadata with per-tensor scalars, per-block code), shaped by set_grid_shape.
TORCH_LIBRARY(peak_emulated, m) {
  m.def(peak::kFusedAdamSchema, &peak::fused_adam_entry<peak::EmulatedExec>);
  m.def(peak::kFusedSgdSchema, &peak::fused_sgd_entry<peak::EmulatedExec>);
  m.def(peak::kFusedLambSchema, &peak::fused_lamb_entry<peak::EmulatedExec>);
  m.def(peak::kFusedAdagradSchema, &peak::fused_adagrad_entry<peak::EmulatedExec>);
  m.def(peak::kFusedNovoGradSchema, &peak::fused_novograd_entry<peak::EmulatedExec>);
}
