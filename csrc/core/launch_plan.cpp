#include "launch_plan.h"

#include <stdexcept>

namespace peak {

int64_t num_chunks(int64_t numel, int64_t chunk_size) {
  return numel <= 0 ? 0 : (numel + chunk_size - 1) / chunk_size;
}

std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& numels, int64_t chunk_size) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t t = 0; t < numels.size(); ++t) {
    offsets[t + 1] = offsets[t] + num_chunks(numels[t], chunk_size);
  }
  return offsets;
}

std::vector<int32_t> chunk_owners(const std::vector<int64_t>& offsets) {
  std::vector<int32_t> owner(offsets.empty() ? 0 : offsets.back());
  for (size_t t = 0; t + 1 < offsets.size(); ++t) {
    for (int64_t c = offsets[t]; c < offsets[t + 1]; ++c) owner[c] = static_cast<int32_t>(t);
  }
  return owner;
}

std::vector<Launch> plan_launches(const std::vector<int64_t>& numels, int64_t chunk_size,
                                  LaunchLimits limits) {
  if (chunk_size <= 0) throw std::invalid_argument("chunk_size must be positive");
  if (limits.max_tensors <= 0 || limits.max_blocks <= 0) {
    throw std::invalid_argument("launch limits must be positive");
  }
  std::vector<Launch> launches;
  Launch current;
  int64_t global_chunk = 0;

  auto close = [&](bool carry_tensor, int64_t tensor) {
    launches.push_back(std::move(current));
    current = Launch{};
    current.first_global_chunk = global_chunk;
    if (carry_tensor) current.slot_tensor.push_back(tensor);
  };

  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t chunks = num_chunks(numels[t], chunk_size);
    if (chunks == 0) continue;  // see NOTE: [Chunking]: empty tensors take no slot
    if (chunks > INT32_MAX) {
      throw std::invalid_argument("a tensor has more than 2**31 chunks; use a larger chunk_size");
    }
    current.slot_tensor.push_back(static_cast<int64_t>(t));
    for (int64_t c = 0; c < chunks; ++c) {
      const int slot = static_cast<int>(current.slot_tensor.size()) - 1;
      current.blocks.push_back({slot, c});
      ++global_chunk;
      const bool last_chunk = c == chunks - 1;
      if (static_cast<int>(current.blocks.size()) == limits.max_blocks) {
        close(/*carry_tensor=*/!last_chunk, static_cast<int64_t>(t));
      }
    }
    if (static_cast<int>(current.slot_tensor.size()) == limits.max_tensors) {
      close(/*carry_tensor=*/false, 0);
    }
  }
  if (!current.blocks.empty()) launches.push_back(std::move(current));
  return launches;
}

}  // namespace peak
