// What every fused optimizer op shares: its arguments (OptimizerArgs) and their checks, the
// step-count bump and undo, and the launch over the storage its lists ask for (fp32 or lean
// masters and moments: NOTE: [Lean optimizer state] in core/optimizer_ops.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <type_traits>
#include <utility>
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

// 8-bit block-quantized moments (NOTE: [8-bit moments] in core/block_quant.h): uint8 codes laid
// out exactly as their params, and one float32 scale per block of 256 elements of each tensor.
inline bool is_q8_list(at::TensorList l) { return !l.empty() && l[0].scalar_type() == at::kByte; }

inline void check_q8_list(const OptimizerArgs& a, const NamedList& codes, const NamedList& scales) {
  TORCH_CHECK(a.chunk_size % kQBlock == 0, a.name, ": chunk_size must be a multiple of ", kQBlock,
              " with 8-bit (uint8) ", codes.first, " (a block of ", kQBlock,
              " elements shares one scale and must lie inside one chunk); got ", a.chunk_size);
  TORCH_CHECK(codes.second.size() == a.params.size() && scales.second.size() == a.params.size(),
              a.name, ": uint8 ", codes.first, " (8-bit codes) need one ", scales.first,
              " tensor per param; got ", codes.second.size(), " codes, ", scales.second.size(),
              " scale tensors and ", a.params.size(), " params");
  for (size_t i = 0; i < a.params.size(); ++i) {
    const at::Tensor& c = codes.second[i];
    const at::Tensor& p = a.params[i];
    const at::Tensor& sc = scales.second[i];
    TORCH_CHECK(c.defined() && c.scalar_type() == at::kByte, a.name, ": ", codes.first, "[", i,
                "] must be uint8 like ", codes.first, "[0]");
    TORCH_CHECK(c.device() == p.device() && sc.device() == p.device(), a.name, ": ", codes.first,
                "[", i, "] and ", scales.first, "[", i, "] must be on params[", i, "]'s device ",
                p.device());
    TORCH_CHECK(c.sizes() == p.sizes() && (c.numel() <= 1 || c.strides() == p.strides()), a.name,
                ": ", codes.first, "[", i, "] has shape ", c.sizes(), " and strides ", c.strides(),
                " but params[", i, "] has ", p.sizes(), " and ", p.strides(),
                "; 8-bit codes are laid out exactly as their param");
    const int64_t blocks = (p.numel() + kQBlock - 1) / kQBlock;
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.numel() == blocks,
                a.name, ": ", scales.first, "[", i, "] must be a contiguous float32 tensor of ",
                blocks, " elements (one scale per ", kQBlock, " elements of params[", i,
                "]); got ", sc.scalar_type(), " with ", sc.numel(), " elements");
  }
}

// A per-parameter state list: one tensor per param, shaped like it, fp32 (or bf16 where the
// functor supports lean storage: NOTE: [Lean optimizer state] in core/optimizer_ops.h).
inline void check_state_list(const OptimizerArgs& a, const NamedList& l, bool bf16_ok = false) {
  if (a.params.empty() && l.second.empty()) return;
  if (bf16_ok && is_q8_list(l.second)) return;  // 8-bit codes: check_q8_list
  check_tensor_lists(a.name, {{"params", a.params}, l});
  const at::ScalarType t = l.second[0].scalar_type();
  TORCH_CHECK(t == at::kFloat || (bf16_ok && t == at::kBFloat16), a.name, ": ", l.first,
              bf16_ok ? " must be float32, bfloat16 or uint8 (8-bit codes), got "
                      : " must be float32, got ", t);
}

// Checks the scale lists of a moment list (empty unless its codes are 8-bit) and returns their
// data pointers as per-tensor scalars (the launchers read and write them).
inline std::vector<const float*> q8_scales(const OptimizerArgs& a, const NamedList& codes,
                                           const NamedList& scales) {
  if (!is_q8_list(codes.second)) {
    TORCH_CHECK(scales.second.empty(), a.name, ": ", scales.first, " must be empty unless ",
                codes.first, " are uint8 8-bit codes");
    return {};
  }
  check_q8_list(a, codes, scales);
  std::vector<const float*> p(scales.second.size());
  for (size_t i = 0; i < p.size(); ++i) p[i] = scales.second[i].data_ptr<float>();
  return p;
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
    const bool q2 = exp_avg_sq == at::kByte;
    with_bool(stochastic && (bf1 || bf2 || q2), [&](auto sr) {
      constexpr bool S = std::remove_cvref_t<decltype(sr)>::value;
      // 8-bit moments: both (Adam, LAMB; S: exp_avg_sq rounded stochastically) or the first
      // alone (SGD's momentum, rounded to nearest).
      if (exp_avg == at::kByte && q2) {
        return f(StateStorage<M, Q8ExpAvg, Q8ExpAvgSq, S>{});
      } else if constexpr (!S) {
        if (exp_avg == at::kByte && exp_avg_sq == at::kFloat) {
          return f(StateStorage<M, Q8ExpAvg, float>{});
        }
      }
      TORCH_CHECK(exp_avg != at::kByte && exp_avg_sq != at::kByte,
                  "peak: 8-bit exp_avgs need 8-bit or float32 exp_avg_sqs, and 8-bit "
                  "exp_avg_sqs need 8-bit exp_avgs");
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

// Adam's and LAMB's two moment lists: both 8-bit or neither, and their scale lists checked.
inline std::pair<std::vector<const float*>, std::vector<const float*>> adam_moment_scales(
    const OptimizerArgs& a, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales) {
  TORCH_CHECK(is_q8_list(exp_avgs) == is_q8_list(exp_avg_sqs), a.name,
              ": 8-bit moments are both or neither: exp_avgs are ", list_dtype(exp_avgs),
              " and exp_avg_sqs are ", list_dtype(exp_avg_sqs), "; pass uint8 codes for both");
  return {q8_scales(a, {"exp_avgs", exp_avgs}, {"exp_avg_scales", exp_avg_scales}),
          q8_scales(a, {"exp_avg_sqs", exp_avg_sqs}, {"exp_avg_sq_scales", exp_avg_sq_scales})};
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
// after it when the step was skipped, on the device: a skipped step leaves them as they were,
// with no sync. Every argument is validated before the first count moves.
inline void bump_steps(at::TensorList steps) { at::_foreach_add_(steps, 1); }

// NOTE: [Any nonzero found_inf skips] The kernels skip on found_inf != 0, so the count goes back
// by exactly that predicate, never by the flag's value: torch's GradScaler hands a model on two
// devices the sum of their flags (2), a SUM all-reduce over ranks gives up to world size, and a
// flag computed from a NaN norm is NaN. Undoing by the value sent counts below zero (Adam's bias
// correction then divides by zero) or to NaN.
inline void undo_skipped_steps(at::TensorList steps, const std::optional<at::Tensor>& found_inf) {
  if (found_inf && !steps.empty()) {
    at::_foreach_add_(steps, found_inf->reshape({}).ne(0).to(steps[0].scalar_type()), -1);
  }
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

// Whether Op names its lists' storage types (`Lists<T>`). A trait, not a requires-expression in
// the launch lambda: nvcc (EDG) instantiated the discarded branch of the latter.
template <typename Op, typename T, typename = void>
struct OpListTypes {
  static constexpr bool value = false;
};
template <typename Op, typename T>
struct OpListTypes<Op, T, std::void_t<typename Op::template Lists<T>>> {
  static constexpr bool value = true;
  using type = typename Op::template Lists<T>;
};

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
    if constexpr (OpListTypes<Op, T>::value) {
      // Remainders complete bf16 weights only, and stochastically rounded weights are bf16
      // (both checked): no other instantiation.
      if constexpr ((Op::remainder_master || Op::rounded_weights) &&
                    !std::is_same_v<T, c10::BFloat16>) {
        TORCH_CHECK(false, "peak: remainders and stochastically rounded weights need bfloat16 "
                    "params");
      } else {
        using Types = typename OpListTypes<Op, T>::type;
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
