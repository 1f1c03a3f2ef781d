// The bodies of the fused optimizer ops, written once over a backend (see multi_tensor_ops.h):
// validate, bump the step counts, pick the variant, launch, undo the step counts on overflow.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "../core/optimizer_ops.h"
#include "multi_tensor_ops.h"

namespace peak {

template <typename F>
void with_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

struct OptimizerArgs {
  const char* name;
  at::TensorList params, grads, masters, steps;
  const at::Tensor& lr;
  const std::optional<at::Tensor>& grad_scale;
  const std::optional<at::Tensor>& found_inf;
  int64_t chunk_size;
  std::optional<at::Tensor> grad_norm = std::nullopt;  // clipping (Adam, SGD)
  double max_grad_norm = 0.0;
  // NOTE: [Unscaled gradients after the step]: write grad / grad_scale back (with grad_scale).
  bool store_unscaled_grads = false;
};

// int16 master_params are remainders (NOTE: [Remainder masters] in core/host_device.h): the low
// halves of fp32 masters whose high halves are the bf16 params themselves, laid out alike.
inline void check_remainders(const OptimizerArgs& a) {
  TORCH_CHECK(a.params[0].scalar_type() == at::kBFloat16, a.name,
              ": int16 master_params (remainders) complete bfloat16 params into fp32 masters; "
              "the params are ", a.params[0].scalar_type(),
              ". For float16 params keep float32 master_params (an fp16 weight has no exact "
              "16-bit remainder)");
  check_tensor_lists(a.name, {{"params", a.params}});
  for (size_t i = 0; i < a.masters.size(); ++i) {
    const at::Tensor& r = a.masters[i];
    const at::Tensor& p = a.params[i];
    TORCH_CHECK(r.defined() && r.scalar_type() == at::kShort, a.name, ": master_params[", i,
                "] must be an int16 remainder like master_params[0]");
    TORCH_CHECK(r.device() == p.device(), a.name, ": master_params[", i, "] is on ", r.device(),
                " but params[", i, "] is on ", p.device());
    TORCH_CHECK(r.sizes() == p.sizes() && (r.numel() <= 1 || r.strides() == p.strides()),
                a.name, ": master_params[", i, "] (a remainder) has shape ", r.sizes(),
                " and strides ", r.strides(), " but params[", i, "] has ", p.sizes(), " and ",
                p.strides(), "; a remainder is laid out exactly as its param");
  }
}

// Checks shared by every optimizer.
inline void check_optimizer_args(const OptimizerArgs& a) {
  check_chunk_size(a.name, a.chunk_size);
  check_tensor_lists(a.name, {{"params", a.params}, {"grads", a.grads}});
  if (a.params.empty()) return;
  const c10::Device device = a.params[0].device();
  TORCH_CHECK(a.grads[0].scalar_type() == a.params[0].scalar_type(), a.name,
              ": grads have dtype ", a.grads[0].scalar_type(), " but params have ",
              a.params[0].scalar_type(), "; a gradient has its parameter's dtype");
  TORCH_CHECK(a.masters.empty() || a.masters.size() == a.params.size(), a.name,
              ": master_params must be empty (no master weights) or have one entry per param");
  if (!a.masters.empty() && a.masters[0].scalar_type() == at::kShort) {
    check_remainders(a);
  } else if (!a.masters.empty()) {
    check_tensor_lists(a.name, {{"params", a.params}, {"master_params", a.masters}});
    TORCH_CHECK(a.masters[0].scalar_type() == at::kFloat, a.name,
                ": master_params must be float32 (or int16 remainders of bfloat16 params), got ",
                a.masters[0].scalar_type());
  }
  TORCH_CHECK(a.steps.size() == a.params.size(), a.name, ": steps has ", a.steps.size(),
              " tensors but params has ", a.params.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    check_scalar_tensor(a.name, "steps[i]", a.steps[i], at::kFloat, device);
  }
  check_scalar_tensor(a.name, "lr", a.lr, at::kFloat, device);
  if (a.grad_scale) check_scalar_tensor(a.name, "grad_scale", *a.grad_scale, at::kFloat, device);
  if (a.found_inf) check_scalar_tensor(a.name, "found_inf", *a.found_inf, at::kFloat, device);
  if (a.grad_norm) check_scalar_tensor(a.name, "grad_norm", *a.grad_norm, at::kFloat, device);
  TORCH_CHECK(a.max_grad_norm >= 0.0, a.name, ": max_grad_norm must be >= 0 (0: no clipping), got ",
              a.max_grad_norm);
  TORCH_CHECK(a.max_grad_norm == 0.0 || a.grad_norm, a.name,
              ": max_grad_norm > 0 needs grad_norm, the global norm of the gradients (as they are "
              "passed, still scaled) as a one-element float32 tensor");
}

// A per-parameter state list: one tensor per param, shaped like it, fp32 (or bf16 where the
// functor supports lean storage: NOTE: [Lean optimizer state] in core/optimizer_ops.h).
inline void check_state_list(const OptimizerArgs& a, const NamedList& l, bool bf16_ok = false) {
  if (a.params.empty() && l.second.empty()) return;
  check_tensor_lists(a.name, {{"params", a.params}, l});
  const at::ScalarType t = l.second[0].scalar_type();
  TORCH_CHECK(t == at::kFloat || (bf16_ok && t == at::kBFloat16), a.name, ": ", l.first,
              bf16_ok ? " must be float32 or bfloat16, got " : " must be float32, got ", t);
}

// The storage of a variant's master and moment lists as a StateStorage type (fp32 masters or
// int16 remainders; fp32 or bf16 moments), handed to f as a value of that type.
// `stochastic`: bf16 moments are rounded stochastically (moment_rounding_seed given).
template <typename F>
void with_state_storage(at::ScalarType master, at::ScalarType exp_avg, at::ScalarType exp_avg_sq,
                        bool stochastic, F&& f) {
  auto moments = [&](auto master_t) {
    using M = std::remove_cvref_t<decltype(master_t)>;
    using B = c10::BFloat16;
    const bool bf1 = exp_avg == at::kBFloat16, bf2 = exp_avg_sq == at::kBFloat16;
    with_bool(stochastic && (bf1 || bf2), [&](auto sr) {
      constexpr bool S = std::remove_cvref_t<decltype(sr)>::value;
      if (bf1 && bf2) {
        f(StateStorage<M, B, B, S>{});
      } else if (bf1) {
        f(StateStorage<M, B, float, S>{});
      } else if (bf2) {
        f(StateStorage<M, float, B, S>{});
      } else if constexpr (!S) {
        f(StateStorage<M, float, float>{});
      }
    });
  };
  if (master == at::kShort) {
    moments(Remainder16{});
  } else {
    moments(float{});
  }
}

inline at::ScalarType list_dtype(at::TensorList l, at::ScalarType if_empty = at::kFloat) {
  return l.empty() ? if_empty : l[0].scalar_type();
}

// The moment rounding option: a seed (stochastic rounding of bf16 moments) or none (nearest).
inline MomentRounding moment_rounding_from(const OptimizerArgs& a,
                                           const std::optional<int64_t>& seed) {
  MomentRounding r;
  if (!seed) return r;
  TORCH_CHECK(*seed >= 0 && *seed <= 0xFFFFFFFFLL, a.name,
              ": moment_rounding_seed must be in [0, 2**32), got ", *seed);
  r.set_seed(static_cast<uint32_t>(*seed));
  return r;
}

// The stochastic-rounding option, checked: bf16 weights stepped without master copies only.
inline StochasticRounding stochastic_rounding_from(const OptimizerArgs& a,
                                                   const std::optional<int64_t>& seed) {
  StochasticRounding r;
  if (!seed) return r;
  TORCH_CHECK(*seed >= 0 && *seed <= 0xFFFFFFFFLL, a.name,
              ": stochastic_rounding_seed must be in [0, 2**32), got ", *seed);
  TORCH_CHECK(a.masters.empty(), a.name,
              ": stochastic rounding applies to bf16 weights stepped without master weights; "
              "with master_params the model copy is rounded to nearest from the fp32 master");
  TORCH_CHECK(a.params.empty() || a.params[0].scalar_type() == at::kBFloat16, a.name,
              ": stochastic rounding is for bfloat16 params, got ", a.params[0].scalar_type());
  r.on = true;
  r.seed = static_cast<uint32_t>(*seed);
  return r;
}

inline void fill_optimizer_scalars(OptimizerScalars& s, const OptimizerArgs& a) {
  s.lr.ptr = a.lr.data_ptr<float>();
  s.grad_scale.value = 1.0f;
  s.grad_scale.ptr = a.grad_scale ? a.grad_scale->data_ptr<float>() : nullptr;
  s.found_inf.value = 0.0f;
  s.found_inf.ptr = a.found_inf ? a.found_inf->data_ptr<float>() : nullptr;
  s.grad_norm.ptr = a.grad_norm && a.max_grad_norm > 0.0 ? a.grad_norm->data_ptr<float>() : nullptr;
  s.max_grad_norm = static_cast<float>(a.max_grad_norm);
}

// Steps count up before the kernel (it reads the new count for bias correction) and back down
// by found_inf after it, on the device: a skipped step leaves them as they were, with no sync.
// Every argument is validated before the first count moves.
inline void bump_steps(at::TensorList steps) { at::_foreach_add_(steps, 1); }

inline void undo_skipped_steps(at::TensorList steps, const std::optional<at::Tensor>& found_inf) {
  if (found_inf) at::_foreach_add_(steps, found_inf->reshape({}), -1);
}

inline std::vector<const float*> float_ptrs(at::TensorList list) {
  std::vector<const float*> p(list.size());
  for (size_t i = 0; i < list.size(); ++i) p[i] = list[i].data_ptr<float>();
  return p;
}

// The lists of a variant in order [grad, param, (master), rest...].
inline std::vector<at::TensorList> optimizer_lists(const OptimizerArgs& a,
                                                   std::initializer_list<at::TensorList> rest) {
  std::vector<at::TensorList> lists{a.grads, a.params};
  if (!a.masters.empty()) lists.push_back(a.masters);
  for (const at::TensorList& l : rest) {
    if (!l.empty()) lists.push_back(l);
  }
  return lists;
}

template <int Depth, int NScalars>
HostTensorLists<Depth, NScalars> host_lists_from(const std::vector<at::TensorList>& lists,
                                                 std::vector<std::vector<const float*>> scalars) {
  TORCH_CHECK(static_cast<int>(lists.size()) == Depth, "peak: internal list count mismatch");
  HostTensorLists<Depth, NScalars> out;
  const size_t n = lists[0].size();
  out.ptrs.resize(n);
  out.numels.resize(n);
  out.scalars.resize(n);
  for (size_t t = 0; t < n; ++t) {
    for (int d = 0; d < Depth; ++d) out.ptrs[t][d] = lists[d][t].data_ptr();
    out.numels[t] = lists[0][t].numel();
    for (int k = 0; k < NScalars; ++k) out.scalars[t][k] = scalars[k][t];
  }
  return out;
}

template <typename Op, typename Exec, typename... T>
void apply_list_types(Exec& exec, const std::tuple<T...>*,
                      const HostTensorLists<sizeof...(T), Op::tensor_scalars>& host,
                      int64_t chunk_size, const Op& op, const BlockSink& sink) {
  exec.template apply<Op, T...>(host, chunk_size, op, sink);
}

// Launches Op over `lists` with the grad and param lists in `dtype` and the others as the op's
// `Lists` says (NOTE: [Lean optimizer state]), or fp32 for an op without one.
template <typename Op, typename Exec>
void launch_optimizer(Exec& exec, at::ScalarType dtype, const std::vector<at::TensorList>& lists,
                      std::vector<std::vector<const float*>> scalars, int64_t chunk_size,
                      const Op& op) {
  const auto host = host_lists_from<Op::depth, Op::tensor_scalars>(lists, std::move(scalars));
  const BlockSink sink{};
  with_storage_type(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (requires { typename Op::template Lists<T>; }) {
      // Remainders complete bf16 weights only (checked): no other instantiation.
      if constexpr (Op::remainder_master && !std::is_same_v<T, c10::BFloat16>) {
        TORCH_CHECK(false, "peak: remainders need bfloat16 params");
      } else {
        using Types = typename Op::template Lists<T>;
        apply_list_types<Op>(exec, static_cast<const Types*>(nullptr), host, chunk_size, op,
                             sink);
      }
    } else if constexpr (Op::depth == 2) {
      exec.template apply<Op, T, T>(host, chunk_size, op, sink);
    } else if constexpr (Op::depth == 3) {
      exec.template apply<Op, T, T, float>(host, chunk_size, op, sink);
    } else if constexpr (Op::depth == 4) {
      exec.template apply<Op, T, T, float, float>(host, chunk_size, op, sink);
    } else if constexpr (Op::depth == 5) {
      exec.template apply<Op, T, T, float, float, float>(host, chunk_size, op, sink);
    } else if constexpr (Op::depth == 6) {
      exec.template apply<Op, T, T, float, float, float, float>(host, chunk_size, op, sink);
    } else {
      static_assert(Op::depth >= 2 && Op::depth <= 6, "unsupported optimizer depth");
    }
  });
}

// How the step stores the model weight, as template constants: through fp32 masters, directly,
// or directly with stochastic rounding (never with masters: stochastic_rounding_from checks).
template <typename F>
void with_weight_store(const OptimizerArgs& a, const StochasticRounding& rounding, F&& f) {
  if (!a.masters.empty()) {
    f(std::true_type{}, std::false_type{});
  } else if (rounding.on) {
    f(std::false_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

template <typename Exec>
void fused_adam(Exec& exec, const OptimizerArgs& a, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, double beta1,
                double beta2, double eps, double weight_decay, bool amsgrad, bool adam_w_mode,
                bool maximize, bool bias_correction,
                const std::optional<int64_t>& stochastic_rounding_seed,
                const std::optional<int64_t>& moment_rounding_seed) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  check_state_list(a, {"exp_avgs", exp_avgs}, /*bf16_ok=*/true);
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs}, /*bf16_ok=*/true);
  if (amsgrad) check_state_list(a, {"max_exp_avg_sqs", max_exp_avg_sqs});
  TORCH_CHECK(!amsgrad || (list_dtype(exp_avgs) == at::kFloat &&
                           list_dtype(exp_avg_sqs) == at::kFloat),
              a.name, ": amsgrad=True keeps its moments in float32; pass float32 exp_avgs and "
              "exp_avg_sqs (or amsgrad=False for bfloat16 moments)");
  TORCH_CHECK(amsgrad || max_exp_avg_sqs.empty(), a.name,
              ": max_exp_avg_sqs must be empty unless amsgrad=True");
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, a.name,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(eps >= 0.0, a.name, ": eps must be >= 0, got ", eps);
  if (a.params.empty()) return;
  bump_steps(a.steps);
  const auto lists =
      optimizer_lists(a, {exp_avgs, exp_avg_sqs, amsgrad ? max_exp_avg_sqs : at::TensorList{}});
  with_weight_store(a, rounding, [&](auto has_master, auto rounded) {
   with_state_storage(list_dtype(a.masters), list_dtype(exp_avgs), list_dtype(exp_avg_sqs),
                      moment_rounding_seed.has_value(), [&](auto storage) {
    using Storage = decltype(storage);
    constexpr bool kLean = Storage::remainder || Storage::rounds_moments;
    with_bool(amsgrad, [&](auto ams) {
     // Combinations the checks exclude are not instantiated: amsgrad keeps fp32 state, and a
     // remainder needs master_params.
     if constexpr ((kLean && std::remove_cvref_t<decltype(ams)>::value) ||
                   (Storage::remainder && !std::remove_cvref_t<decltype(has_master)>::value)) {
       return;
     } else {
     with_bool(a.store_unscaled_grads, [&](auto store_grad) {
      AdamOp<std::remove_cvref_t<decltype(has_master)>::value, std::remove_cvref_t<decltype(ams)>::value, std::remove_cvref_t<decltype(rounded)>::value,
             std::remove_cvref_t<decltype(store_grad)>::value, Storage> op;
      op.moment_rounding = moment_rounding;
      fill_optimizer_scalars(op.s, a);
      op.beta1 = beta1;
      op.beta2 = beta2;
      op.eps = static_cast<float>(eps);
      op.weight_decay = weight_decay;
      op.adam_w = adam_w_mode;
      op.maximize = maximize;
      op.bias_correction = bias_correction;
      op.rounding = rounding;
      launch_optimizer(exec, a.params[0].scalar_type(), lists, {float_ptrs(a.steps)},
                       a.chunk_size, op);
     });
     }
    });
   });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

template <typename Exec>
void fused_sgd(Exec& exec, const OptimizerArgs& a, at::TensorList momentum_buffers,
               double momentum, double dampening, double weight_decay, bool nesterov,
               bool maximize, const std::optional<int64_t>& stochastic_rounding_seed,
               const std::optional<int64_t>& moment_rounding_seed) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  TORCH_CHECK(momentum >= 0.0, a.name, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), a.name,
              ": nesterov momentum requires a momentum and zero dampening");
  TORCH_CHECK((momentum == 0.0) == momentum_buffers.empty(), a.name,
              ": momentum_buffers must have one fp32 buffer per param when momentum > 0, "
              "and be empty when momentum == 0");
  if (!momentum_buffers.empty()) {
    check_state_list(a, {"momentum_buffers", momentum_buffers}, /*bf16_ok=*/true);
  }
  if (a.params.empty()) return;
  bump_steps(a.steps);
  const auto lists = optimizer_lists(a, {momentum_buffers});
  with_weight_store(a, rounding, [&](auto has_master, auto rounded) {
   with_state_storage(list_dtype(a.masters), list_dtype(momentum_buffers), at::kFloat,
                      moment_rounding_seed.has_value(), [&](auto storage) {
    using Storage = decltype(storage);
    with_bool(momentum != 0.0, [&](auto has_momentum) {
     if constexpr ((Storage::round_exp_avg && !std::remove_cvref_t<decltype(has_momentum)>::value) ||
                   (Storage::remainder && !std::remove_cvref_t<decltype(has_master)>::value)) {
       return;  // excluded by the checks: not instantiated
     } else {
     with_bool(a.store_unscaled_grads, [&](auto store_grad) {
      SgdOp<std::remove_cvref_t<decltype(has_master)>::value, std::remove_cvref_t<decltype(has_momentum)>::value,
            std::remove_cvref_t<decltype(rounded)>::value, std::remove_cvref_t<decltype(store_grad)>::value, Storage> op;
      op.moment_rounding = moment_rounding;
      fill_optimizer_scalars(op.s, a);
      op.momentum = static_cast<float>(momentum);
      op.dampening = dampening;
      op.weight_decay = static_cast<float>(weight_decay);
      op.nesterov = nesterov;
      op.maximize = maximize;
      op.rounding = rounding;
      launch_optimizer(exec, a.params[0].scalar_type(), lists, {float_ptrs(a.steps)},
                       a.chunk_size, op);
     });
     }
    });
   });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

template <typename Exec>
void fused_lamb(Exec& exec, const OptimizerArgs& a, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, double beta1, double beta2, double eps,
                double weight_decay, bool adam_w_mode, bool grad_averaging, bool bias_correction,
                double max_grad_norm, bool use_nvlamb, const std::optional<at::Tensor>& grad_norm,
                const std::optional<int64_t>& moment_rounding_seed) {
  check_optimizer_args(a);
  TORCH_CHECK(a.masters.empty() || a.masters[0].scalar_type() == at::kFloat, a.name,
              ": LAMB's trust ratio needs the norm of the fp32 weights: pass float32 "
              "master_params (remainders are for fused_adam_ and fused_sgd_)");
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  check_state_list(a, {"exp_avgs", exp_avgs}, /*bf16_ok=*/true);
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs}, /*bf16_ok=*/true);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, a.name,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(max_grad_norm >= 0.0, a.name, ": max_grad_norm must be >= 0 (0: no clipping)");
  if (a.params.empty()) return;
  const c10::Device device = a.params[0].device();
  if (grad_norm) check_scalar_tensor(a.name, "grad_norm", *grad_norm, at::kFloat, device);
  bump_steps(a.steps);
  const at::TensorList weights = a.masters.empty() ? a.params : a.masters;

  // Global norm of the (scaled) gradients, for clipping, unless the caller gave it.
  at::Tensor norm = grad_norm ? *grad_norm : std::get<0>(multi_tensor_l2norm(exec, a.grads, false,
                                                                              a.chunk_size));
  // Stage 1: moments and the raw update into fp32 scratch.
  std::vector<at::Tensor> updates;
  updates.reserve(a.params.size());
  for (const at::Tensor& p : a.params) updates.push_back(at::empty_like(p, p.options().dtype(at::kFloat)));
  with_state_storage(at::kFloat, list_dtype(exp_avgs), list_dtype(exp_avg_sqs),
                     moment_rounding_seed.has_value(), [&](auto storage) {
   if constexpr (decltype(storage)::remainder) {
     return;  // (not instantiated: LAMB keeps fp32 masters, checked above)
   } else {
   with_bool(a.store_unscaled_grads, [&](auto store_grad) {
    using Op = LambStage1Op<std::remove_cvref_t<decltype(store_grad)>::value, decltype(storage)>;
    Op op;
    op.moment_rounding = moment_rounding;
    op.grad_scale.value = 1.0f;
    op.grad_scale.ptr = a.grad_scale ? a.grad_scale->data_ptr<float>() : nullptr;
    op.found_inf.ptr = a.found_inf ? a.found_inf->data_ptr<float>() : nullptr;
    op.grad_norm.ptr = norm.data_ptr<float>();
    op.max_grad_norm = static_cast<float>(max_grad_norm);
    op.beta1 = beta1;
    op.beta2 = beta2;
    op.eps = static_cast<float>(eps);
    op.weight_decay = static_cast<float>(weight_decay);
    op.adam_w = adam_w_mode;
    op.grad_averaging = grad_averaging;
    op.bias_correction = bias_correction;
    const auto host = host_lists_from<5, 1>({a.grads, weights, exp_avgs, exp_avg_sqs, updates},
                                            {float_ptrs(a.steps)});
    with_storage_type(a.params[0].scalar_type(), [&](auto t) {
      using T = decltype(t);
      using WithoutMasters = typename Op::template Lists<T, T>;
      using WithMasters = typename Op::template Lists<T, float>;
      if (a.masters.empty()) {
        apply_list_types<Op>(exec, static_cast<const WithoutMasters*>(nullptr), host,
                             a.chunk_size, op, BlockSink{});
      } else {
        apply_list_types<Op>(exec, static_cast<const WithMasters*>(nullptr), host, a.chunk_size,
                             op, BlockSink{});
      }
    });
   });
   }
  });
  // Per-tensor norms of the weights and of the update (the trust ratio's inputs).
  const at::Tensor weight_norms = std::get<1>(multi_tensor_l2norm(exec, weights, true, a.chunk_size));
  const at::Tensor update_norms = std::get<1>(multi_tensor_l2norm(exec, updates, true, a.chunk_size));
  // Stage 2: weights -= ratio * update.
  std::vector<const float*> wn(a.params.size()), un(a.params.size());
  for (size_t t = 0; t < a.params.size(); ++t) {
    wn[t] = weight_norms.data_ptr<float>() + t;
    un[t] = update_norms.data_ptr<float>() + t;
  }
  std::vector<at::TensorList> lists{updates, a.params};
  if (!a.masters.empty()) lists.push_back(a.masters);
  with_bool(!a.masters.empty(), [&](auto has_master) {
    using Op = LambStage2Op<std::remove_cvref_t<decltype(has_master)>::value>;
    Op op;
    op.lr.ptr = a.lr.data_ptr<float>();
    op.found_inf.ptr = a.found_inf ? a.found_inf->data_ptr<float>() : nullptr;
    op.use_trust_ratio = use_nvlamb || weight_decay != 0.0;
    const auto host = host_lists_from<Op::depth, 2>(lists, {wn, un});
    with_storage_type(a.params[0].scalar_type(), [&](auto t) {
      using T = decltype(t);
      if constexpr (Op::depth == 2) {
        exec.template apply<Op, float, T>(host, a.chunk_size, op, BlockSink{});
      } else {
        exec.template apply<Op, float, T, float>(host, a.chunk_size, op, BlockSink{});
      }
    });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

}  // namespace peak

namespace peak {

// Dispatcher entry points, one per op, instantiated per backend (Exec::Guard picks the device).
template <typename Exec>
void fused_adam_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList steps, const at::Tensor& lr,
                      double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
                      bool adam_w_mode, bool maximize, bool bias_correction,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                      std::optional<int64_t> stochastic_rounding_seed,
                      const std::optional<at::Tensor>& grad_norm, double max_grad_norm,
                      bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_adam(exec,
             OptimizerArgs{"fused_adam_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, grad_norm, max_grad_norm,
                           store_unscaled_grads},
             exp_avgs, exp_avg_sqs, max_exp_avg_sqs, beta1, beta2, eps, weight_decay, amsgrad,
             adam_w_mode, maximize, bias_correction, stochastic_rounding_seed,
             moment_rounding_seed);
}

template <typename Exec>
void fused_sgd_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                     at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     bool maximize, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                     std::optional<int64_t> stochastic_rounding_seed,
                     const std::optional<at::Tensor>& grad_norm, double max_grad_norm,
                     bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_sgd(exec,
            OptimizerArgs{"fused_sgd_", params, grads, master_params, steps, lr, grad_scale,
                          found_inf, chunk_size, grad_norm, max_grad_norm,
                          store_unscaled_grads},
            momentum_buffers, momentum, dampening, weight_decay, nesterov, maximize,
            stochastic_rounding_seed, moment_rounding_seed);
}

template <typename Exec>
void fused_lamb_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList steps,
                      const at::Tensor& lr, double beta1, double beta2, double eps,
                      double weight_decay, bool adam_w_mode, bool grad_averaging,
                      bool bias_correction, double max_grad_norm, bool use_nvlamb,
                      const std::optional<at::Tensor>& grad_norm,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                      bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_lamb(exec,
             OptimizerArgs{"fused_lamb_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, std::nullopt, 0.0, store_unscaled_grads},
             exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, adam_w_mode, grad_averaging,
             bias_correction, max_grad_norm, use_nvlamb, grad_norm, moment_rounding_seed);
}

template <typename Exec>
void check_finite_entry(at::TensorList tensors, const at::Tensor& found_inf, int64_t chunk_size,
                        const std::optional<at::Tensor>& per_tensor_found_inf) {
  const typename Exec::Guard guard(found_inf.device());
  Exec exec;
  multi_tensor_check_finite(exec, tensors, found_inf, chunk_size, per_tensor_found_inf);
}

}  // namespace peak
