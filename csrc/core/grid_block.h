// What one CUDA block of a multi-tensor launch does, as host-and-device code.
//
// The CUDA kernel (cuda_apply.cuh) calls `grid_block_thread` with blockIdx/threadIdx; the CPU
// emulation of the grid (emulated_grid.h, used by tests) calls the same function for every
// (block, thread) pair of every launch, over metadata filled by the same `fill_metadata`
// (grid_metadata.h). So the packing (launch_plan.h), the metadata layout and the per-block
// indexing are all exercised on machines without a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "block_quant.h"
#include "grid_metadata.h"
#include "host_device.h"
#include "launch_plan.h"

namespace peak {

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

// NOTE: [8-bit moments on the grid]
// A warp owns a quantization block (kQBlock = 256 elements): lane l holds its elements 8l to
// 8l + 7, moved with one aligned access per list where they allow it (a view at an odd offset
// or a block's short tail takes the per-element path), so a warp reads and writes the block's
// 256 consecutive elements of every list in full-width transactions. Phase 1 of
// NOTE: [8-bit moments] runs the functor once per element and keeps the new values in the lane's
// registers; the block's absmax is a max over the lanes (of the bits: exact in any order); phase
// 2 encodes and stores the kept values. The warps of a CUDA block take the chunk's quantization
// blocks in turn (chunks are multiples of kQBlock: checked by the host). The same code runs on
// the CUDA grid, where a thread is one lane and the max is a warp shuffle, and on its CPU
// emulation, which runs a warp's 32 lanes one after another with the max between the phases:
// `kLanes` is the number of lanes one call holds (1 on CUDA, a whole warp emulated). The functor
// runs once per element as on the CPU launcher, so the bits are the CPU's.
constexpr int kWarpSize = 32;
constexpr int kQPerLane = kQBlock / kWarpSize;
static_assert(kQBlock % kWarpSize == 0 && kThreadsPerBlock % kWarpSize == 0,
              "see NOTE: [8-bit moments on the grid]");

// The max of a lane's value over its warp (CUDA only: kLanes == 1 is instantiated for the host
// pass of nvcc as well, but only the device runs it).
PEAK_HD uint32_t warp_max_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, bits, offset);
    bits = other > bits ? other : bits;
  }
#endif
  return bits;
}

// A lane's eight consecutive elements of one list, moved with one aligned access (two for
// fp32: 32 bytes) when every list's slice starts on such a boundary (as NOTE: [Aligned vector
// access]); 8-bit codes move as bytes.
template <typename L>
using StoredAs = std::conditional_t<is_q8<L>, uint8_t, L>;
template <typename S>
struct alignas(sizeof(S) * kQPerLane > 16 ? 16 : sizeof(S) * kQPerLane) LaneVector {
  S e[kQPerLane];
};

template <typename... T, size_t... D>
PEAK_HD bool lane_vectors_aligned(void* const* base, int64_t i, std::index_sequence<D...>) {
  return ((reinterpret_cast<uintptr_t>(
               static_cast<const StoredAs<typename ListType<D, T...>::type>*>(base[D]) + i) %
               alignof(LaneVector<StoredAs<typename ListType<D, T...>::type>>) ==
           0) &&
          ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void load_lane_vectors_q8(void* const* base, int64_t i, float (*v)[sizeof...(T)],
                                  const float* units, std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        using S = StoredAs<L>;
        if constexpr (!((Op::read_mask >> D) & 1u)) {
          for (int k = 0; k < kQPerLane; ++k) v[k][D] = 0.0f;
        } else {
          const LaneVector<S> x = load_vector<LaneVector<S>>(static_cast<const S*>(base[D]) + i);
          for (int k = 0; k < kQPerLane; ++k) {
            if constexpr (is_q8<L>) {
              v[k][D] = L::decode(x.e[k], units[q8_index<D, T...>()]);
            } else {
              v[k][D] = to_opmath(x.e[k]);
            }
          }
        }
      }(),
      ...);
}

template <typename Op, typename... T, size_t... D>
PEAK_HD void store_lane_vectors_q8(const Op& op, void* const* base, int64_t i,
                                   const float (*v)[sizeof...(T)], const float* inv_units,
                                   std::index_sequence<D...>) {
  (
      [&] {
        using L = typename ListType<D, T...>::type;
        using S = StoredAs<L>;
        if constexpr (((Op::write_mask >> D) & 1u) != 0) {
          LaneVector<S> x;
          for (int k = 0; k < kQPerLane; ++k) {
            if constexpr (is_q8<L>) {
              x.e[k] = static_cast<uint8_t>(L::encode(v[k][D], inv_units[q8_index<D, T...>()],
                                                      q8_round_add<Op, L>(op, i + k)));
            } else {
              x.e[k] = from_opmath<L>(v[k][D]);
            }
          }
          store_vector(static_cast<S*>(base[D]) + i, x);
        }
      }(),
      ...);
}

// Phase 1 for one lane: decode its elements of the block (kQPerLane consecutive ones), run the
// functor, fold the absmax.
template <typename Op, typename... T>
PEAK_HD void q8_lane_compute(const Op& op, void* const* base, int64_t qstart, int64_t qlen,
                             int lane, const float* units, float (*v)[sizeof...(T)],
                             typename Op::State& state, float* absmax) {
  const auto lists = std::make_index_sequence<sizeof...(T)>{};
  const int64_t first = int64_t{lane} * kQPerLane;
  if (first + kQPerLane <= qlen && lane_vectors_aligned<T...>(base, qstart + first, lists)) {
    load_lane_vectors_q8<Op, T...>(base, qstart + first, v, units, lists);
    for (int k = 0; k < kQPerLane; ++k) {
      apply_op(op, v[k], state, qstart + first + k);
      fold_absmax<T...>(v[k], absmax, lists);
    }
    return;
  }
  for (int k = 0; k < kQPerLane; ++k) {
    if (first + k < qlen) {
      load_element_q8<Op, T...>(base, qstart + first + k, v[k], units, lists);
      apply_op(op, v[k], state, qstart + first + k);
      fold_absmax<T...>(v[k], absmax, lists);
    }
  }
}

// Phase 2 for one lane: encode with the block's new scale and store.
template <typename Op, typename... T>
PEAK_HD void q8_lane_store(const Op& op, void* const* base, int64_t qstart, int64_t qlen,
                           int lane, const float (*v)[sizeof...(T)], const float* inv_units) {
  const auto lists = std::make_index_sequence<sizeof...(T)>{};
  const int64_t first = int64_t{lane} * kQPerLane;
  const bool vectors =
      first + kQPerLane <= qlen && lane_vectors_aligned<T...>(base, qstart + first, lists);
  if (vectors) store_lane_vectors_q8<Op, T...>(op, base, qstart + first, v, inv_units, lists);
  for (int k = 0; k < kQPerLane; ++k) {
    if (first + k < qlen) {
      if (!vectors) store_element_q8<Op, T...>(op, base, qstart + first + k, v[k], inv_units, lists);
      if constexpr (Op::stores_grad) {
        if (op.store_grad) store_unscaled_grad<Op, T...>(op, base[0], qstart + first + k, v[k][0]);
      }
    }
  }
}

// Warp `warp` of `nwarps` over its quantization blocks of a chunk slice, holding lanes
// first_lane .. first_lane + kLanes - 1 (states: one per lane held). The scales are each
// quantized list's per-tensor fp32 scales.
template <int kLanes, typename Op, typename... T>
PEAK_HD void grid_q8_warp(float* const* scales, void* const* base, int64_t start, int64_t n,
                          int warp, int nwarps, int first_lane, const Op& op,
                          typename Op::State* states) {
  constexpr int Depth = sizeof...(T);
  constexpr int NQ = q8_count<T...>;
  const auto lists = std::make_index_sequence<Depth>{};
  float v[kLanes][kQPerLane][Depth];
  for (int64_t b = warp * int64_t{kQBlock}; b < n; b += int64_t{nwarps} * kQBlock) {
    const int64_t block = (start + b) / kQBlock;
    const int64_t qlen = b + kQBlock < n ? kQBlock : n - b;
    float units[NQ], inv_units[NQ], absmax[NQ];
    for (int q = 0; q < NQ; ++q) absmax[q] = scales[q][block];  // the old scales
    q8_units<T...>(absmax, units, inv_units, lists);
    uint32_t max_bits[NQ] = {};
    for (int l = 0; l < kLanes; ++l) {
      float lane_absmax[NQ] = {};
      q8_lane_compute<Op, T...>(op, base, start + b, qlen, first_lane + l, units, v[l],
                                states[l], lane_absmax);
      for (int q = 0; q < NQ; ++q) {
        const uint32_t bits = float_bits(lane_absmax[q]);
        max_bits[q] = bits > max_bits[q] ? bits : max_bits[q];
      }
    }
    for (int q = 0; q < NQ; ++q) {
      if constexpr (kLanes < kWarpSize) max_bits[q] = warp_max_bits(max_bits[q]);
      absmax[q] = bits_float(max_bits[q]);
    }
    float new_units[NQ], inv_new[NQ];
    q8_units<T...>(absmax, new_units, inv_new, lists);
    for (int l = 0; l < kLanes; ++l) {
      q8_lane_store<Op, T...>(op, base, start + b, qlen, first_lane + l, v[l], inv_new);
    }
    if (first_lane == 0) {
      for (int q = 0; q < NQ; ++q) scales[q][block] = absmax[q];
    }
  }
}

// The slice of its chunk a block works on: the lists' addresses, the first element, the count.
template <typename Op, typename... T>
PEAK_HD int64_t block_slice(const MetadataFor<Op, T...>& meta, int block, int slot,
                            int64_t chunk_size, void** base, int64_t& start) {
  start = (meta.first_chunk[slot] + int64_t{block - meta.first_block[slot]}) * chunk_size;
  int64_t n = meta.numel[slot] - start;
  if (n > chunk_size) n = chunk_size;
  for (int d = 0; d < static_cast<int>(sizeof...(T)); ++d) base[d] = meta.addresses[d][slot];
  return n;
}

// Whether a block takes the vector path (NOTE: [Aligned vector access]).
template <typename Op, typename... T>
PEAK_HD bool block_vectorises(const MetadataFor<Op, T...>& meta, int block, int64_t chunk_size) {
  if constexpr (q8_count<T...> > 0) {
    return false;  // lanes of a warp per quantization block (NOTE: [8-bit moments on the grid])
  } else {
    void* base[sizeof...(T)];
    int64_t start = 0;
    const int64_t n =
        block_slice<Op, T...>(meta, block, block_slot(meta, block), chunk_size, base, start);
    return n >= kVectorWidth &&
           lists_vector_aligned<T...>(base, start, std::make_index_sequence<sizeof...(T)>{});
  }
}

// The op a block runs: the step's op with its tensor's own scalars loaded.
template <typename Op, typename... T>
PEAK_HD Op block_op(const MetadataFor<Op, T...>& meta, int slot, const Op& step_op) {
  Op op = step_op;
  if constexpr (Op::tensor_scalars > 0) {
    const float* scalars[Op::tensor_scalars > 0 ? Op::tensor_scalars : 1];
    for (int k = 0; k < Op::tensor_scalars; ++k) scalars[k] = meta.tensor_scalars[k][slot];
    op.load_tensor_scalars(scalars);
  }
  return op;
}

// A block's share of a step with quantized lists (NOTE: [8-bit moments on the grid]) for warp
// `warp` of `nwarps`, holding kLanes lanes from first_lane (states: one per lane held). A skipped
// step (the device-side overflow flag is set) returns before any memory is touched.
template <int kLanes, typename Op, typename... T>
PEAK_HD void grid_block_q8(const MetadataFor<Op, T...>& meta, int block, int warp, int nwarps,
                           int first_lane, int64_t chunk_size, const Op& step_op,
                           typename Op::State* states) {
  constexpr int NQ = q8_count<T...>;
  const int slot = block_slot(meta, block);
  const Op op = block_op<Op, T...>(meta, slot, step_op);
  if (op.skip()) return;
  void* base[sizeof...(T)];
  int64_t start = 0;
  const int64_t n = block_slice<Op, T...>(meta, block, slot, chunk_size, base, start);
  float* scales[NQ];
  for (int q = 0; q < NQ; ++q) {
    scales[q] = const_cast<float*>(meta.tensor_scalars[Op::tensor_scalars - NQ + q][slot]);
  }
  grid_q8_warp<kLanes, Op, T...>(scales, base, start, n, warp, nwarps, first_lane, op, states);
}

// One thread's share of one block: groups of kVectorWidth elements (or single elements) thread,
// thread + nthreads, ... of the block's chunk. `op` has loaded its per-step scalars; here it gets
// the tensor's own scalars, and a skipped step (the device-side overflow flag is set) returns
// before any memory is touched. A step with quantized lists runs by warps instead: on CUDA the
// thread is one lane of grid_block_q8; the emulated grid calls grid_block_q8 per warp.
template <typename Op, typename... T>
PEAK_HD void grid_block_thread(const MetadataFor<Op, T...>& meta, int block, int thread,
                               int nthreads, int64_t chunk_size, const Op& step_op,
                               typename Op::State& state) {
  constexpr int Depth = sizeof...(T);
  constexpr auto lists = std::make_index_sequence<Depth>{};
  if constexpr (q8_count<T...> > 0) {
#ifdef __CUDA_ARCH__
    grid_block_q8<1, Op, T...>(meta, block, thread / kWarpSize, nthreads / kWarpSize,
                               thread % kWarpSize, chunk_size, step_op, &state);
#else
    // One lane per call needs the warp's shuffle: on the host a warp runs whole
    // (grid_block_q8<kWarpSize>, as emulated_grid.h calls it).
    static_assert(q8_count<T...> == 0, "8-bit steps on the host run by warps: grid_block_q8");
#endif
  } else {
    const int slot = block_slot(meta, block);
    const Op op = block_op<Op, T...>(meta, slot, step_op);
    if (op.skip()) return;
    void* base[Depth];
    int64_t start = 0;
    const int64_t n = block_slice<Op, T...>(meta, block, slot, chunk_size, base, start);
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
