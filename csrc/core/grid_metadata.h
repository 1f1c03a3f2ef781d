// The launch metadata of a multi-tensor kernel (the 4 KB kernel argument: tensor slots, no
// per-block table) and typed element access, shared by the CUDA kernel and its CPU emulation
// (grid_block.h).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "host_device.h"
#include "launch_plan.h"

namespace peak {

constexpr int kMaxDepth = 6;
constexpr int kThreadsPerBlock = 512;
// Blocks per launch: a bound for the host's plan only (the metadata has no per-block table), so
// that a launch covers all the chunks of its tensors and the GPU runs full waves.
constexpr int kMaxBlocksPerLaunch = 1 << 20;

// NOTE: [Launch metadata budget]
// Kernel arguments are limited to 4 KB; the metadata gets 3840 bytes of it (the op's scalars and
// the sink take the rest). Every tensor slot costs its addresses (8 per list), its size (8), its
// index (4), its first block and first chunk (4 + 4) and its per-tensor scalar pointers (8 each:
// an optimizer's step count, LAMB's norms); there is no per-block table: the blocks of a slot
// are consecutive, in chunk order (NOTE: [Chunking]), so block b belongs to the last slot whose
// first block is <= b, and its chunk is the slot's first chunk plus the distance. A per-block
// table (ATen's layout: 5 bytes a block) capped a launch at 320 blocks, less than two waves of an
// H100 (132 SMs), so a large tensor's step ran in many launches with a part-empty last wave each.
constexpr int kMetadataBudget = 3840;
constexpr int kMetadataFixedBytes = 16;  // num_slots (+ padding) and first_global_chunk

constexpr int max_tensors_per_launch(int depth, int tensor_scalars = 0) {
  return (kMetadataBudget - kMetadataFixedBytes) / (depth * 8 + 20 + tensor_scalars * 8);
}

template <int Depth, int NScalars = 0>
struct TensorListMetadata {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth, NScalars);
  void* addresses[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  const float* tensor_scalars[NScalars > 0 ? NScalars : 1][NScalars > 0 ? kMaxTensors : 1];
  int32_t tensor_index[kMaxTensors];  // slot -> index in the caller's lists (per-tensor results)
  int32_t first_block[kMaxTensors];   // the slot's first block in this launch
  int32_t first_chunk[kMaxTensors];   // that block's chunk of the tensor
  int32_t num_slots;
  int64_t first_global_chunk;
};

template <int Depth, int NScalars>
constexpr bool fits_budget() {
  return sizeof(TensorListMetadata<Depth, NScalars>) <= kMetadataBudget;
}
static_assert(fits_budget<1, 0>() && fits_budget<2, 0>() && fits_budget<3, 0>() &&
                  fits_budget<4, 0>() && fits_budget<5, 0>() && fits_budget<6, 0>(),
              "see NOTE: [Launch metadata budget]");
static_assert(fits_budget<3, 2>() && fits_budget<4, 1>() && fits_budget<5, 1>() &&
                  fits_budget<6, 1>() && fits_budget<5, 2>() && fits_budget<6, 3>(),
              "see NOTE: [Launch metadata budget]");

// Addresses and sizes of the caller's tensors, list by list: ptrs[t][d] is tensor t of list d;
// scalars[t][k] points to tensor t's k-th per-tensor scalar (a float in the tensors' memory).
template <int Depth, int NScalars = 0>
struct HostTensorLists {
  std::vector<std::array<void*, Depth>> ptrs;
  std::vector<int64_t> numels;
  std::vector<std::array<const float*, NScalars>> scalars;
};

template <int Depth, int NScalars>
void fill_metadata(const Launch& launch, const HostTensorLists<Depth, NScalars>& lists,
                   TensorListMetadata<Depth, NScalars>& meta) {
  std::memset(&meta, 0, sizeof(meta));
  for (size_t slot = 0; slot < launch.slot_tensor.size(); ++slot) {
    const int64_t t = launch.slot_tensor[slot];
    for (int d = 0; d < Depth; ++d) meta.addresses[d][slot] = lists.ptrs[t][d];
    meta.numel[slot] = lists.numels[t];
    meta.tensor_index[slot] = static_cast<int32_t>(t);
    for (int k = 0; k < NScalars; ++k) meta.tensor_scalars[k][slot] = lists.scalars[t][k];
  }
  // The plan emits a slot's blocks consecutively and in chunk order; its first block says all.
  int last_slot = -1;
  for (size_t b = 0; b < launch.blocks.size(); ++b) {
    const BlockAssignment& a = launch.blocks[b];
    if (a.slot != last_slot) {
      meta.first_block[a.slot] = static_cast<int32_t>(b);
      meta.first_chunk[a.slot] = static_cast<int32_t>(a.chunk);
      last_slot = a.slot;
    }
  }
  meta.num_slots = static_cast<int32_t>(launch.slot_tensor.size());
  meta.first_global_chunk = launch.first_global_chunk;
}

// The slot block `block` of a launch works on (NOTE: [Launch metadata budget]): a binary search
// over the slots' first blocks (the same answer in every thread of the block).
template <int Depth, int NScalars>
PEAK_HD int block_slot(const TensorListMetadata<Depth, NScalars>& meta, int block) {
  int lo = 0, hi = meta.num_slots - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (meta.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
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

template <typename Op, typename... T>
using MetadataFor = TensorListMetadata<sizeof...(T), Op::tensor_scalars>;

}  // namespace peak
