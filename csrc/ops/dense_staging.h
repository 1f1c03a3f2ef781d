// Tensors the linear multi-tensor walk cannot take (a strided slice such as g[:, :5]) go through
// a dense copy inside the op, as ATen's foreach ops route them off `can_use_fast_route`: callers
// pass any strided gradients and never retry on a slow path of their own.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace peak {

// True when every tensor is one the walk takes as it is. Undefined or non-strided tensors
// count as walkable: the op's validation reports them with its usual message.
inline bool walkable(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.layout() == at::kStrided && !t.is_non_overlapping_and_dense()) {
      return false;
    }
  }
  return true;
}

// `tensors` with each non-walkable tensor replaced by a contiguous copy; write_back() copies
// the results into the originals after the pass (only then: a pass that fails validation
// writes nothing).
struct DenseStaging {
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (original, dense copy)

  explicit DenseStaging(at::TensorList list) : tensors(list.begin(), list.end()) {
    for (at::Tensor& t : tensors) {
      if (t.defined() && t.layout() == at::kStrided && !t.is_non_overlapping_and_dense()) {
        at::Tensor dense = t.contiguous();
        copies.emplace_back(t, dense);
        t = dense;
      }
    }
  }

  void write_back() const {
    for (const auto& [original, dense] : copies) original.copy_(dense);
  }
};

}  // namespace peak
