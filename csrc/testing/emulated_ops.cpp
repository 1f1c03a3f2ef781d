// Test-only twins (built with PEAK_TEST_TWINS=ON, as `make build` does; not in a release
// wheel): the multi-tensor ops and the fused optimizer ops run through the CUDA launcher's plan,
// metadata and per-block code emulated serially on the CPU (core/emulated_grid.h), so that the
// tests exercise the CUDA path's logic on a machine without a GPU. The optimizer twins are the
// torch.ops.peak_emulated.* ops (the same schemas as torch.ops.peak.*); the multi-tensor ones
// are bound in peak._C.emulated (emulated_bindings.cpp).
#include <torch/library.h>

#include "../core/emulated_grid.h"
#include "../ops/host_exec.h"
#include "../ops/op_entries.h"
#include "../ops/schemas.h"
#include "emulated_ops.h"

namespace peak {

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

}  // namespace peak

// Test-only twins of the fused optimizer ops that run through the emulated CUDA grid (launch
// plan, metadata with per-tensor scalars, per-block code), shaped by set_grid_shape.
TORCH_LIBRARY(peak_emulated, m) {
  for (const char* schema : peak::kFusedOptimizerSchemas) m.def(schema);
}

TORCH_LIBRARY_IMPL(peak_emulated, CPU, m) {
  m.impl("fused_adam_", &peak::fused_adam_entry<peak::EmulatedExec>);
  m.impl("fused_sgd_", &peak::fused_sgd_entry<peak::EmulatedExec>);
  m.impl("fused_lamb_", &peak::fused_lamb_entry<peak::EmulatedExec>);
  m.impl("fused_adagrad_", &peak::fused_adagrad_entry<peak::EmulatedExec>);
  m.impl("fused_novograd_", &peak::fused_novograd_entry<peak::EmulatedExec>);
}
