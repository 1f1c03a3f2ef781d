// The per-element math of the fused optimizers, written once for CPU and CUDA (see the op
// interface in elementwise_ops.h).
//
// NOTE: [Fused master-weight step]
// One pass per chunk reads the gradient in its own dtype (fp32, fp16 or bf16), unscales it
// (multiplies by 1 / grad_scale: for the power-of-two scales that loss scalers use this is
// bit-for-bit torch's division, and one multiply is cheaper), updates the fp32 weight and the fp32
// optimizer state, and writes the model's weight in its own dtype. With master weights the fp32
// weight is the master copy (list "master") and the model weight (list "param") is only written;
// without, "param" is the fp32 (or low-precision) weight itself. A set found_inf skips the
// whole step before anything is touched (OpDefaults::skip), so an overflow leaves weights,
// masters and moments bit-for-bit unchanged; step counts are undone by the caller on device.
// Lists are ordered [grad, param, (master), state...]; index constants name them.
#pragma once

#include <cmath>

#include "elementwise_ops.h"
#include "stochastic_rounding.h"

namespace peak {

struct NoState {
  PEAK_HD void merge(const NoState&) {}
};

constexpr unsigned all_lists(int depth) { return (1u << depth) - 1u; }

// Shared by every fused optimizer: the step's device scalars.
//
// NOTE: [Clipping inside the step]
// With max_grad_norm > 0 and the global norm of the (still scaled) gradients on the device
// (grad_norm: computed by the pass that checked them for inf/NaN, or by the optimizer), every
// gradient is multiplied by torch.nn.utils.clip_grad_norm_'s factor
// min(1, max_grad_norm / (norm / grad_scale + 1e-6)) as it is read: no pass to unscale, none to
// clip. Both factors fold into one multiplier; for a power-of-two scale that is bit-for-bit
// (grad / scale) * clip, as unscale_ then clip_grad_norm_ would compute it.
struct OptimizerScalars {
  StepScalar lr;
  StepScalar grad_scale;  // ptr null: value 1
  StepScalar found_inf;   // ptr null: value 0
  StepScalar grad_norm;   // ptr null: no clipping
  float max_grad_norm = 0.0f;
  float grad_factor = 1.0f;  // 1 / grad_scale, times the clipping factor
  float inv_grad_scale = 1.0f;
  PEAK_HD void load() {
    lr.load();
    grad_scale.load();
    found_inf.load();
    grad_norm.load();
    float clip = 1.0f;
    if (grad_norm.ptr != nullptr && max_grad_norm > 0.0f) {
      clip = max_grad_norm / (grad_norm.value / grad_scale.value + 1e-6f);
      if (clip > 1.0f) clip = 1.0f;
    }
    inv_grad_scale = 1.0f / grad_scale.value;
    grad_factor = inv_grad_scale * clip;
  }
};

// NOTE: [Unscaled gradients after the step]
// torch's fused optimizers leave p.grad unscaled after a step that was handed grad_scale (a
// skipped step leaves it as it was), and code after the step (logging, gradient noise
// statistics, a second optimizer over the same grads) reads it. `StoreGrad` ops write
// grad * (1 / grad_scale) back in the same pass: one more store of the gradient's bytes, no
// extra read. It is the unscaled gradient, not the clipped one (torch's clip_grad_norm_ would
// have clipped it in place; peak's in-step clipping is an optimization of the step only). A
// template constant, so the variant without it stores nothing.
constexpr unsigned grad_list_if(bool store_grad) { return store_grad ? 1u : 0u; }

// `Rounded`: bf16 weights stepped without masters, stochastically rounded. A template
// parameter, not a flag read per element: as a flag the vectorised loop computed the random
// bits of every element and then threw them away (most of an fp32 step's time).
template <bool HasMaster, bool Amsgrad, bool Rounded = false, bool StoreGrad = false>
struct AdamOp : OpDefaults {
  static_assert(!(HasMaster && Rounded), "stochastic rounding is for weights without masters");
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;  // the fp32 weight stepped
  static constexpr int kExpAvg = kWeight + 1, kExpAvgSq = kWeight + 2, kMaxExpAvgSq = kWeight + 3;
  static constexpr int depth = kExpAvgSq + 1 + (Amsgrad ? 1 : 0);
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask =
      (all_lists(depth) & ~(1u << kGrad)) | grad_list_if(StoreGrad);
  static constexpr int tensor_scalars = 1;  // the step count
  static constexpr bool indexed = Rounded;  // stochastic rounding's random bits
  using State = NoState;

  OptimizerScalars s;
  // Hyperparameters as doubles, like torch's Python floats; the element math uses float values
  // derived from them once (1 - beta in double, then rounded, as torch's scalar arguments are).
  double beta1 = 0.9, beta2 = 0.999, weight_decay = 0.0;
  float eps = 1e-8f;
  bool adam_w = false, maximize = false, bias_correction = true;
  float beta2_f = 0.999f, one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  // Branch-free forms of the options, so the element loop vectorises: multiplying by 1 and
  // adding 0 * w are exact (for finite weights).
  float sign = 1.0f;          // -1 with maximize
  float decay_factor = 1.0f;  // AdamW: 1 - lr * weight_decay
  float l2 = 0.0f;            // Adam: weight_decay (added to the gradient)
  // Per tensor, from its step count.
  float step_size = 0.0f, inv_bias_correction2_sqrt = 1.0f;
  // bf16 weights without masters only (NOTE: [Stochastic rounding to bf16]).
  StochasticRounding rounding;

  PEAK_HD void load_scalars() {
    s.load();
    beta2_f = static_cast<float>(beta2);
    one_minus_beta1 = static_cast<float>(1.0 - beta1);
    one_minus_beta2 = static_cast<float>(1.0 - beta2);
    sign = maximize ? -1.0f : 1.0f;
    decay_factor = adam_w ? static_cast<float>(1.0 - static_cast<double>(s.lr.value) * weight_decay)
                          : 1.0f;
    l2 = adam_w ? 0.0f : static_cast<float>(weight_decay);
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    const double step = *p[0];
    const double bc1 = bias_correction ? 1.0 - pow(beta1, step) : 1.0;
    const double bc2 = bias_correction ? 1.0 - pow(beta2, step) : 1.0;
    step_size = static_cast<float>(s.lr.value / bc1);
    inv_bias_correction2_sqrt = static_cast<float>(1.0 / sqrt(bc2));
    if constexpr (Rounded) rounding.load_step(*p[0]);
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&, [[maybe_unused]] int64_t index = 0) const {
    float w = v[kWeight];
    const float g = fmaf(l2, w, sign * (v[kGrad] * s.grad_factor));
    w = w * decay_factor;
    const float m = fmaf(one_minus_beta1, g - v[kExpAvg], v[kExpAvg]);  // lerp, as torch
    const float vsq = fmaf(one_minus_beta2, g * g, beta2_f * v[kExpAvgSq]);
    float second = vsq;
    if constexpr (Amsgrad) {
      second = v[kMaxExpAvgSq] > vsq ? v[kMaxExpAvgSq] : vsq;
      v[kMaxExpAvgSq] = second;
    }
    const float denom = sqrtf(second) * inv_bias_correction2_sqrt + eps;
    w = w - step_size * (m / denom);
    v[kExpAvg] = m;
    v[kExpAvgSq] = vsq;
    v[kWeight] = w;
    // The model's copy, rounded once to its dtype on store (or stochastically, then exact).
    if constexpr (Rounded) {
      v[kParam] = rounding.round(w, v[kGrad], index);
    } else {
      v[kParam] = w;
    }
    if constexpr (StoreGrad) v[kGrad] = v[kGrad] * s.inv_grad_scale;  // after the rounding's bits
  }
};

// Rounded, StoreGrad: as AdamOp.
template <bool HasMaster, bool HasMomentum, bool Rounded = false, bool StoreGrad = false>
struct SgdOp : OpDefaults {
  static_assert(!(HasMaster && Rounded), "stochastic rounding is for weights without masters");
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kMomentum = kWeight + 1;
  static constexpr int depth = kWeight + 1 + (HasMomentum ? 1 : 0);
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask =
      (all_lists(depth) & ~(1u << kGrad)) | grad_list_if(StoreGrad);
  static constexpr int tensor_scalars = 1;  // the step count: the first step seeds the momentum
  static constexpr bool indexed = Rounded;  // stochastic rounding's random bits
  using State = NoState;

  OptimizerScalars s;
  float momentum = 0.0f, weight_decay = 0.0f;
  double dampening = 0.0;
  bool nesterov = false, maximize = false;
  bool first_step = false;
  float one_minus_dampening = 1.0f;
  StochasticRounding rounding;  // bf16 weights without masters only

  PEAK_HD void load_scalars() {
    s.load();
    one_minus_dampening = static_cast<float>(1.0 - dampening);
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    first_step = *p[0] <= 1.0f;
    if constexpr (Rounded) rounding.load_step(*p[0]);
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&, [[maybe_unused]] int64_t index = 0) const {
    float w = v[kWeight];
    float g = fmaf(weight_decay, w, (maximize ? -1.0f : 1.0f) * (v[kGrad] * s.grad_factor));
    if constexpr (HasMomentum) {
      const float buf = first_step ? g : fmaf(one_minus_dampening, g, momentum * v[kMomentum]);
      v[kMomentum] = buf;
      g = nesterov ? fmaf(momentum, buf, g) : buf;
    }
    w = fmaf(-s.lr.value, g, w);
    v[kWeight] = w;
    if constexpr (Rounded) {
      v[kParam] = rounding.round(w, v[kGrad], index);
    } else {
      v[kParam] = w;
    }
    if constexpr (StoreGrad) v[kGrad] = v[kGrad] * s.inv_grad_scale;  // after the rounding's bits
  }
};

// LAMB, as Apex's FusedLAMB (stage 1: moments and the raw update; stage 2: the per-tensor trust
// ratio from the norms of the weights and of the update, computed between the stages).
template <bool StoreGrad = false>  // as AdamOp
struct LambStage1Op : OpDefaults {
  static constexpr int kGrad = 0, kWeight = 1, kExpAvg = 2, kExpAvgSq = 3, kUpdate = 4;
  static constexpr int depth = 5;
  static constexpr unsigned read_mask = 0b01111;
  static constexpr unsigned write_mask = 0b11100 | grad_list_if(StoreGrad);
  static constexpr int tensor_scalars = 1;  // the step count
  using State = NoState;

  StepScalar grad_scale;
  StepScalar found_inf;
  StepScalar grad_norm;  // global norm of the (still scaled) gradients
  float max_grad_norm = 0.0f;  // 0: no clipping
  double beta1 = 0.9, beta2 = 0.999;
  float eps = 1e-6f, weight_decay = 0.0f;
  bool adam_w = true, grad_averaging = true, bias_correction = true;
  float grad_divisor = 1.0f;  // grad_scale times the clipping factor
  float bias_correction1 = 1.0f, bias_correction2 = 1.0f;
  float beta1_f = 0.9f, beta2_f = 0.999f, beta3 = 0.1f, one_minus_beta2 = 0.001f;

  PEAK_HD void load_scalars() {
    beta1_f = static_cast<float>(beta1);
    beta2_f = static_cast<float>(beta2);
    beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.0f;
    one_minus_beta2 = static_cast<float>(1.0 - beta2);
    grad_scale.load();
    found_inf.load();
    grad_norm.load();
    const float norm = grad_norm.value / grad_scale.value;
    const float clip = (max_grad_norm > 0.0f && norm > max_grad_norm) ? norm / max_grad_norm : 1.0f;
    grad_divisor = grad_scale.value * clip;
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    const double step = *p[0];
    bias_correction1 = bias_correction ? static_cast<float>(1.0 - pow(beta1, step)) : 1.0f;
    bias_correction2 = bias_correction ? static_cast<float>(1.0 - pow(beta2, step)) : 1.0f;
  }
  PEAK_HD bool skip() const { return found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&) const {
    float g = v[kGrad] / grad_divisor;
    const float w = v[kWeight];
    if (!adam_w && weight_decay != 0.0f) g = fmaf(weight_decay, w, g);
    const float m = fmaf(beta3, g, beta1_f * v[kExpAvg]);
    const float vsq = fmaf(one_minus_beta2, g * g, beta2_f * v[kExpAvgSq]);
    float update = (m / bias_correction1) / (sqrtf(vsq / bias_correction2) + eps);
    if (adam_w && weight_decay != 0.0f) update = fmaf(weight_decay, w, update);
    v[kExpAvg] = m;
    v[kExpAvgSq] = vsq;
    v[kUpdate] = update;
    if constexpr (StoreGrad) v[kGrad] = v[kGrad] / grad_scale.value;
  }
};

template <bool HasMaster>
struct LambStage2Op : OpDefaults {
  static constexpr int kUpdate = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int depth = kWeight + 1;
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask = all_lists(depth) & ~(1u << kUpdate);
  static constexpr int tensor_scalars = 2;  // norm of the weight, norm of the update
  using State = NoState;

  StepScalar lr;
  StepScalar found_inf;
  bool use_trust_ratio = true;  // Apex: when weight_decay != 0 or use_nvlamb
  float ratio = 1.0f;

  PEAK_HD void load_scalars() {
    lr.load();
    found_inf.load();
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    const float weight_norm = *p[0], update_norm = *p[1];
    ratio = (use_trust_ratio && weight_norm != 0.0f && update_norm != 0.0f)
                ? lr.value * (weight_norm / update_norm)
                : lr.value;
  }
  PEAK_HD bool skip() const { return found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&) const {
    const float w = fmaf(-ratio, v[kUpdate], v[kWeight]);
    v[kWeight] = w;
    v[kParam] = w;
  }
};

// Adagrad, as torch.optim.Adagrad (lr_decay, weight decay added to the gradient) and Apex's
// FusedAdagrad (adagrad_w_mode: decoupled weight decay, w -= lr * (g / std + wd * w)).
template <bool HasMaster, bool StoreGrad = false>  // StoreGrad: as AdamOp
struct AdagradOp : OpDefaults {
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kSum = kWeight + 1;
  static constexpr int depth = kSum + 1;
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask =
      (all_lists(depth) & ~(1u << kGrad)) | grad_list_if(StoreGrad);
  static constexpr int tensor_scalars = 1;  // the step count (lr_decay)
  using State = NoState;

  OptimizerScalars s;
  double lr_decay = 0.0;
  float eps = 1e-10f, weight_decay = 0.0f;
  bool w_mode = false;
  float l2 = 0.0f, decoupled = 0.0f;  // branch-free forms of the weight-decay mode
  float clr = 0.0f;                   // per tensor: lr / (1 + (step - 1) * lr_decay)

  PEAK_HD void load_scalars() {
    s.load();
    l2 = w_mode ? 0.0f : weight_decay;
    decoupled = w_mode ? weight_decay : 0.0f;
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    const double step = *p[0];
    clr = static_cast<float>(s.lr.value / (1.0 + (step - 1.0) * lr_decay));
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&) const {
    float w = v[kWeight];
    const float g = fmaf(l2, w, v[kGrad] * s.grad_factor);
    const float sum = fmaf(g, g, v[kSum]);
    const float std_dev = sqrtf(sum) + eps;
    w = w - clr * fmaf(decoupled, w, g / std_dev);
    v[kSum] = sum;
    v[kWeight] = w;
    v[kParam] = w;
    if constexpr (StoreGrad) v[kGrad] = v[kGrad] * s.inv_grad_scale;
  }
};

// NovoGrad, as Apex's FusedNovoGrad: a per-tensor second moment of the gradient's norm (blended
// before the launch, on the device: see fused_novograd in ops/optimizer_ops_impl.h) and
// per-element first moments. reg_inside_moment (Apex's moment_mode 0): the gradient is
// normalised and decayed before the momentum; otherwise (mode 1, Apex's default) the update is.
template <bool HasMaster, bool StoreGrad = false>  // StoreGrad: as AdamOp
struct NovoGradOp : OpDefaults {
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kExpAvg = kWeight + 1;
  static constexpr int depth = kExpAvg + 1;
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask =
      (all_lists(depth) & ~(1u << kGrad)) | grad_list_if(StoreGrad);
  static constexpr int tensor_scalars = 2;  // the step count, the blended gradient norm
  using State = NoState;

  OptimizerScalars s;
  double beta1 = 0.95, beta2 = 0.98;
  float eps = 1e-8f, weight_decay = 0.0f;
  bool grad_averaging = true, reg_inside_moment = false, bias_correction = true;
  float beta1_f = 0.95f, beta3 = 0.05f;
  // Per tensor.
  float inv_bias_correction1 = 1.0f, denom = 1.0f;

  PEAK_HD void load_scalars() {
    s.load();
    beta1_f = static_cast<float>(beta1);
    beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.0f;
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    const double step = *p[0];
    const double bc1 = bias_correction ? 1.0 - pow(beta1, step) : 1.0;
    const double bc2 = bias_correction ? sqrt(1.0 - pow(beta2, step)) : 1.0;
    inv_bias_correction1 = static_cast<float>(1.0 / bc1);
    denom = *p[1] / static_cast<float>(bc2) + eps;
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&) const {
    float w = v[kWeight];
    float g = v[kGrad] * s.grad_factor;
    float m;
    if (reg_inside_moment) {
      g = fmaf(weight_decay, w, g / denom);
      m = fmaf(beta3, g, beta1_f * v[kExpAvg]);
      w = w - s.lr.value * (m * inv_bias_correction1);
    } else {
      m = fmaf(beta3, g, beta1_f * v[kExpAvg]);
      const float update = fmaf(weight_decay, w, (m * inv_bias_correction1) / denom);
      w = w - s.lr.value * update;
    }
    v[kExpAvg] = m;
    v[kWeight] = w;
    v[kParam] = w;
    if constexpr (StoreGrad) v[kGrad] = v[kGrad] * s.inv_grad_scale;
  }
};

}  // namespace peak
