// What every fused optimizer op shares: its arguments (OptimizerArgs) and their checks, the
// step-count bump and undo, and the launch over the storage its lists ask for (fp32 or lean
// masters and moments: NOTE: [Lean optimizer state] in core/optimizer_ops.h).
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

}  // namespace peak
