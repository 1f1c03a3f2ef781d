// Every op of peak, declared once. Kernels are registered per backend (ops/ops_cpu.cpp,
// ops/ops_cuda.cu); fake kernels for torch.compile live in python/peak/ops.py.
//
// Aliasing: the input lists are marked mutable because callers may pass the same tensors as
// outputs (accumulate into the stash); the ops never write them otherwise.
// multi_tensor_scale_ with outputs=None works in place: the common unscale passes its list of
// gradients once, which halves the cost of converting a long list at the dispatcher.
#include <torch/library.h>

#include "fused_schemas.h"

TORCH_LIBRARY(peak, m) {
  m.def(
      "multi_tensor_scale_(Tensor(a!)[] inputs, Tensor(b!)[]? outputs, Tensor scale, "
      "Tensor(c!) found_inf, int chunk_size=65536, Tensor(d!)? per_tensor_found_inf=None) -> ()");
  m.def(
      "multi_tensor_axpby_(Tensor(a!)[] xs, Tensor(b!)[] ys, Tensor(c!)[] outputs, Tensor a, "
      "Tensor b, Tensor(d!) found_inf, int check=3, int chunk_size=65536) -> ()");
  m.def(
      "multi_tensor_check_finite_(Tensor[] tensors, Tensor(a!) found_inf, int chunk_size=65536, "
      "Tensor(b!)? per_tensor_found_inf=None) -> ()");
  m.def(
      "multi_tensor_l2norm(Tensor[] tensors, bool per_tensor=False, int chunk_size=65536) "
      "-> (Tensor, Tensor)");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!)? hysteresis_tracker, "
      "Tensor[] found_infs, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");

  // Fused optimizers: see bindings/fused_schemas.h.
  m.def(peak::kFusedAdamSchema);
  m.def(peak::kFusedSgdSchema);
  m.def(peak::kFusedLambSchema);
  m.def(peak::kFusedAdagradSchema);
  m.def(peak::kFusedNovoGradSchema);
}
