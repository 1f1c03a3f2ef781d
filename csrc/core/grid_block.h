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

#include "block_quant.h"
#include "host_device.h"
#include "launch_plan.h"

namespace peak {

constexpr int kMaxDepth = 6;
constexpr int kMaxBlocksPerLaunch = 320;
constexpr int kThreadsPerBlock = 512;

// NOTE: [Launch metadata budget]
// Kernel arguments are limited to 4 KB; the metadata gets 3840 bytes of it (the op's scalars and
// the sink take the rest). The block tables cost 5 bytes per block; every tensor slot costs its
// addresses (8 per list), its size (8), its index (4) and its per-tensor scalar pointers (8 each:
// an optimizer's step count, LAMB's norms). Slots per launch are ATen's table where it fits.
constexpr int kMetadataBudget = 3840;
constexpr int kBlockTableBytes = kMaxBlocksPerLaunch * 5 + 16;

constexpr int max_tensors_per_launch(int depth, int tensor_scalars = 0) {
  const int table = depth == 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36
                  : depth == 5 ? 30 : 24;
  const int fit = (kMetadataBudget - kBlockTableBytes) / (depth * 8 + 12 + tensor_scalars * 8);
  return table < fit ? table : fit;
}

template <int Depth, int NScalars = 0>
struct TensorListMetadata {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth, NScalars);
  void* addresses[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t tensor_index[kMaxTensors];  // slot -> index in the caller's lists (per-tensor results)
  const float* tensor_scalars[NScalars > 0 ? NScalars : 1][NScalars > 0 ? kMaxTensors : 1];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];  // plan_launches checks chunk counts fit
  uint8_t block_to_slot[kMaxBlocksPerLaunch];
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
                  fits_budget<6, 1>() && fits_budget<5, 2>(),
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

template <typename Op, typename... T>
using MetadataFor = TensorListMetadata<sizeof...(T), Op::tensor_scalars>;

// NOTE: [Unscaled gradients after the step] (optimizer_ops.h): list 0, the gradients, stored
// back unscaled when the op's run-time store_grad is set (a branch uniform over the grid), from
// the raw gradient the functor left in v[0].
template <typename Op, typename... T>
PEAK_HD void store_unscaled_grad(const Op& op, void* base, int64_t i, float g) {
  using G = typename ListType<0, T...>::type;
  static_cast<G*>(base)[i] = from_opmath<G>(op.unscaled_grad(g));
}

// NOTE: [8-bit moments] (block_quant.h): element access of a step with quantized lists, given
// each quantized list's scale unit (decode) or inverse unit (encode) for the element's block.
template <typename Op, typename... T, size_t... D>
PEAK_HD void load_element_q8(void* const* base, int64_t i, float* v, const float* units,
                             std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        if constexpr (!((Op::read_mask >> D) & 1u)) {
          v[D] = 0.0f;
        } else if constexpr (is_q8<L>) {
          v[D] = L::decode(static_cast<const uint8_t*>(base[D])[i], units[q8_index<D, T...>()]);
        } else {
          v[D] = to_opmath(static_cast<const L*>(base[D])[i]);
        }
      }(),
      ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void store_element_q8(const Op& op, void* const* base, int64_t i, const float* v,
                              const float* inv_units, std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        if constexpr (!((Op::write_mask >> D) & 1u)) {
        } else if constexpr (is_q8<L>) {
          static_cast<uint8_t*>(base[D])[i] =
              static_cast<uint8_t>(L::encode(v[D], inv_units[q8_index<D, T...>()],
                                             q8_round_add<Op, L>(op, i)));
        } else {
          static_cast<L*>(base[D])[i] = from_opmath<L>(v[D]);
        }
      }(),
      ...);
}

// The new absmax of each quantized list, folded in (as bits: Q8::magnitude_bits).
template <typename... T, size_t... D>
PEAK_HD void fold_absmax(const float* v, float* absmax, std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        if constexpr (is_q8<L>) {
          const uint32_t a = L::magnitude_bits(v[D]);
          float& m = absmax[q8_index<D, T...>()];
          m = a > float_bits(m) ? bits_float(a) : m;
        }
      }(),
      ...);
}

// The scale and units of each quantized list, by its position among them.
template <typename... T, size_t... D>
PEAK_HD void q8_units(const float* absmax, float* units, float* inv_units,
                      std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        if constexpr (is_q8<L>) {
          units[q8_index<D, T...>()] = L::unit(absmax[q8_index<D, T...>()]);
          inv_units[q8_index<D, T...>()] = L::inv_unit(absmax[q8_index<D, T...>()]);
        }
      }(),
      ...);
}

// A step with quantized lists, in the grid: thread `thread` owns quantization blocks thread,
// thread + nthreads, ... of the chunk (chunks are multiples of kQBlock: checked by the host) and
// runs both phases of NOTE: [8-bit moments] on each, the second recomputing the first. The
// scales are the last q8_count<T...> per-tensor scalars (pointers to each tensor's fp32 scales).
template <typename Op, typename... T>
PEAK_HD void grid_q8_thread(float* const* scales, void* const* base, int64_t start, int64_t n,
                            int thread, int nthreads, const Op& op, typename Op::State& state) {
  constexpr int Depth = sizeof...(T);
  constexpr int NQ = q8_count<T...>;
  const auto lists = std::make_index_sequence<Depth>{};
  for (int64_t b = thread * int64_t{kQBlock}; b < n; b += int64_t{nthreads} * kQBlock) {
    const int64_t block = (start + b) / kQBlock;
    const int64_t end = b + kQBlock < n ? b + kQBlock : n;
    float units[NQ], inv_units[NQ], absmax[NQ];
    for (int q = 0; q < NQ; ++q) absmax[q] = scales[q][block];  // the old scales
    q8_units<T...>(absmax, units, inv_units, lists);
    for (int q = 0; q < NQ; ++q) absmax[q] = 0.0f;
    for (int64_t i = b; i < end; ++i) {  // phase 1: the new moments' absmax
      float v[Depth];
      load_element_q8<Op, T...>(base, start + i, v, units, lists);
      typename Op::State scratch_state{};
      apply_op(op, v, scratch_state, start + i);
      fold_absmax<T...>(v, absmax, lists);
    }
    float new_units[NQ], inv_new[NQ];
    q8_units<T...>(absmax, new_units, inv_new, lists);
    for (int64_t i = b; i < end; ++i) {  // phase 2: the same values, encoded and stored
      float v[Depth];
      load_element_q8<Op, T...>(base, start + i, v, units, lists);
      apply_op(op, v, state, start + i);
      store_element_q8<Op, T...>(op, base, start + i, v, inv_new, lists);
      if constexpr (Op::stores_grad) {
        if (op.store_grad) store_unscaled_grad<Op, T...>(op, base[0], start + i, v[0]);
      }
    }
    for (int q = 0; q < NQ; ++q) scales[q][block] = absmax[q];
  }
}

// NOTE: [Aligned vector access]
// A thread moves kVectorWidth consecutive elements of every list with one aligned access per list
// (16 bytes of fp32, 8 of fp16/bf16) when every list's slice of the block starts on such a
// boundary, as ATen's multi-tensor kernels do (ILP 4): fewer, wider memory transactions. Tensors
// from torch's allocator always qualify; a view at an odd offset into a flat buffer (Apex-style
// flattened parameters) takes the per-element path, and a chunk's last n % kVectorWidth elements
// too. Each element's math is the same either way, so results are the same bits (a float sum,
// the L2 norm's, is associated per thread in another order). The emulated grid runs this very
// code, so both paths are tested without a GPU (csrc/testing counts the blocks that vectorise).
constexpr int kVectorWidth = 4;

template <typename T>
struct alignas(sizeof(T) * kVectorWidth) VectorOf {
  T e[kVectorWidth];
};

template <typename V>
PEAK_HD V load_vector(const void* p) {
#ifdef __CUDA_ARCH__
  return *static_cast<const V*>(p);  // one aligned vector load
#else
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
#endif
}

template <typename V>
PEAK_HD void store_vector(void* p, const V& v) {
#ifdef __CUDA_ARCH__
  *static_cast<V*>(p) = v;
#else
  std::memcpy(p, &v, sizeof(V));
#endif
}

template <typename... T, size_t... D>
PEAK_HD bool lists_vector_aligned(void* const* base, int64_t start, std::index_sequence<D...>) {
  return ((reinterpret_cast<uintptr_t>(
               static_cast<const typename ListType<D, T...>::type*>(base[D]) + start) %
               sizeof(VectorOf<typename ListType<D, T...>::type>) ==
           0) &&
          ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void load_vectors(void* const* base, int64_t i, float (*v)[sizeof...(T)],
                          std::index_sequence<D...>) {
  (
      [&] {
        using E = typename ListType<D, T...>::type;
        if constexpr (((Op::read_mask >> D) & 1u) != 0) {
          const VectorOf<E> x = load_vector<VectorOf<E>>(static_cast<const E*>(base[D]) + i);
          for (int k = 0; k < kVectorWidth; ++k) v[k][D] = to_opmath(x.e[k]);
        } else {
          for (int k = 0; k < kVectorWidth; ++k) v[k][D] = 0.0f;
        }
      }(),
      ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void store_vectors(void* const* base, int64_t i, const float (*v)[sizeof...(T)],
                           std::index_sequence<D...>) {
  (
      [&] {
        using E = typename ListType<D, T...>::type;
        if constexpr (((Op::write_mask >> D) & 1u) != 0) {
          VectorOf<E> x;
          for (int k = 0; k < kVectorWidth; ++k) x.e[k] = from_opmath<E>(v[k][D]);
          store_vector(static_cast<E*>(base[D]) + i, x);
        }
      }(),
      ...);
}

template <typename Op, typename... T>
PEAK_HD void store_unscaled_grad_vector(const Op& op, void* base, int64_t i,
                                        const float (*v)[sizeof...(T)]) {
  using G = typename ListType<0, T...>::type;
  VectorOf<G> x;
  for (int k = 0; k < kVectorWidth; ++k) x.e[k] = from_opmath<G>(op.unscaled_grad(v[k][0]));
  store_vector(static_cast<G*>(base) + i, x);
}

// The slice of its chunk a block works on: the lists' addresses, the first element, the count.
template <typename Op, typename... T>
PEAK_HD int64_t block_slice(const MetadataFor<Op, T...>& meta, int block, int64_t chunk_size,
                            void** base, int64_t& start) {
  const int slot = meta.block_to_slot[block];
  start = meta.block_to_chunk[block] * chunk_size;
  int64_t n = meta.numel[slot] - start;
  if (n > chunk_size) n = chunk_size;
  for (int d = 0; d < static_cast<int>(sizeof...(T)); ++d) base[d] = meta.addresses[d][slot];
  return n;
}

// Whether a block takes the vector path (NOTE: [Aligned vector access]).
template <typename Op, typename... T>
PEAK_HD bool block_vectorises(const MetadataFor<Op, T...>& meta, int block, int64_t chunk_size) {
  if constexpr (q8_count<T...> > 0) {
    return false;  // whole quantization blocks per thread (NOTE: [8-bit moments])
  } else {
    void* base[sizeof...(T)];
    int64_t start = 0;
    const int64_t n = block_slice<Op, T...>(meta, block, chunk_size, base, start);
    return n >= kVectorWidth &&
           lists_vector_aligned<T...>(base, start, std::make_index_sequence<sizeof...(T)>{});
  }
}

// One thread's share of one block: groups of kVectorWidth elements (or single elements) thread,
// thread + nthreads, ... of the block's chunk. `op` has loaded its per-step scalars; here it gets
// the tensor's own scalars, and a skipped step (the device-side overflow flag is set) returns
// before any memory is touched.
template <typename Op, typename... T>
PEAK_HD void grid_block_thread(const MetadataFor<Op, T...>& meta, int block, int thread,
                               int nthreads, int64_t chunk_size, const Op& step_op,
                               typename Op::State& state) {
  constexpr int Depth = sizeof...(T);
  constexpr auto lists = std::make_index_sequence<Depth>{};
  const int slot = meta.block_to_slot[block];
  Op op = step_op;
  if constexpr (Op::tensor_scalars > 0) {
    const float* scalars[Op::tensor_scalars > 0 ? Op::tensor_scalars : 1];
    for (int k = 0; k < Op::tensor_scalars; ++k) scalars[k] = meta.tensor_scalars[k][slot];
    op.load_tensor_scalars(scalars);
  }
  if (op.skip()) return;
  void* base[Depth];
  int64_t start = 0;
  const int64_t n = block_slice<Op, T...>(meta, block, chunk_size, base, start);
  if constexpr (q8_count<T...> > 0) {  // NOTE: [8-bit moments]: whole quantization blocks
    constexpr int NQ = q8_count<T...>;
    float* scales[NQ];
    for (int q = 0; q < NQ; ++q) {
      scales[q] = const_cast<float*>(meta.tensor_scalars[Op::tensor_scalars - NQ + q][slot]);
    }
    grid_q8_thread<Op, T...>(scales, base, start, n, thread, nthreads, op, state);
  } else {
    int64_t first_single = 0;  // where the per-element loop starts
    if (n >= kVectorWidth && lists_vector_aligned<T...>(base, start, lists)) {
      const int64_t groups = n / kVectorWidth;
      for (int64_t g = thread; g < groups; g += nthreads) {
        const int64_t i = start + g * kVectorWidth;
        float v[kVectorWidth][Depth];
        load_vectors<Op, T...>(base, i, v, lists);
        for (int k = 0; k < kVectorWidth; ++k) apply_op(op, v[k], state, i + k);
        store_vectors<Op, T...>(base, i, v, lists);
        if constexpr (Op::stores_grad) {
          if (op.store_grad) store_unscaled_grad_vector<Op, T...>(op, base[0], i, v);
        }
      }
      first_single = groups * kVectorWidth;
    }
    for (int64_t i = first_single + thread; i < n; i += nthreads) {
      float v[Depth];
      load_element<Op, T...>(base, start + i, v, lists);
      apply_op(op, v, state, start + i);
      store_element<Op, T...>(base, start + i, v, lists);
      if constexpr (Op::stores_grad) {
        if (op.store_grad) store_unscaled_grad<Op, T...>(op, base[0], start + i, v[0]);
      }
    }
  }
}

// Where blocks leave their results: the overflow flag, and per-chunk partials (l2norm).
struct BlockSink {
  float* found_inf = nullptr;         // may be null when the op reports nothing
  float* partials = nullptr;          // one float per global chunk
  float* per_tensor_flags = nullptr;  // optional: one flag per tensor of the caller's lists
};

}  // namespace peak
