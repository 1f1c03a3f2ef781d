// Every op of peak, declared once: the one TORCH_LIBRARY(peak) block (library.cpp) defines
// these, and the test-only twins (csrc/testing/, built with PEAK_TEST_TWINS=ON) reuse them. The
// kernels are registered per backend (cpu_kernels.cpp, ops_cuda.cu); the fake kernels for
// torch.compile live in python/peak/ops.py, the one Python caller of these ops.
//
// NOTE: [Keyword-only scalars] The tensor lists come first, positionally; everything after them
// (device scalars, hyperparameters, flags, options) is keyword-only, so a call site names every
// number it passes and an argument added later cannot shift the meaning of an old call.
//
// Aliasing: the input lists are marked mutable because callers may pass the same tensors as
// outputs (accumulate into the stash); the ops never write them otherwise.
// multi_tensor_scale_ with outputs=None works in place: the common unscale passes its list of
// gradients once, which halves the cost of converting a long list at the dispatcher.
//
// Fused optimizers: empty master_params: no master weights. stochastic_rounding_seed (bf16
// params without master weights only): round the stored weights stochastically (NOTE:
// [Stochastic rounding to bf16]). grad_norm + max_grad_norm > 0: clip by the global gradient norm
// inside the step (NOTE: [Clipping inside the step]). Per-step scalars are device tensors; steps
// are per-param float32 counts, bumped on device and restored when found_inf is set (NOTE:
// [Fused master-weight step] in core/optimizer_ops.h). store_unscaled_grads: grads are written
// back divided by grad_scale (NOTE: [Unscaled gradients after the step]). Lean state (NOTE:
// [Lean optimizer state] in core/optimizer_ops.h): int16 master_params are remainders of bf16
// params (fused_adam_, fused_sgd_); moments (momentum_buffers) may be bfloat16;
// moment_rounding_seed rounds bf16 moments (and 8-bit exp_avg_sqs) stochastically (None: to
// nearest); uint8 moments are 8-bit block-quantized codes whose per-256-element fp32 scales are
// the *_scales lists (None otherwise; NOTE: [8-bit moments] in core/block_quant.h).
#pragma once

namespace peak {

inline constexpr const char* kMultiTensorScaleSchema =
    "multi_tensor_scale_(Tensor(a!)[] inputs, Tensor(b!)[]? outputs, *, Tensor scale, "
    "Tensor(c!) found_inf, int chunk_size=65536, Tensor(d!)? per_tensor_found_inf=None) -> ()";

inline constexpr const char* kMultiTensorAxpbySchema =
    "multi_tensor_axpby_(Tensor(a!)[] xs, Tensor(b!)[] ys, Tensor(c!)[] outputs, *, Tensor a, "
    "Tensor b, Tensor(d!) found_inf, int check=3, int chunk_size=65536) -> ()";

inline constexpr const char* kMultiTensorCheckFiniteSchema =
    "multi_tensor_check_finite_(Tensor[] tensors, *, Tensor(a!) found_inf, "
    "int chunk_size=65536, Tensor(b!)? per_tensor_found_inf=None) -> ()";

inline constexpr const char* kMultiTensorL2normSchema =
    "multi_tensor_l2norm(Tensor[] tensors, *, bool per_tensor=False, int chunk_size=65536) "
    "-> (Tensor, Tensor)";

inline constexpr const char* kUpdateScaleSchema =
    "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!)? hysteresis_tracker, "
    "Tensor[] found_infs, *, float growth_factor, float backoff_factor, int growth_interval, "
    "int hysteresis, float min_scale, float max_scale) -> ()";

// NOTE: [Merging overflow flags] in found_inf_merge.h. One backend-agnostic kernel
// (CompositeExplicitAutograd); its fake kernel is in ops.py, as every op's.
inline constexpr const char* kMergeFoundInfsSchema =
    "merge_found_infs(Tensor[] found_infs, *, Device device, int[] shape) -> Tensor";

inline constexpr const char* kFusedAdamSchema =
    "fused_adam_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "
    "Tensor(f!)[] steps, *, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool amsgrad, bool adam_w_mode, bool maximize, bool bias_correction, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "int? stochastic_rounding_seed=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
    "bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None) -> ()";

inline constexpr const char* kFusedSgdSchema =
    "fused_sgd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, *, Tensor lr, float momentum, "
    "float dampening, float weight_decay, bool nesterov, bool maximize, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "int? stochastic_rounding_seed=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
    "bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? momentum_scales=None) -> ()";

// updates / weight_norms / update_norms: LAMB in two calls on shards (NOTE: [LAMB in two calls]).
inline constexpr const char* kFusedLambSchema =
    "fused_lamb_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, *, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
    "bool grad_averaging, bool bias_correction, float max_grad_norm, bool use_nvlamb, "
    "Tensor? grad_norm=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
    "int chunk_size=65536, bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None, "
    "Tensor(j!)[]? updates=None, Tensor? weight_norms=None, Tensor? update_norms=None) -> ()";

// state_sums: Adagrad's fp32 sums of squared gradients; lr_decay as torch.optim.Adagrad's.
inline constexpr const char* kFusedAdagradSchema =
    "fused_adagrad_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] state_sums, Tensor(d!)[] steps, *, Tensor lr, float eps, float weight_decay, "
    "bool adagrad_w_mode, float lr_decay=0.0, Tensor? grad_scale=None, Tensor? found_inf=None, "
    "int chunk_size=65536, bool store_unscaled_grads=False) -> ()";

// exp_avg_sqs: one fp32 one-element tensor per param, the running gradient norm (Apex's
// group["exp_avg_sq"], kept per parameter). norm_type: 2 (L2) or 0 (infinity norm). grad_norms:
// the gradients' per-tensor norms (as passed, still scaled) when the caller reduced them over
// shards; else the op computes them.
inline constexpr const char* kFusedNovoGradSchema =
    "fused_novograd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, *, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool grad_averaging, "
    "bool reg_inside_moment, bool bias_correction, int norm_type=2, bool init_zero=False, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "bool store_unscaled_grads=False, Tensor? grad_norms=None) -> ()";

// The optimizer ops, for the test-only twins that run them through the emulated CUDA grid.
inline constexpr const char* kFusedOptimizerSchemas[] = {
    kFusedAdamSchema, kFusedSgdSchema, kFusedLambSchema, kFusedAdagradSchema,
    kFusedNovoGradSchema};

}  // namespace peak
