// Schemas of the fused optimizer ops, shared by the peak library and its test-only twin
// peak_emulated (the same ops run through the emulated CUDA grid, see ops/ops_cpu.cpp).
// Empty master_params: no master weights. stochastic_rounding_seed (bf16 params without master
// weights only): round the stored weights stochastically (NOTE: [Stochastic rounding to bf16]).
// grad_norm + max_grad_norm > 0: clip by the global gradient norm inside the step (NOTE:
// [Clipping inside the step]). Per-step scalars are device tensors; steps are
// per-param float32 counts, bumped on device and restored when found_inf is set
// (see NOTE: [Fused master-weight step] in core/optimizer_ops.h). store_unscaled_grads: grads
// are written back divided by grad_scale (NOTE: [Unscaled gradients after the step]).
// Lean state (NOTE: [Lean optimizer state] in core/optimizer_ops.h): int16 master_params are
// remainders of bf16 params (fused_adam_, fused_sgd_); moments (momentum_buffers) may be
// bfloat16; moment_rounding_seed rounds bf16 moments stochastically (None: to nearest); uint8
// moments are 8-bit block-quantized codes whose per-256-element fp32 scales are the *_scales
// lists (empty otherwise; NOTE: [8-bit moments] in core/block_quant.h).
#pragma once

namespace peak {

inline constexpr const char* kFusedAdamSchema =
    "fused_adam_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "
    "Tensor(f!)[] steps, Tensor lr, float beta1, float beta2, float eps, float weight_decay, "
    "bool amsgrad, bool adam_w_mode, bool maximize, bool bias_correction, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "int? stochastic_rounding_seed=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
    "bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None) -> ()";

inline constexpr const char* kFusedSgdSchema =
    "fused_sgd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, Tensor lr, float momentum, "
    "float dampening, float weight_decay, bool nesterov, bool maximize, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "int? stochastic_rounding_seed=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
    "bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? momentum_scales=None) -> ()";

inline constexpr const char* kFusedLambSchema =
    "fused_lamb_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
    "bool grad_averaging, bool bias_correction, float max_grad_norm, bool use_nvlamb, "
    "Tensor? grad_norm=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
    "int chunk_size=65536, bool store_unscaled_grads=False, int? moment_rounding_seed=None, "
    "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None) -> ()";

// state_sums: Adagrad's fp32 sums of squared gradients; lr_decay as torch.optim.Adagrad's.
inline constexpr const char* kFusedAdagradSchema =
    "fused_adagrad_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] state_sums, Tensor(d!)[] steps, Tensor lr, float eps, float weight_decay, "
    "bool adagrad_w_mode, float lr_decay=0.0, Tensor? grad_scale=None, Tensor? found_inf=None, "
    "int chunk_size=65536, bool store_unscaled_grads=False) -> ()";

// exp_avg_sqs: one fp32 one-element tensor per param, the running gradient norm (Apex's
// group["exp_avg_sq"], kept per parameter). norm_type: 2 (L2) or 0 (infinity norm).
inline constexpr const char* kFusedNovoGradSchema =
    "fused_novograd_(Tensor(a!)[] params, Tensor(g!)[] grads, Tensor(b!)[] master_params, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, Tensor lr, "
    "float beta1, float beta2, float eps, float weight_decay, bool grad_averaging, "
    "bool reg_inside_moment, bool bias_correction, int norm_type=2, bool init_zero=False, "
    "Tensor? grad_scale=None, Tensor? found_inf=None, int chunk_size=65536, "
    "bool store_unscaled_grads=False) -> ()";

}  // namespace peak
