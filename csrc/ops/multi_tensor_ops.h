// The bodies of the multi-tensor ops, written once over a backend ("Exec"): validate, pick the
// storage types, hand the op's math to the backend's launcher. Backends: cpu (production CPU),
// cuda (production CUDA, in ops_cuda.cu) and emulated (the CUDA grid run on the CPU, for tests).
//
// An Exec provides:
//   template <class Op, class... T> void apply(const HostTensorLists<D>&, int64_t, const Op&,
//                                               const BlockSink&);
//   void finish_norms(partials, offsets, total_out, per_tensor_out);  // sqrt of segmented sums
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "../core/elementwise_ops.h"
#include "../core/grid_block.h"
#include "../core/launch_plan.h"
#include "checks.h"

namespace peak {

// Calls f(T{}) with T the storage type of `dtype` (already validated by check_tensor_lists).
template <typename F>
void with_storage_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      return;
    case at::kHalf:
      f(c10::Half{});
      return;
    case at::kBFloat16:
      f(c10::BFloat16{});
      return;
    default:
      TORCH_CHECK(false, "peak: unsupported dtype ", dtype);
  }
}

template <int Depth>
HostTensorLists<Depth> host_lists(std::initializer_list<at::TensorList> lists) {
  HostTensorLists<Depth> out;
  const at::TensorList& first = *lists.begin();
  out.ptrs.resize(first.size());
  out.numels.resize(first.size());
  for (size_t t = 0; t < first.size(); ++t) {
    int d = 0;
    for (const at::TensorList& l : lists) out.ptrs[t][d++] = l[t].data_ptr();
    out.numels[t] = first[t].numel();
  }
  return out;
}

inline std::vector<int64_t> numels_of(at::TensorList list) {
  std::vector<int64_t> n(list.size());
  for (size_t i = 0; i < list.size(); ++i) n[i] = list[i].numel();
  return n;
}

template <typename Exec>
void multi_tensor_scale(Exec& exec, at::TensorList inputs, at::TensorList outputs,
                        const at::Tensor& scale, const at::Tensor& found_inf,
                        int64_t chunk_size,
                        const std::optional<at::Tensor>& per_tensor_found_inf = std::nullopt) {
  constexpr const char* name = "multi_tensor_scale_";
  check_chunk_size(name, chunk_size);
  // In place (the very same list, as outputs=None gives): one list to validate, not two.
  const bool in_place = outputs.data() == inputs.data() && outputs.size() == inputs.size();
  if (in_place) {
    check_tensor_lists(name, {{"inputs", inputs}});
  } else {
    check_tensor_lists(name, {{"inputs", inputs}, {"outputs", outputs}});
    check_no_partial_overlap(name, {"outputs", outputs}, {"inputs", inputs});
  }
  const c10::Device device = lists_device(inputs, found_inf);
  check_scalar_tensor(name, "found_inf", found_inf, at::kFloat, device);
  check_scalar_tensor(name, "scale", scale, at::kFloat, device);
  if (per_tensor_found_inf.has_value()) {
    check_flag_vector(name, "per_tensor_found_inf", *per_tensor_found_inf, inputs.size(), device);
  }
  if (inputs.empty()) return;
  const BlockSink sink{found_inf.data_ptr<float>(), nullptr,
                       per_tensor_found_inf ? per_tensor_found_inf->data_ptr<float>() : nullptr};
  if (in_place) {
    ScaleInPlaceOp op;
    op.scale.ptr = scale.data_ptr<float>();
    const auto lists = host_lists<1>({inputs});
    with_storage_type(inputs[0].scalar_type(), [&](auto t) {
      exec.template apply<ScaleInPlaceOp, decltype(t)>(lists, chunk_size, op, sink);
    });
    return;
  }
  ScaleOp op;
  op.scale.ptr = scale.data_ptr<float>();
  const auto lists = host_lists<2>({inputs, outputs});
  with_storage_type(inputs[0].scalar_type(), [&](auto in_t) {
    with_storage_type(outputs[0].scalar_type(), [&](auto out_t) {
      exec.template apply<ScaleOp, decltype(in_t), decltype(out_t)>(lists, chunk_size, op, sink);
    });
  });
}

template <typename Exec>
void multi_tensor_check_finite(Exec& exec, at::TensorList tensors, const at::Tensor& found_inf,
                               int64_t chunk_size,
                               const std::optional<at::Tensor>& per_tensor_found_inf) {
  constexpr const char* name = "multi_tensor_check_finite_";
  check_chunk_size(name, chunk_size);
  check_tensor_lists(name, {{"tensors", tensors}});
  const c10::Device device = lists_device(tensors, found_inf);
  check_scalar_tensor(name, "found_inf", found_inf, at::kFloat, device);
  if (per_tensor_found_inf.has_value()) {
    check_flag_vector(name, "per_tensor_found_inf", *per_tensor_found_inf, tensors.size(), device);
  }
  if (tensors.empty()) return;
  const auto lists = host_lists<1>({tensors});
  const BlockSink sink{found_inf.data_ptr<float>(), nullptr,
                       per_tensor_found_inf ? per_tensor_found_inf->data_ptr<float>() : nullptr};
  with_storage_type(tensors[0].scalar_type(), [&](auto t) {
    exec.template apply<CheckFiniteOp, decltype(t)>(lists, chunk_size, CheckFiniteOp{}, sink);
  });
}

template <typename Exec>
void multi_tensor_axpby(Exec& exec, at::TensorList xs, at::TensorList ys,
                        at::TensorList outputs, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& found_inf, int64_t check, int64_t chunk_size) {
  constexpr const char* name = "multi_tensor_axpby_";
  check_chunk_size(name, chunk_size);
  TORCH_CHECK(check >= kCheckNone && check <= kCheckBoth, name,
              ": check must be 0 (none), 1 (x), 2 (y) or 3 (both), got ", check);
  check_tensor_lists(name, {{"xs", xs}, {"ys", ys}, {"outputs", outputs}});
  check_no_partial_overlap(name, {"outputs", outputs}, {"xs", xs});
  check_no_partial_overlap(name, {"outputs", outputs}, {"ys", ys});
  const c10::Device device = lists_device(xs, found_inf);
  check_scalar_tensor(name, "found_inf", found_inf, at::kFloat, device);
  check_scalar_tensor(name, "a", a, at::kFloat, device);
  check_scalar_tensor(name, "b", b, at::kFloat, device);
  if (xs.empty()) return;
  AxpbyOp op;
  op.a.ptr = a.data_ptr<float>();
  op.b.ptr = b.data_ptr<float>();
  op.check = static_cast<int>(check);
  const auto lists = host_lists<3>({xs, ys, outputs});
  const BlockSink sink{found_inf.data_ptr<float>(), nullptr};
  with_storage_type(xs[0].scalar_type(), [&](auto x_t) {
    with_storage_type(ys[0].scalar_type(), [&](auto y_t) {
      with_storage_type(outputs[0].scalar_type(), [&](auto out_t) {
        exec.template apply<AxpbyOp, decltype(x_t), decltype(y_t), decltype(out_t)>(
            lists, chunk_size, op, sink);
      });
    });
  });
}

template <typename Exec>
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(Exec& exec, at::TensorList tensors,
                                                       bool per_tensor, int64_t chunk_size) {
  constexpr const char* name = "multi_tensor_l2norm";
  check_chunk_size(name, chunk_size);
  TORCH_CHECK(!tensors.empty(), name, ": tensors is empty; the norm of no tensors is 0, "
              "call it only with at least one tensor");
  check_tensor_lists(name, {{"tensors", tensors}});
  const auto opts = tensors[0].options().dtype(at::kFloat);
  at::Tensor total = at::empty({1}, opts);
  at::Tensor per = at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, opts);
  const std::vector<int64_t> offsets = chunk_offsets(numels_of(tensors), chunk_size);
  at::Tensor partials = at::empty({offsets.back()}, opts);
  const auto lists = host_lists<1>({tensors});
  const BlockSink sink{nullptr, partials.data_ptr<float>()};
  with_storage_type(tensors[0].scalar_type(), [&](auto t) {
    exec.template apply<SumSquaresOp, decltype(t)>(lists, chunk_size, SumSquaresOp{}, sink);
  });
  exec.finish_norms(partials, offsets, total, per_tensor ? &per : nullptr);
  return {total, per};
}

// Host version of the norm epilogue (CPU and the emulated grid): per-tensor sums over the
// tensor's chunks in order, the total as the sum of the per-tensor sums, then sqrt.
void finish_norms_on_host(const float* partials, const std::vector<int64_t>& offsets,
                          float* total, float* per_tensor);

}  // namespace peak
