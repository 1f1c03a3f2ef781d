// The bodies of the fused optimizer ops, written once over a backend (see multi_tensor_ops.h):
// validate, bump the step counts, pick the variant, launch, undo the step counts on overflow.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "../core/optimizer_ops.h"
#include "dense_staging.h"
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
  if (!a.masters.empty()) {
    check_tensor_lists(a.name, {{"params", a.params}, {"master_params", a.masters}});
    TORCH_CHECK(a.masters[0].scalar_type() == at::kFloat, a.name,
                ": master_params must be float32, got ", a.masters[0].scalar_type());
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

// A per-parameter state list: one fp32 tensor per param, shaped like it.
inline void check_state_list(const OptimizerArgs& a, const NamedList& l) {
  if (a.params.empty() && l.second.empty()) return;
  check_tensor_lists(a.name, {{"params", a.params}, l});
  TORCH_CHECK(l.second[0].scalar_type() == at::kFloat, a.name, ": ", l.first,
              " must be float32 (optimizer state is kept in fp32), got ",
              l.second[0].scalar_type());
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

// Launches Op over `lists` with the grad and param lists in `dtype` and every other list fp32.
template <typename Op, typename Exec>
void launch_optimizer(Exec& exec, at::ScalarType dtype, const std::vector<at::TensorList>& lists,
                      std::vector<std::vector<const float*>> scalars, int64_t chunk_size,
                      const Op& op) {
  const auto host = host_lists_from<Op::depth, Op::tensor_scalars>(lists, std::move(scalars));
  const BlockSink sink{};
  with_storage_type(dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (Op::depth == 2) {
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
                const std::optional<int64_t>& stochastic_rounding_seed) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  check_state_list(a, {"exp_avgs", exp_avgs});
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs});
  if (amsgrad) check_state_list(a, {"max_exp_avg_sqs", max_exp_avg_sqs});
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
    with_bool(amsgrad, [&](auto ams) {
     with_bool(a.store_unscaled_grads, [&](auto store_grad) {
      AdamOp<decltype(has_master)::value, decltype(ams)::value, decltype(rounded)::value,
             decltype(store_grad)::value> op;
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
    });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

template <typename Exec>
void fused_sgd(Exec& exec, const OptimizerArgs& a, at::TensorList momentum_buffers,
               double momentum, double dampening, double weight_decay, bool nesterov,
               bool maximize, const std::optional<int64_t>& stochastic_rounding_seed) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  TORCH_CHECK(momentum >= 0.0, a.name, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), a.name,
              ": nesterov momentum requires a momentum and zero dampening");
  TORCH_CHECK((momentum == 0.0) == momentum_buffers.empty(), a.name,
              ": momentum_buffers must have one fp32 buffer per param when momentum > 0, "
              "and be empty when momentum == 0");
  if (!momentum_buffers.empty()) check_state_list(a, {"momentum_buffers", momentum_buffers});
  if (a.params.empty()) return;
  bump_steps(a.steps);
  const auto lists = optimizer_lists(a, {momentum_buffers});
  with_weight_store(a, rounding, [&](auto has_master, auto rounded) {
    with_bool(momentum != 0.0, [&](auto has_momentum) {
     with_bool(a.store_unscaled_grads, [&](auto store_grad) {
      SgdOp<decltype(has_master)::value, decltype(has_momentum)::value,
            decltype(rounded)::value, decltype(store_grad)::value> op;
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
    });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

template <typename Exec>
void fused_lamb(Exec& exec, const OptimizerArgs& a, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, double beta1, double beta2, double eps,
                double weight_decay, bool adam_w_mode, bool grad_averaging, bool bias_correction,
                double max_grad_norm, bool use_nvlamb, const std::optional<at::Tensor>& grad_norm) {
  check_optimizer_args(a);
  check_state_list(a, {"exp_avgs", exp_avgs});
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs});
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
  with_bool(a.store_unscaled_grads, [&](auto store_grad) {
    using Op = LambStage1Op<decltype(store_grad)::value>;
    Op op;
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
      if (a.masters.empty()) {
        exec.template apply<Op, T, T, float, float, float>(host, a.chunk_size, op, BlockSink{});
      } else {
        exec.template apply<Op, T, float, float, float, float>(host, a.chunk_size, op,
                                                              BlockSink{});
      }
    });
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
    using Op = LambStage2Op<decltype(has_master)::value>;
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

template <typename Exec>
void fused_adagrad(Exec& exec, const OptimizerArgs& a, at::TensorList state_sums, double eps,
                   double weight_decay, bool adagrad_w_mode, double lr_decay) {
  check_optimizer_args(a);
  check_state_list(a, {"state_sums", state_sums});
  TORCH_CHECK(eps >= 0.0, a.name, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, a.name, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(lr_decay >= 0.0, a.name, ": lr_decay must be >= 0, got ", lr_decay);
  if (a.params.empty()) return;
  bump_steps(a.steps);
  const auto lists = optimizer_lists(a, {state_sums});
  with_bool(!a.masters.empty(), [&](auto has_master) {
   with_bool(a.store_unscaled_grads, [&](auto store_grad) {
    AdagradOp<decltype(has_master)::value, decltype(store_grad)::value> op;
    fill_optimizer_scalars(op.s, a);
    op.eps = static_cast<float>(eps);
    op.weight_decay = static_cast<float>(weight_decay);
    op.w_mode = adagrad_w_mode;
    op.lr_decay = lr_decay;
    launch_optimizer(exec, a.params[0].scalar_type(), lists, {float_ptrs(a.steps)}, a.chunk_size,
                     op);
   });
  });
  undo_skipped_steps(a.steps, a.found_inf);
}

// NovoGrad's per-tensor second moment is one fp32 number per parameter (exp_avg_sqs: Apex keeps
// the norm itself, not its square, so that both norm types share the update). It is blended from
// the norms of this step's gradients here, with ATen ops on the device (no host sync), and handed
// to the element pass as a per-tensor scalar; it is stored back only when the step was not
// skipped.
template <typename Exec>
void fused_novograd(Exec& exec, const OptimizerArgs& a, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, double beta1, double beta2, double eps,
                    double weight_decay, bool grad_averaging, bool reg_inside_moment,
                    bool bias_correction, int64_t norm_type, bool init_zero) {
  check_optimizer_args(a);
  check_state_list(a, {"exp_avgs", exp_avgs});
  TORCH_CHECK(exp_avg_sqs.size() == a.params.size(), a.name, ": exp_avg_sqs has ",
              exp_avg_sqs.size(), " tensors but params has ", a.params.size(),
              " (one float32 norm per param)");
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, a.name,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(eps >= 0.0, a.name, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(norm_type == 2 || norm_type == 0, a.name,
              ": norm_type must be 2 (L2 norm) or 0 (infinity norm), got ", norm_type);
  if (a.params.empty()) return;
  const c10::Device device = a.params[0].device();
  for (size_t i = 0; i < exp_avg_sqs.size(); ++i) {
    check_scalar_tensor(a.name, "exp_avg_sqs[i]", exp_avg_sqs[i], at::kFloat, device);
  }
  bump_steps(a.steps);

  // This step's per-tensor gradient norms (accumulated in fp32), unscaled: a norm scales with
  // its tensor. ATen's foreach norm on every backend, so that the emulated grid and the CPU
  // see the same norms and the element pass is compared bit for bit.
  const double ord = norm_type == 2 ? 2.0 : INFINITY;
  at::Tensor norms = at::stack(at::_foreach_norm(a.grads, ord, at::kFloat)).reshape({-1});
  if (a.grad_scale) norms = norms / *a.grad_scale;
  std::vector<at::Tensor> old_list;
  old_list.reserve(exp_avg_sqs.size());
  for (const at::Tensor& t : exp_avg_sqs) old_list.push_back(t.reshape(c10::IntArrayRef{}));
  const at::Tensor old = at::stack(old_list);
  // L2: v = sqrt(beta2 v^2 + (1 - beta2) n^2); infinity norm: v = beta2 v + (1 - beta2) n.
  const auto b2 = static_cast<float>(beta2), one_minus_b2 = static_cast<float>(1.0 - beta2);
  at::Tensor blended = norm_type == 2 ? (old * old * b2 + norms * norms * one_minus_b2).sqrt()
                                      : old * b2 + norms * one_minus_b2;
  if (!init_zero) {
    // Apex starts the average at the first step's norm (so its first blend changes nothing).
    const at::Tensor first = at::stack(std::vector<at::Tensor>(a.steps.begin(), a.steps.end()))
                                 .reshape({-1}) == 1.0f;
    blended = at::where(first, norms, blended);
  }
  blended = blended.contiguous();
  std::vector<const float*> blended_ptrs(a.params.size());
  for (size_t t = 0; t < a.params.size(); ++t) blended_ptrs[t] = blended.data_ptr<float>() + t;

  const auto lists = optimizer_lists(a, {exp_avgs});
  with_bool(!a.masters.empty(), [&](auto has_master) {
   with_bool(a.store_unscaled_grads, [&](auto store_grad) {
    NovoGradOp<decltype(has_master)::value, decltype(store_grad)::value> op;
    fill_optimizer_scalars(op.s, a);
    op.beta1 = beta1;
    op.beta2 = beta2;
    op.eps = static_cast<float>(eps);
    op.weight_decay = static_cast<float>(weight_decay);
    op.grad_averaging = grad_averaging;
    op.reg_inside_moment = reg_inside_moment;
    op.bias_correction = bias_correction;
    launch_optimizer(exec, a.params[0].scalar_type(), lists,
                     {float_ptrs(a.steps), blended_ptrs}, a.chunk_size, op);
   });
  });
  // A skipped step keeps the old norms (and its inf/NaN never reaches the state).
  const at::Tensor kept =
      a.found_inf ? at::where(a.found_inf->reshape({}) != 0.0f, old, blended) : blended;
  at::_foreach_copy_(exp_avg_sqs, kept.unbind(0));  // (one element each: copy_ broadcasts)
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
                      bool store_unscaled_grads) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_adam(exec,
             OptimizerArgs{"fused_adam_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, grad_norm, max_grad_norm,
                           store_unscaled_grads},
             exp_avgs, exp_avg_sqs, max_exp_avg_sqs, beta1, beta2, eps, weight_decay, amsgrad,
             adam_w_mode, maximize, bias_correction, stochastic_rounding_seed);
}

template <typename Exec>
void fused_sgd_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                     at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     bool maximize, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                     std::optional<int64_t> stochastic_rounding_seed,
                     const std::optional<at::Tensor>& grad_norm, double max_grad_norm,
                     bool store_unscaled_grads) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_sgd(exec,
            OptimizerArgs{"fused_sgd_", params, grads, master_params, steps, lr, grad_scale,
                          found_inf, chunk_size, grad_norm, max_grad_norm,
                          store_unscaled_grads},
            momentum_buffers, momentum, dampening, weight_decay, nesterov, maximize,
            stochastic_rounding_seed);
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
                      bool store_unscaled_grads) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_lamb(exec,
             OptimizerArgs{"fused_lamb_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, std::nullopt, 0.0, store_unscaled_grads},
             exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, adam_w_mode, grad_averaging,
             bias_correction, max_grad_norm, use_nvlamb, grad_norm);
}

template <typename Exec>
void fused_adagrad_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                         at::TensorList state_sums, at::TensorList steps, const at::Tensor& lr,
                         double eps, double weight_decay, bool adagrad_w_mode, double lr_decay,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                         bool store_unscaled_grads) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_adagrad(exec,
                OptimizerArgs{"fused_adagrad_", params, grads, master_params, steps, lr,
                              grad_scale, found_inf, chunk_size, std::nullopt, 0.0,
                              store_unscaled_grads},
                state_sums, eps, weight_decay, adagrad_w_mode, lr_decay);
}

template <typename Exec>
void fused_novograd_entry(at::TensorList params, at::TensorList grads,
                          at::TensorList master_params, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList steps, const at::Tensor& lr,
                          double beta1, double beta2, double eps, double weight_decay,
                          bool grad_averaging, bool reg_inside_moment, bool bias_correction,
                          int64_t norm_type, bool init_zero,
                          const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                          bool store_unscaled_grads) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_novograd(exec,
                 OptimizerArgs{"fused_novograd_", params, grads, master_params, steps, lr,
                               grad_scale, found_inf, chunk_size, std::nullopt, 0.0,
                               store_unscaled_grads},
                 exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, grad_averaging,
                 reg_inside_moment, bias_correction, norm_type, init_zero);
}

template <typename Exec>
void check_finite_entry(at::TensorList tensors, const at::Tensor& found_inf, int64_t chunk_size,
                        const std::optional<at::Tensor>& per_tensor_found_inf) {
  const typename Exec::Guard guard(found_inf.device());
  Exec exec;
  if (walkable(tensors)) {
    multi_tensor_check_finite(exec, tensors, found_inf, chunk_size, per_tensor_found_inf);
    return;
  }
  const DenseStaging staged(tensors);  // read only: nothing to write back
  multi_tensor_check_finite(exec, staged.tensors, found_inf, chunk_size, per_tensor_found_inf);
}

}  // namespace peak
