// The host norm epilogue (host_exec.h), used by the CPU launcher and the emulated CUDA grid.
#include <cmath>

#include "multi_tensor_ops.h"

namespace peak {

void finish_norms_on_host(const float* partials, const std::vector<int64_t>& offsets,
                          float* total, float* per_tensor) {
  float sum = 0.0f;
  for (size_t t = 0; t + 1 < offsets.size(); ++t) {
    float tensor_sum = 0.0f;
    for (int64_t c = offsets[t]; c < offsets[t + 1]; ++c) tensor_sum += partials[c];
    if (per_tensor != nullptr) per_tensor[t] = std::sqrt(tensor_sum);
    sum += tensor_sum;
  }
  *total = std::sqrt(sum);
}

}  // namespace peak
