// Test-only twins (built with PEAK_TEST_TWINS=ON, as `make build` does; not in a release
// wheel): the multi-tensor ops and the fused optimizer ops run through the CUDA launcher's plan,
// metadata and per-block code emulated serially on the CPU (core/emulated_grid.h), so that the
// tests exercise the CUDA path's logic on a machine without a GPU. The optimizer twins are the
// torch.ops.peak_emulated.* ops (the same schemas as torch.ops.peak.*); the multi-tensor ones
// are bound in peak._C.emulated (emulated_bindings.cpp).
#include <torch/library.h>

#include "../ops/schemas.h"
#include "emulated_exec.h"
#include "emulated_ops.h"

namespace peak {

namespace {

// The grid shape the peak_emulated ops use (0: the real CUDA launcher's value).
thread_local emulated::GridShape g_emulated_shape{0, 0, 0};
// Blocks that took the vector path (NOTE: [Aligned vector access]), over all emulated launches of
// this thread since the last reset.
thread_local int64_t g_vectorised_blocks = 0;

}  // namespace

namespace emulated_ops {

emulated::GridShape current_grid_shape() { return g_emulated_shape; }
int64_t* vectorised_blocks_counter() { return &g_vectorised_blocks; }

int64_t take_vectorised_blocks() {
  const int64_t n = g_vectorised_blocks;
  g_vectorised_blocks = 0;
  return n;
}

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

// LAMB here; the other optimizers' twins in files of their own (emulated_exec.h).
TORCH_LIBRARY_IMPL(peak_emulated, CPU, m) {
  peak::register_kernels<peak::emulated_ops::EmulatedExec, peak::kLambOps>(m);
}
