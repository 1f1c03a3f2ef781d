// What one CUDA block of a multi-tensor launch does, as host-and-device code.
//
// The CUDA kernel (cuda_apply.cuh) calls `grid_block_thread` with blockIdx/threadIdx; the CPU
// emulation of the grid (emulated_grid.h, used by tests) calls the same function for every
// (block, thread) pair of every launch, over metadata filled by the same `fill_metadata`. So the
// packing (launch_plan.h), the metadata layout and the per-block indexing are all exercised on
// machines without a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "host_device.h"
#include "launch_plan.h"

namespace peak {

constexpr int kMaxDepth = 5;
constexpr int kMaxBlocksPerLaunch = 320;
constexpr int kThreadsPerBlock = 512;

// Tensor slots per launch by number of lists, chosen (as in ATen) so that the metadata below
// stays well under the 4 KB kernel-argument limit; checked by the static_assert.
constexpr int max_tensors_per_launch(int depth) {
  return depth == 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : 30;
}

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth);
  void* addresses[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t tensor_index[kMaxTensors];  // slot -> index in the caller's lists (per-tensor results)
  int32_t block_to_chunk[kMaxBlocksPerLaunch];  // plan_launches checks chunk counts fit
  uint8_t block_to_slot[kMaxBlocksPerLaunch];
  int64_t first_global_chunk;
};

static_assert(sizeof(TensorListMetadata<1>) <= 4096 - 256, "metadata exceeds kernel-arg budget");
static_assert(sizeof(TensorListMetadata<2>) <= 4096 - 256, "metadata exceeds kernel-arg budget");
static_assert(sizeof(TensorListMetadata<3>) <= 4096 - 256, "metadata exceeds kernel-arg budget");
static_assert(sizeof(TensorListMetadata<4>) <= 4096 - 256, "metadata exceeds kernel-arg budget");
static_assert(sizeof(TensorListMetadata<5>) <= 4096 - 256, "metadata exceeds kernel-arg budget");

// Addresses and sizes of the caller's tensors, list by list: ptrs[t][d] is tensor t of list d.
template <int Depth>
struct HostTensorLists {
  std::vector<std::array<void*, Depth>> ptrs;
  std::vector<int64_t> numels;
};

template <int Depth>
void fill_metadata(const Launch& launch, const HostTensorLists<Depth>& lists,
                   TensorListMetadata<Depth>& meta) {
  std::memset(&meta, 0, sizeof(meta));
  for (size_t slot = 0; slot < launch.slot_tensor.size(); ++slot) {
    const int64_t t = launch.slot_tensor[slot];
    for (int d = 0; d < Depth; ++d) meta.addresses[d][slot] = lists.ptrs[t][d];
    meta.numel[slot] = lists.numels[t];
    meta.tensor_index[slot] = static_cast<int32_t>(t);
  }
  for (size_t b = 0; b < launch.blocks.size(); ++b) {
    meta.block_to_slot[b] = static_cast<uint8_t>(launch.blocks[b].slot);
    meta.block_to_chunk[b] = static_cast<int32_t>(launch.blocks[b].chunk);
  }
  meta.first_global_chunk = launch.first_global_chunk;
}

// Typed element access for list D of a pack of storage types.
template <int D, typename... T>
struct ListType;
template <typename T0, typename... T>
struct ListType<0, T0, T...> {
  using type = T0;
};
template <int D, typename T0, typename... T>
struct ListType<D, T0, T...> {
  using type = typename ListType<D - 1, T...>::type;
};

template <typename Op, typename... T, size_t... D>
PEAK_HD void load_element(void* const* base, int64_t i, float* v, std::index_sequence<D...>) {
  ((((Op::read_mask >> D) & 1u)
        ? (void)(v[D] = to_opmath(static_cast<const typename ListType<D, T...>::type*>(base[D])[i]))
        : (void)(v[D] = 0.0f)),
   ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void store_element(void* const* base, int64_t i, const float* v,
                           std::index_sequence<D...>) {
  ((((Op::write_mask >> D) & 1u)
        ? (void)(static_cast<typename ListType<D, T...>::type*>(base[D])[i] =
                     from_opmath<typename ListType<D, T...>::type>(v[D]))
        : (void)0),
   ...);
}

// One thread's share of one block: elements thread, thread + nthreads, ... of the block's chunk.
template <typename Op, typename... T>
PEAK_HD void grid_block_thread(const TensorListMetadata<sizeof...(T)>& meta, int block,
                               int thread, int nthreads, int64_t chunk_size, const Op& op,
                               typename Op::State& state) {
  constexpr int Depth = sizeof...(T);
  const int slot = meta.block_to_slot[block];
  const int64_t start = meta.block_to_chunk[block] * chunk_size;
  int64_t n = meta.numel[slot] - start;
  if (n > chunk_size) n = chunk_size;
  void* base[Depth];
  for (int d = 0; d < Depth; ++d) base[d] = meta.addresses[d][slot];
  for (int64_t i = thread; i < n; i += nthreads) {
    float v[Depth];
    load_element<Op, T...>(base, start + i, v, std::make_index_sequence<Depth>{});
    op(v, state);
    store_element<Op, T...>(base, start + i, v, std::make_index_sequence<Depth>{});
  }
}

// Where blocks leave their results: the overflow flag, and per-chunk partials (l2norm).
struct BlockSink {
  float* found_inf = nullptr;         // may be null when the op reports nothing
  float* partials = nullptr;          // one float per global chunk
  float* per_tensor_flags = nullptr;  // optional: one flag per tensor of the caller's lists
};

}  // namespace peak
