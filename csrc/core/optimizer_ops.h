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
#include <tuple>
#include <type_traits>

#include "block_quant.h"
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
// statistics, a second optimizer over the same grads) reads it. With `store_grad` the launchers
// write unscaled_grad(grad) = grad * (1 / grad_scale) back in the same pass: one more store of
// the gradient's bytes, no extra read from memory. It is the unscaled gradient, not the clipped
// one (torch's clip_grad_norm_ would have clipped it in place; peak's in-step clipping is an
// optimization of the step only). A run-time flag, not a template constant: the CPU launcher
// tests it once per chunk (choosing between an element loop that stores the gradient and one
// that does not), the grid launchers as a branch uniform over the grid, so a step without it
// stores nothing more, and the functor is not instantiated twice. The functor leaves v[kGrad] as it was
// read, so the stored value is computed from the raw gradient, after the rounding's bits.

// NOTE: [Lean optimizer state]
// The storage of an optimizer's own lists is a template argument of its functor, so one functor
// serves every choice (no copy per dtype): fp32 masters or remainders (NOTE: [Remainder
// masters] in host_device.h), and each moment in fp32 or bf16. The functor still sees float
// values: the launchers widen bf16 moments exactly and round them back on store (to nearest
// even), except where the functor rounds a moment itself, stochastically (`MomentRounding`),
// so that the stored value is already a bf16 value and the store is exact.
//
// Why stochastic: a bf16 exp_avg_sq updated as beta2 * v + (1 - beta2) * g^2 with beta2 = 0.999
// changes by 0.1% per step, less than half a bf16 ulp (2^-9 = 0.2% relative), so round to
// nearest returns the old value: v neither decays nor follows a gradient that shrinks, and the
// steps come out too small (docs/core.md shows the effect on a training run). Rounding up with
// probability equal to the dropped fraction keeps v right on average.
// 8-bit moments (ExpAvgT = Q8ExpAvg, ExpAvgSqT = Q8ExpAvgSq: NOTE: [8-bit moments] in
// block_quant.h) are decoded before the functor and encoded after it, per block, by the launchers.
// Stochastic: bf16 moments are rounded stochastically by the functor (else to nearest even by
// the store). A template constant, as `Rounded` is: the variant without it computes no random bits.
template <typename MasterT = float, typename ExpAvgT = float, typename ExpAvgSqT = float,
          bool Stochastic = false>
struct StateStorage {
  using Master = MasterT;
  using ExpAvg = ExpAvgT;    // SGD: the momentum buffer
  using ExpAvgSq = ExpAvgSqT;
  static constexpr bool remainder = std::is_same_v<MasterT, Remainder16>;
  static constexpr bool round_exp_avg = Stochastic && std::is_same_v<ExpAvgT, c10::BFloat16>;
  static constexpr bool round_exp_avg_sq = Stochastic && std::is_same_v<ExpAvgSqT, c10::BFloat16>;
  static constexpr bool rounds_moments = round_exp_avg || round_exp_avg_sq;
  // 8-bit block-quantized moments (NOTE: [8-bit moments] in block_quant.h): the launchers decode
  // and encode them around the functor, which sees float values as for the other storages.
  static constexpr int q8_exp_avg = is_q8<ExpAvgT> ? 1 : 0;
  static constexpr int q8_exp_avg_sq = is_q8<ExpAvgSqT> ? 1 : 0;
  static constexpr bool quantized = q8_exp_avg + q8_exp_avg_sq > 0;
  // 8-bit exp_avg_sq codes are rounded stochastically by the launchers (NOTE: [8-bit moments]).
  static constexpr bool q8_stochastic = Stochastic && q8_exp_avg_sq;
  // The ops derive a moment-rounding key per tensor and step.
  static constexpr bool keys_moments = rounds_moments || q8_stochastic;
};
using FullPrecisionState = StateStorage<>;

// The fp32 weight a step starts from: the master (fp32, or rebuilt from the bf16 weight and its
// remainder) or the weight itself.
template <typename Storage, bool HasMaster>
PEAK_HD float load_weight(const float* v, int k_param, int k_weight) {
  if constexpr (HasMaster && Storage::remainder) {
    return master_from_remainder(v[k_param], v[k_weight]);
  } else {
    return v[k_weight];
  }
}

// Stores the stepped master: as fp32 and its rounding to the model's dtype (by the launcher's
// store), or split into the bf16 weight and the remainder.
template <typename Storage>
PEAK_HD void store_master(float* v, int k_param, int k_master, float w) {
  if constexpr (Storage::remainder) {
    split_master(w, v[k_param], v[k_master]);
  } else {
    v[k_master] = w;
    v[k_param] = w;
  }
}

// Stochastic rounding of bf16 moments (NOTE: [Lean optimizer state]). One hash per element
// serves both moments (exp_avg takes its low 16 bits, exp_avg_sq its high 16): a function of
// the element's index, its raw gradient and a key from the seed and the tensor's step count, as
// for the weights (NOTE: [Stochastic rounding to bf16]): stateless, so a resumed run and every
// launcher give the same bits. The seed is mixed apart from the weights' rounding seed.
struct MomentRounding {
  uint32_t seed = 0;
  uint32_t key = 0;  // per tensor: seed and step count

  PEAK_HD void set_seed(uint32_t s) { seed = mix32(s ^ 0x9E3779B9u); }
  PEAK_HD void load_step(float step) { key = mix32(seed ^ mix32(float_bits(step))); }
  PEAK_HD uint32_t random(float grad, int64_t index) const {
    return mix32(float_bits(grad) ^ key ^ (static_cast<uint32_t>(index) * 0x9E3779B9u));
  }
  PEAK_HD static float low(float x, uint32_t r) { return stochastic_round_bf16(x, r); }
  PEAK_HD static float high(float x, uint32_t r) { return stochastic_round_bf16(x, r >> 16); }
};

// The list storage types of an optimizer launch, in list order, as a tuple type.
template <typename... T>
using ListTypes = std::tuple<T...>;
template <bool Cond, typename T>
using ListIf = std::conditional_t<Cond, std::tuple<T>, std::tuple<>>;
template <typename... Tuples>
using ConcatLists = decltype(std::tuple_cat(std::declval<Tuples>()...));

// `Rounded`: bf16 weights stepped without masters, stochastically rounded. A template
// parameter, not a flag read per element: as a flag the vectorised loop computed the random
// bits of every element and then threw them away (most of an fp32 step's time).
// Storage: NOTE: [Lean optimizer state] (max_exp_avg_sq is stored as exp_avg_sq is).
template <bool HasMaster, bool Amsgrad, bool Rounded = false,
          typename Storage = FullPrecisionState>
struct AdamOp : OpDefaults {
  static_assert(!(HasMaster && Rounded), "stochastic rounding is for weights without masters");
  static constexpr bool rounded_weights = Rounded;
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;  // the fp32 weight stepped (or remainder)
  static constexpr int kExpAvg = kWeight + 1, kExpAvgSq = kWeight + 2, kMaxExpAvgSq = kWeight + 3;
  static constexpr int depth = kExpAvgSq + 1 + (Amsgrad ? 1 : 0);
  // Without a remainder the model weight is only written; with one it holds the high half.
  static constexpr unsigned read_mask =
      all_lists(depth) & ~(HasMaster && !Storage::remainder ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask = all_lists(depth) & ~(1u << kGrad);
  static constexpr bool stores_grad = true;
  bool store_grad = false;
  PEAK_HD float unscaled_grad(float g) const { return g * s.inv_grad_scale; }
  // The step count, then the scales of quantized moments (NOTE: [8-bit moments]).
  static constexpr int tensor_scalars = 1 + Storage::q8_exp_avg + Storage::q8_exp_avg_sq;
  // Stochastic rounding's random bits (of the weights, or of bf16 moments).
  static constexpr bool indexed = Rounded || Storage::rounds_moments;
  static constexpr bool remainder_master = HasMaster && Storage::remainder;
  static constexpr bool q8_stochastic = Storage::q8_stochastic;
  static constexpr unsigned exact_mask = (remainder_master || Rounded ? 1u << kParam : 0u) |
                                         (Storage::round_exp_avg ? 1u << kExpAvg : 0u) |
                                         (Storage::round_exp_avg_sq ? 1u << kExpAvgSq : 0u);
  using State = NoState;
  template <typename T>
  using Lists = ConcatLists<ListTypes<T, T>, ListIf<HasMaster, typename Storage::Master>,
                            ListTypes<typename Storage::ExpAvg, typename Storage::ExpAvgSq>,
                            ListIf<Amsgrad, typename Storage::ExpAvgSq>>;

  OptimizerScalars s;
  // Hyperparameters as doubles, like torch's Python floats; the element math uses float values
  // derived from them once (1 - beta in double, then rounded, as torch's scalar arguments are).
  double beta1 = 0.9, beta2 = 0.999, weight_decay = 0.0;
  float eps = 1e-8f;
  bool adam_w = false, maximize = false, bias_correction = true;
  float beta2_f = 0.999f, one_minus_beta1 = 0.1f, one_minus_beta2 = 0.001f;
  // Branch-free forms of the options, so the element loop vectorises: multiplying by 1 and
  // adding 0 * w are exact (for finite weights).
  float signed_grad_factor = 1.0f;  // s.grad_factor, negated with maximize (exact: +-1 * x)
  float decay_factor = 1.0f;  // AdamW: 1 - lr * weight_decay
  float l2 = 0.0f;            // Adam: weight_decay (added to the gradient)
  // Per tensor, from its step count.
  float step_size = 0.0f, inv_bias_correction2_sqrt = 1.0f;
  // bf16 weights without masters only (NOTE: [Stochastic rounding to bf16]).
  StochasticRounding rounding;
  MomentRounding moment_rounding;  // bf16 moments only

  PEAK_HD void load_scalars() {
    s.load();
    beta2_f = static_cast<float>(beta2);
    one_minus_beta1 = static_cast<float>(1.0 - beta1);
    one_minus_beta2 = static_cast<float>(1.0 - beta2);
    signed_grad_factor = maximize ? -s.grad_factor : s.grad_factor;
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
    if constexpr (Storage::keys_moments) moment_rounding.load_step(*p[0]);
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&, [[maybe_unused]] int64_t index = 0) const {
    float w = load_weight<Storage, HasMaster>(v, kParam, kWeight);
    const float g = fmaf(l2, w, v[kGrad] * signed_grad_factor);
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
    // The moments as computed (the next step's are rounded from what is stored, not from these).
    [[maybe_unused]] uint32_t random = 0;
    if constexpr (Storage::rounds_moments) random = moment_rounding.random(v[kGrad], index);
    v[kExpAvg] = Storage::round_exp_avg ? MomentRounding::low(m, random) : m;
    v[kExpAvgSq] = Storage::round_exp_avg_sq ? MomentRounding::high(vsq, random) : vsq;
    if constexpr (HasMaster) {
      store_master<Storage>(v, kParam, kWeight, w);
    } else if constexpr (Rounded) {
      // The model's copy, rounded stochastically, then stored exactly.
      v[kWeight] = rounding.round(w, v[kGrad], index);
    } else {
      v[kWeight] = w;  // (rounded once to its dtype on store)
    }
  }
};

// Rounded, Storage: as AdamOp (Storage::ExpAvg is the momentum buffer's).
template <bool HasMaster, bool HasMomentum, bool Rounded = false,
          typename Storage = FullPrecisionState>
struct SgdOp : OpDefaults {
  static_assert(!(HasMaster && Rounded), "stochastic rounding is for weights without masters");
  static constexpr bool rounded_weights = Rounded;
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kMomentum = kWeight + 1;
  static constexpr int depth = kWeight + 1 + (HasMomentum ? 1 : 0);
  static constexpr unsigned read_mask =
      all_lists(depth) & ~(HasMaster && !Storage::remainder ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask = all_lists(depth) & ~(1u << kGrad);
  static constexpr bool stores_grad = true;
  bool store_grad = false;
  PEAK_HD float unscaled_grad(float g) const { return g * s.inv_grad_scale; }
  // The step count (the first step seeds the momentum), then an 8-bit buffer's scales.
  static constexpr int tensor_scalars = 1 + (HasMomentum ? Storage::q8_exp_avg : 0);
  static constexpr bool rounds_momentum = HasMomentum && Storage::round_exp_avg;
  static constexpr bool indexed = Rounded || rounds_momentum;  // stochastic rounding's bits
  static constexpr bool remainder_master = HasMaster && Storage::remainder;
  static constexpr unsigned exact_mask = (remainder_master || Rounded ? 1u << kParam : 0u) |
                                         (rounds_momentum ? 1u << kMomentum : 0u);
  using State = NoState;
  template <typename T>
  using Lists = ConcatLists<ListTypes<T, T>, ListIf<HasMaster, typename Storage::Master>,
                            ListIf<HasMomentum, typename Storage::ExpAvg>>;

  OptimizerScalars s;
  float momentum = 0.0f, weight_decay = 0.0f;
  double dampening = 0.0;
  bool nesterov = false, maximize = false;
  bool first_step = false;
  float one_minus_dampening = 1.0f;
  StochasticRounding rounding;  // bf16 weights without masters only
  MomentRounding moment_rounding;  // a bf16 momentum buffer only (its exp_avg key)

  PEAK_HD void load_scalars() {
    s.load();
    one_minus_dampening = static_cast<float>(1.0 - dampening);
  }
  PEAK_HD void load_tensor_scalars(const float* const* p) {
    first_step = *p[0] <= 1.0f;
    if constexpr (Rounded) rounding.load_step(*p[0]);
    if constexpr (rounds_momentum) moment_rounding.load_step(*p[0]);
  }
  PEAK_HD bool skip() const { return s.found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&, [[maybe_unused]] int64_t index = 0) const {
    float w = load_weight<Storage, HasMaster>(v, kParam, kWeight);
    float g = fmaf(weight_decay, w, (maximize ? -1.0f : 1.0f) * (v[kGrad] * s.grad_factor));
    if constexpr (HasMomentum) {
      const float buf = first_step ? g : fmaf(one_minus_dampening, g, momentum * v[kMomentum]);
      if constexpr (rounds_momentum) {
        v[kMomentum] = MomentRounding::low(buf, moment_rounding.random(v[kGrad], index));
      } else {
        v[kMomentum] = buf;
      }
      g = nesterov ? fmaf(momentum, buf, g) : buf;
    }
    w = fmaf(-s.lr.value, g, w);
    if constexpr (HasMaster) {
      store_master<Storage>(v, kParam, kWeight, w);
    } else if constexpr (Rounded) {
      v[kWeight] = rounding.round(w, v[kGrad], index);
    } else {
      v[kWeight] = w;
    }
  }
};

// LAMB, as Apex's FusedLAMB (stage 1: moments and the raw update; stage 2: the per-tensor trust
// ratio from the norms of the weights and of the update, computed between the stages).
// Storage (its moments only: LAMB keeps fp32 masters): as AdamOp.
template <typename Storage = FullPrecisionState>
struct LambStage1Op : OpDefaults {
  static_assert(!Storage::remainder, "LAMB's trust ratio reads fp32 weights");
  static constexpr int kGrad = 0, kWeight = 1, kExpAvg = 2, kExpAvgSq = 3, kUpdate = 4;
  static constexpr int depth = 5;
  static constexpr unsigned read_mask = 0b01111;
  static constexpr unsigned write_mask = 0b11100;
  static constexpr bool stores_grad = true;
  bool store_grad = false;
  PEAK_HD float unscaled_grad(float g) const { return g / grad_scale.value; }
  // The step count, then the scales of quantized moments (NOTE: [8-bit moments]).
  static constexpr int tensor_scalars = 1 + Storage::q8_exp_avg + Storage::q8_exp_avg_sq;
  static constexpr bool indexed = Storage::rounds_moments;
  static constexpr bool q8_stochastic = Storage::q8_stochastic;
  using State = NoState;
  // T: the gradients'; W: the weights stepped (the masters, or the params without them).
  template <typename T, typename W>
  using Lists = ListTypes<T, W, typename Storage::ExpAvg, typename Storage::ExpAvgSq, float>;

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
  MomentRounding moment_rounding;  // bf16 moments only

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
    if constexpr (Storage::keys_moments) moment_rounding.load_step(*p[0]);
  }
  PEAK_HD bool skip() const { return found_inf.value != 0.0f; }

  PEAK_HD void operator()(float* v, State&, [[maybe_unused]] int64_t index = 0) const {
    float g = v[kGrad] / grad_divisor;
    const float w = v[kWeight];
    if (!adam_w && weight_decay != 0.0f) g = fmaf(weight_decay, w, g);
    const float m = fmaf(beta3, g, beta1_f * v[kExpAvg]);
    const float vsq = fmaf(one_minus_beta2, g * g, beta2_f * v[kExpAvgSq]);
    float update = (m / bias_correction1) / (sqrtf(vsq / bias_correction2) + eps);
    if (adam_w && weight_decay != 0.0f) update = fmaf(weight_decay, w, update);
    [[maybe_unused]] uint32_t random = 0;
    if constexpr (Storage::rounds_moments) random = moment_rounding.random(v[kGrad], index);
    v[kExpAvg] = Storage::round_exp_avg ? MomentRounding::low(m, random) : m;
    v[kExpAvgSq] = Storage::round_exp_avg_sq ? MomentRounding::high(vsq, random) : vsq;
    v[kUpdate] = update;
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
template <bool HasMaster>
struct AdagradOp : OpDefaults {
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kSum = kWeight + 1;
  static constexpr int depth = kSum + 1;
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask = all_lists(depth) & ~(1u << kGrad);
  static constexpr bool stores_grad = true;
  bool store_grad = false;
  PEAK_HD float unscaled_grad(float g) const { return g * s.inv_grad_scale; }
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
  }
};

// NovoGrad, as Apex's FusedNovoGrad: a per-tensor second moment of the gradient's norm (blended
// before the launch, on the device: see fused_novograd in ops/optimizer_ops_impl.h) and
// per-element first moments. reg_inside_moment (Apex's moment_mode 0): the gradient is
// normalised and decayed before the momentum; otherwise (mode 1, Apex's default) the update is.
template <bool HasMaster>
struct NovoGradOp : OpDefaults {
  static constexpr int kGrad = 0, kParam = 1;
  static constexpr int kWeight = HasMaster ? 2 : 1;
  static constexpr int kExpAvg = kWeight + 1;
  static constexpr int depth = kExpAvg + 1;
  static constexpr unsigned read_mask = all_lists(depth) & ~(HasMaster ? (1u << kParam) : 0u);
  static constexpr unsigned write_mask = all_lists(depth) & ~(1u << kGrad);
  static constexpr bool stores_grad = true;
  bool store_grad = false;
  PEAK_HD float unscaled_grad(float g) const { return g * s.inv_grad_scale; }
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
  }
};

}  // namespace peak
