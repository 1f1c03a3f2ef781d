// The bodies of the fused optimizer ops, written once over a backend (see multi_tensor_ops.h):
// validate, bump the step counts, pick the variant, launch, undo the step counts on overflow.
#pragma once

#include "optimizer_launch.h"

namespace peak {

template <typename Exec>
void fused_adam(Exec& exec, const OptimizerArgs& a, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, double beta1,
                double beta2, double eps, double weight_decay, bool amsgrad, bool adam_w_mode,
                bool maximize, bool bias_correction,
                const std::optional<int64_t>& stochastic_rounding_seed,
                const std::optional<int64_t>& moment_rounding_seed,
                at::TensorList exp_avg_scales = {}, at::TensorList exp_avg_sq_scales = {}) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  check_state_list(a, {"exp_avgs", exp_avgs}, /*bf16_ok=*/true);
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs}, /*bf16_ok=*/true);
  if (amsgrad) check_state_list(a, {"max_exp_avg_sqs", max_exp_avg_sqs});
  TORCH_CHECK(!amsgrad || (list_dtype(exp_avgs) == at::kFloat &&
                           list_dtype(exp_avg_sqs) == at::kFloat),
              a.name, ": amsgrad=True keeps its moments in float32; pass float32 exp_avgs and "
              "exp_avg_sqs (or amsgrad=False for bfloat16 or 8-bit moments)");
  const auto moment_scales =
      adam_moment_scales(a, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales);
  const std::vector<const float*>& s1 = moment_scales.first;
  const std::vector<const float*>& s2 = moment_scales.second;
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
    with_bool(amsgrad, [&](auto ams) {
     // Combinations the checks exclude are not instantiated: amsgrad keeps fp32 moments (a
     // remainder master is fine), a remainder needs master_params, 8-bit moments are both or
     // neither. Reaching one is a missed check, never a silent no-op step.
     constexpr bool kFp32Moments = std::is_same_v<typename Storage::ExpAvg, float> &&
                                   std::is_same_v<typename Storage::ExpAvgSq, float> &&
                                   !Storage::rounds_moments && !Storage::quantized;
     if constexpr ((!kFp32Moments && std::remove_cvref_t<decltype(ams)>::value) ||
                   (Storage::q8_exp_avg != Storage::q8_exp_avg_sq) ||
                   (Storage::remainder && !std::remove_cvref_t<decltype(has_master)>::value)) {
       TORCH_CHECK(false, a.name, ": an excluded combination of state storage and options");
     } else {
      AdamOp<std::remove_cvref_t<decltype(has_master)>::value,
             std::remove_cvref_t<decltype(ams)>::value,
             std::remove_cvref_t<decltype(rounded)>::value, Storage> op;
      op.store_grad = a.store_unscaled_grads;
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
      std::vector<std::vector<const float*>> scalars{float_ptrs(a.steps)};
      if constexpr (Storage::quantized) scalars.insert(scalars.end(), {s1, s2});
      launch_optimizer(exec, a.params[0].scalar_type(), lists, std::move(scalars), a.chunk_size,
                       op);
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
               const std::optional<int64_t>& moment_rounding_seed,
               at::TensorList momentum_scales = {}) {
  check_optimizer_args(a);
  const StochasticRounding rounding = stochastic_rounding_from(a, stochastic_rounding_seed);
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  TORCH_CHECK(momentum >= 0.0, a.name, ": momentum must be >= 0, got ", momentum);
  // (torch's SGD refuses dampening with nesterov in its constructor only, and steps a group that
  // sets it later with the same formula: so does this kernel)
  TORCH_CHECK(!nesterov || momentum > 0.0, a.name,
              ": nesterov momentum requires a momentum (torch's SGD steps a group without one as "
              "plain SGD: pass nesterov=False there)");
  TORCH_CHECK((momentum == 0.0) == momentum_buffers.empty(), a.name,
              ": momentum_buffers must have one fp32 buffer per param when momentum > 0, "
              "and be empty when momentum == 0");
  if (!momentum_buffers.empty()) {
    check_state_list(a, {"momentum_buffers", momentum_buffers}, /*bf16_ok=*/true);
  }
  const auto s1 = q8_scales(a, {"momentum_buffers", momentum_buffers},
                            {"momentum_scales", momentum_scales});
  if (a.params.empty()) return;
  bump_steps(a.steps);
  const auto lists = optimizer_lists(a, {momentum_buffers});
  with_weight_store(a, rounding, [&](auto has_master, auto rounded) {
   with_state_storage(list_dtype(a.masters), list_dtype(momentum_buffers), at::kFloat,
                      moment_rounding_seed.has_value(), [&](auto storage) {
    using Storage = decltype(storage);
    with_bool(momentum != 0.0, [&](auto has_momentum) {
     // SGD has no exp_avg_sq (kFloat above), and without momentum no buffer whose storage
     // could differ (an empty list's dtype is kFloat): those storages are not instantiated.
     constexpr bool kMomentum = std::remove_cvref_t<decltype(has_momentum)>::value;
     if constexpr (((Storage::round_exp_avg || Storage::quantized) && !kMomentum) ||
                   Storage::q8_exp_avg_sq ||
                   !std::is_same_v<typename Storage::ExpAvgSq, float> ||
                   (!kMomentum && !std::is_same_v<typename Storage::ExpAvg, float>) ||
                   (Storage::remainder && !std::remove_cvref_t<decltype(has_master)>::value)) {
       return;  // excluded by the checks: not instantiated
     } else {
      SgdOp<std::remove_cvref_t<decltype(has_master)>::value,
            std::remove_cvref_t<decltype(has_momentum)>::value,
            std::remove_cvref_t<decltype(rounded)>::value, Storage> op;
      op.store_grad = a.store_unscaled_grads;
      op.moment_rounding = moment_rounding;
      fill_optimizer_scalars(op.s, a);
      op.momentum = static_cast<float>(momentum);
      op.dampening = dampening;
      op.weight_decay = static_cast<float>(weight_decay);
      op.nesterov = nesterov;
      op.maximize = maximize;
      op.rounding = rounding;
      std::vector<std::vector<const float*>> scalars{float_ptrs(a.steps)};
      if constexpr (Storage::quantized) scalars.push_back(s1);
      launch_optimizer(exec, a.params[0].scalar_type(), lists, std::move(scalars), a.chunk_size,
                       op);
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
                const std::optional<int64_t>& moment_rounding_seed,
                at::TensorList exp_avg_scales = {}, at::TensorList exp_avg_sq_scales = {},
                const std::optional<at::TensorList>& given_updates = std::nullopt,
                const std::optional<at::Tensor>& given_weight_norms = std::nullopt,
                const std::optional<at::Tensor>& given_update_norms = std::nullopt) {
  check_optimizer_args(a);
  // NOTE: [LAMB in two calls] The trust ratio needs whole-tensor norms of the weights and of the
  // update. On shards (FSDP2) each rank holds part of each tensor, so the caller runs the two
  // stages apart: with `updates` alone the op runs stage 1 into them (moments, steps, the raw
  // update) and returns; with `updates` and both norm lists (reduced over the mesh) it runs
  // stage 2 only (weights -= lr * ratio * update).
  const bool stage1_only = given_updates && !given_weight_norms && !given_update_norms;
  const bool stage2_only = given_updates && given_weight_norms && given_update_norms;
  TORCH_CHECK(!given_updates || stage1_only || stage2_only, a.name,
              ": pass updates alone (stage 1) or updates with weight_norms and update_norms "
              "(stage 2); got only one of the two norm tensors");
  TORCH_CHECK(given_updates || (!given_weight_norms && !given_update_norms), a.name,
              ": weight_norms and update_norms are stage 2's inputs: pass the updates that "
              "stage 1 wrote with them");
  if (given_updates) {
    TORCH_CHECK(given_updates->size() == a.params.size(), a.name, ": updates has ",
                given_updates->size(), " tensors but params has ", a.params.size());
    for (size_t t = 0; t < a.params.size(); ++t) {
      const at::Tensor& u = (*given_updates)[t];
      TORCH_CHECK(u.scalar_type() == at::kFloat && u.device() == a.params[t].device() &&
                      u.sizes() == a.params[t].sizes() && u.is_contiguous(),
                  a.name, ": updates[", t, "] must be a contiguous float32 tensor shaped and "
                  "placed like params[", t, "]");
    }
  }
  TORCH_CHECK(!stage1_only || grad_norm || max_grad_norm == 0.0, a.name,
              ": stage 1 alone (updates without norms) is for shards, where clipping needs the "
              "norm of the whole gradients: pass grad_norm (reduced over the mesh) or "
              "max_grad_norm=0");
  if (stage2_only) {
    for (const at::Tensor* n : {&*given_weight_norms, &*given_update_norms}) {
      TORCH_CHECK(n->scalar_type() == at::kFloat && n->dim() == 1 &&
                      n->numel() == static_cast<int64_t>(a.params.size()) && n->is_contiguous() &&
                      (a.params.empty() || n->device() == a.params[0].device()),
                  a.name, ": weight_norms and update_norms must be contiguous float32 vectors "
                  "with one norm per param, on the params' device");
    }
  }
  TORCH_CHECK(a.masters.empty() || a.masters[0].scalar_type() == at::kFloat, a.name,
              ": LAMB's trust ratio needs the norm of the fp32 weights: pass float32 "
              "master_params (remainders are for fused_adam_ and fused_sgd_)");
  const MomentRounding moment_rounding = moment_rounding_from(a, moment_rounding_seed);
  check_state_list(a, {"exp_avgs", exp_avgs}, /*bf16_ok=*/true);
  check_state_list(a, {"exp_avg_sqs", exp_avg_sqs}, /*bf16_ok=*/true);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, a.name,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(max_grad_norm >= 0.0, a.name, ": max_grad_norm must be >= 0 (0: no clipping)");
  const auto moment_scales =
      adam_moment_scales(a, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales);
  const std::vector<const float*>& s1 = moment_scales.first;
  const std::vector<const float*>& s2 = moment_scales.second;
  if (a.params.empty()) return;
  const c10::Device device = a.params[0].device();
  if (grad_norm) check_scalar_tensor(a.name, "grad_norm", *grad_norm, at::kFloat, device);
  const at::TensorList weights = a.masters.empty() ? a.params : a.masters;
  std::vector<at::Tensor> updates;
  if (given_updates) updates.assign(given_updates->begin(), given_updates->end());
  if (!stage2_only) {  // Stage 1: moments and the raw update into fp32 scratch.
    bump_steps(a.steps);
    // Global norm of the (scaled) gradients, for clipping, unless the caller gave it.
    at::Tensor norm = grad_norm ? *grad_norm
                                : std::get<0>(multi_tensor_l2norm(exec, a.grads, false, a.chunk_size));
    if (!given_updates) {
      updates.reserve(a.params.size());
      for (const at::Tensor& p : a.params) {
        updates.push_back(at::empty_like(p, p.options().dtype(at::kFloat)));
      }
    }
    with_state_storage(at::kFloat, list_dtype(exp_avgs), list_dtype(exp_avg_sqs),
                       moment_rounding_seed.has_value(), [&](auto storage) {
     if constexpr (decltype(storage)::remainder ||
                   decltype(storage)::q8_exp_avg != decltype(storage)::q8_exp_avg_sq) {
       return;  // (not instantiated: LAMB keeps fp32 masters; 8-bit moments are both or neither)
     } else {
      using Op = LambStage1Op<decltype(storage)>;
      Op op;
      op.store_grad = a.store_unscaled_grads;
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
      std::vector<std::vector<const float*>> scalars{float_ptrs(a.steps)};
      if constexpr (decltype(storage)::quantized) scalars.insert(scalars.end(), {s1, s2});
      const auto host = host_lists_from<5, Op::tensor_scalars>(
          {a.grads, weights, exp_avgs, exp_avg_sqs, updates}, std::move(scalars));
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
     }
    });
    if (stage1_only) {
      undo_skipped_steps(a.steps, a.found_inf);
      return;
    }
  }
  // Per-tensor norms of the weights and of the update (the trust ratio's inputs).
  const at::Tensor weight_norms =
      stage2_only ? *given_weight_norms
                  : std::get<1>(multi_tensor_l2norm(exec, weights, true, a.chunk_size));
  const at::Tensor update_norms =
      stage2_only ? *given_update_norms
                  : std::get<1>(multi_tensor_l2norm(exec, updates, true, a.chunk_size));
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
  if (!stage2_only) undo_skipped_steps(a.steps, a.found_inf);
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
    AdagradOp<decltype(has_master)::value> op;
    op.store_grad = a.store_unscaled_grads;
    fill_optimizer_scalars(op.s, a);
    op.eps = static_cast<float>(eps);
    op.weight_decay = static_cast<float>(weight_decay);
    op.w_mode = adagrad_w_mode;
    op.lr_decay = lr_decay;
    launch_optimizer(exec, a.params[0].scalar_type(), lists, {float_ptrs(a.steps)}, a.chunk_size,
                     op);
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
                    bool bias_correction, int64_t norm_type, bool init_zero,
                    const std::optional<at::Tensor>& grad_norms = std::nullopt) {
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

  // This step's per-tensor gradient norms (accumulated in fp32), unscaled: a norm scales with
  // its tensor. ATen's foreach norm on every backend, so that the emulated grid and the CPU
  // see the same norms and the element pass is compared bit for bit. An empty gradient's norm
  // is 0 (ATen refuses the infinity norm of an empty tensor: it stands in as one zero).
  // On shards the caller reduces them over the mesh and passes them (grad_norms).
  const double ord = norm_type == 2 ? 2.0 : INFINITY;
  if (grad_norms) {
    TORCH_CHECK(grad_norms->scalar_type() == at::kFloat && grad_norms->dim() == 1 &&
                    grad_norms->numel() == static_cast<int64_t>(a.params.size()) &&
                    grad_norms->device() == device,
                a.name, ": grad_norms must be a float32 vector with one norm per param (",
                a.params.size(), ") on ", device, ", got ", grad_norms->scalar_type(), " of shape ",
                grad_norms->sizes(), " on ", grad_norms->device());
  }
  at::Tensor norms;
  if (grad_norms) {
    norms = *grad_norms;
  } else {
    std::vector<at::Tensor> normed(a.grads.begin(), a.grads.end());
    for (at::Tensor& g : normed) {
      if (g.numel() == 0) g = at::zeros({1}, g.options());
    }
    norms = at::stack(at::_foreach_norm(normed, ord, at::kFloat)).reshape({-1});
  }
  if (a.grad_scale) norms = norms / *a.grad_scale;
  bump_steps(a.steps);  // (after everything that can refuse the call)
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
    NovoGradOp<decltype(has_master)::value> op;
    op.store_grad = a.store_unscaled_grads;
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
                      bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed,
                      std::optional<at::TensorList> exp_avg_scales,
                      std::optional<at::TensorList> exp_avg_sq_scales) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_adam(exec,
             OptimizerArgs{"fused_adam_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, grad_norm, max_grad_norm,
                           store_unscaled_grads},
             exp_avgs, exp_avg_sqs, max_exp_avg_sqs, beta1, beta2, eps, weight_decay, amsgrad,
             adam_w_mode, maximize, bias_correction, stochastic_rounding_seed,
             moment_rounding_seed, exp_avg_scales.value_or(at::TensorList{}),
             exp_avg_sq_scales.value_or(at::TensorList{}));
}

template <typename Exec>
void fused_sgd_entry(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                     at::TensorList momentum_buffers, at::TensorList steps, const at::Tensor& lr,
                     double momentum, double dampening, double weight_decay, bool nesterov,
                     bool maximize, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, int64_t chunk_size,
                     std::optional<int64_t> stochastic_rounding_seed,
                     const std::optional<at::Tensor>& grad_norm, double max_grad_norm,
                     bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed,
                     std::optional<at::TensorList> momentum_scales) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_sgd(exec,
            OptimizerArgs{"fused_sgd_", params, grads, master_params, steps, lr, grad_scale,
                          found_inf, chunk_size, grad_norm, max_grad_norm,
                          store_unscaled_grads},
            momentum_buffers, momentum, dampening, weight_decay, nesterov, maximize,
            stochastic_rounding_seed, moment_rounding_seed,
            momentum_scales.value_or(at::TensorList{}));
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
                      bool store_unscaled_grads, std::optional<int64_t> moment_rounding_seed,
                      std::optional<at::TensorList> exp_avg_scales,
                      std::optional<at::TensorList> exp_avg_sq_scales,
                      std::optional<at::TensorList> updates,
                      const std::optional<at::Tensor>& weight_norms,
                      const std::optional<at::Tensor>& update_norms) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_lamb(exec,
             OptimizerArgs{"fused_lamb_", params, grads, master_params, steps, lr, grad_scale,
                           found_inf, chunk_size, std::nullopt, 0.0, store_unscaled_grads},
             exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, adam_w_mode, grad_averaging,
             bias_correction, max_grad_norm, use_nvlamb, grad_norm, moment_rounding_seed,
             exp_avg_scales.value_or(at::TensorList{}),
             exp_avg_sq_scales.value_or(at::TensorList{}), updates, weight_norms, update_norms);
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
                          bool store_unscaled_grads, const std::optional<at::Tensor>& grad_norms) {
  const typename Exec::Guard guard(lr.device());
  Exec exec;
  fused_novograd(exec,
                 OptimizerArgs{"fused_novograd_", params, grads, master_params, steps, lr,
                               grad_scale, found_inf, chunk_size, std::nullopt, 0.0,
                               store_unscaled_grads},
                 exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, grad_averaging,
                 reg_inside_moment, bias_correction, norm_type, init_zero, grad_norms);
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
