// Every op of peak, declared once. Kernels are registered per backend (ops/ops_cpu.cpp,
// ops/ops_cuda.cu); fake kernels for torch.compile live in python/peak/ops.py.
//
// Aliasing: the input lists are marked mutable because callers may pass the same tensors as
// outputs (accumulate into the stash); the ops never write them otherwise.
// multi_tensor_scale_ with outputs=None works in place: the common unscale passes its list of
// gradients once, which halves the cost of converting a long list at the dispatcher.
#include <torch/library.h>

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
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis, float min_scale, float max_scale) -> ()");

  // Fused optimizers (see NOTE: [Fused master-weight step] in core/optimizer_ops.h). Empty
  // master_params: no master weights. Per-step scalars are device tensors; steps are per-param
  // float32 counts, bumped on device and restored when found_inf is set.
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "
      "Tensor(f!)[] steps, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool amsgrad, bool adam_w_mode, bool maximize, bool bias_correction, "
      "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536) -> ()");
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, Tensor lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize, "
      "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536) -> ()");
  m.def(
      "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
      "bool grad_averaging, bool bias_correction, float max_grad_norm, bool use_nvlamb, "
      "Tensor? grad_norm=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
      "int chunk_size=65536) -> ()");
}
