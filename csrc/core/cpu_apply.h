// The CPU launcher of multi-tensor apply: parallel over chunks, vectorised inside a chunk.
//
// NOTE: [CPU tiles]
// Each chunk is walked in tiles (NOTE: [Tile size]): every fp16/bf16 list the op reads is
// converted to a float tile (F16C for fp16, a shift for bf16: both vectorise), fp32 lists are used
// where they lie, the op's per-element math runs on float arrays (a loop the compiler vectorises,
// since the op is inlined and its state is a local), and the fp16/bf16 lists it writes are
// converted back. The conversions round exactly as c10's scalar casts do (round to nearest even;
// bf16 NaN -> 0x7fc0), so results equal torch's `.to()` (fp16 NaN payloads: NOTE: [fp16 NaN
// bits]).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "elementwise_ops.h"
#include "grid_block.h"
#include "launch_plan.h"

// This launcher is compiled once per CPU level (csrc/ops/cpu_kernels*.cpp; see NOTE: [CPU levels]
// in csrc/ops/cpu_dispatch.cpp), each time with that level's instruction-set flags. Everything
// here lives in an inline namespace named after the level so that the copies are distinct
// functions: with one name, the linker would keep one copy (the first) for every level.
#ifndef PEAK_CPU_CAPABILITY
#define PEAK_CPU_CAPABILITY single
#endif

namespace peak {
namespace cpu {
inline namespace PEAK_CPU_CAPABILITY {

// NOTE: [Tile size]
// A tile's working set is, per list, its slice (an fp32 list in place) or its fp16 source and
// float tile: at most 6 bytes per element and list. Tiles are sized to keep that within half of
// a 32 KB L1 (1,024 elements for one or two lists, 512 for three to five, 256 for six to ten).
// With 1,024-element tiles for every op, the fp16 Adam step with fp32 masters (five lists, about
// 24 KB) and its unscaled gradients stored back ran at 0.86-0.90 ns per element on Zen 4 against
// 0.74-0.79 at 512 or 256 (one thread, 16M elements; torch's fused fp32 AdamW 0.55-0.65 in the
// same runs). Padded tile rows changed nothing (capacity, not 4K aliasing); 64 was slower
// (per-tile overhead). Tiles are multiples of kLanes (NOTE: [CPU lanes]), so each element's lane,
// and the bits, do not depend on the size.
constexpr int64_t kTileBudgetBytes = 16 * 1024;
constexpr int64_t tile_elements(int depth) {
  int64_t n = 1024;
  while (n > 16 && depth * 6 * n > kTileBudgetBytes) n /= 2;
  return n;
}

inline void load_tile(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void load_tile(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &widened, 4);
  }
}

// half_to_float / float_to_half (host_device.h) convert one element as F16C does, NaNs included
// (NOTE: [fp16 NaN bits]).
// NOTE: [fp16 tiles in 256 bits] The AVX-512 level converts fp16 tiles with F16C's 256-bit
// instructions too (x86-64-v4 includes F16C; the bits are the same): on AMD Zen 4, the 512-bit
// forms made the fp16 Adam step 20% slower than the AVX2 level's (0.90 against 0.74 ns per
// element from memory; 0.85 against 0.74 in cache), the bf16 step, converted inline, unaffected.
inline void load_tile(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (; i < n; ++i) dst[i] = half_to_float(bits[i]);
}

inline void store_tile(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

// NOTE: [Remainder masters] (host_device.h): the 16 bits ride in a float's low half.
inline void load_tile(const Remainder16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t widened = bits[i];
    std::memcpy(dst + i, &widened, 4);
  }
}

inline void store_tile(const float* src, Remainder16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    out[i] = static_cast<uint16_t>(bits);
  }
}

// (bf16_or_nan: host_device.h, shared with the grid's stores.)
inline void store_tile(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    out[i] = bf16_or_nan(bits, (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16);
  }
}

inline void store_tile(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (; i < n; ++i) out[i] = float_to_half(src[i]);
}

// NOTE: [CPU inline conversions]
// bf16 and remainder lists are converted inside the element loop (a shift and a rounding the
// loop vectoriser handles), not staged through a float tile: a lean optimizer step has up to
// five such lists, and a tile pass each way per list cost more than the bytes they save. fp16
// lists keep the tiles (F16C conversions). Same bits either way (the tile functions
// above and these round alike).
template <typename T>
constexpr bool kInlineType = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, Remainder16>;
template <typename T>
constexpr bool kStagedType = !std::is_same_v<T, float> && !kInlineType<T>;
template <typename... T>
using GradType = typename ListType<0, T...>::type;  // list 0: an optimizer's gradients

// NOTE: [CPU tiled lists]
// fp32 and fp16 lists take the same element loop: it reads and writes float arrays, the list's
// own memory for fp32 and a tile converted by load_tile/store_tile for fp16. So which of the two
// a list holds is a run-time bit (`half_lists`, bit d for list d), tested once per tile, and one
// instantiation of the launcher serves every fp32/fp16 combination of an op's lists
// (CpuExec::apply folds both types into TiledList; bf16 and remainder lists keep their inline
// conversions, NOTE: [CPU inline conversions], and steps with 8-bit moments their types). The
// element loop is the one either type compiled to before, and the bits are the same.
struct TiledList {};
template <typename T>
using CpuListType =
    std::conditional_t<std::is_same_v<T, float> || std::is_same_v<T, c10::Half>, TiledList, T>;
template <typename... T, size_t... D>
constexpr uint32_t half_list_bits(std::index_sequence<D...>) {
  return ((std::is_same_v<T, c10::Half> ? 1u << D : 0u) | ... | 0u);
}
template <typename T>
constexpr bool kTiledType = std::is_same_v<T, TiledList>;
// Whether list d (of type T) goes through a tile in this launch.
template <typename T>
inline bool staged_list(uint32_t half_lists, size_t d) {
  if constexpr (kTiledType<T>) {
    return ((half_lists >> d) & 1u) != 0;
  } else {
    return kStagedType<T>;
  }
}
template <typename T>
inline void load_staged(const void* base, int64_t off, float* tile, int64_t n) {
  if constexpr (kTiledType<T>) {
    load_tile(static_cast<const c10::Half*>(base) + off, tile, n);
  } else if constexpr (kStagedType<T>) {
    load_tile(static_cast<const T*>(base) + off, tile, n);
  }
}
template <typename T>
inline void store_staged(const float* tile, void* base, int64_t off, int64_t n) {
  if constexpr (kTiledType<T>) {
    store_tile(tile, static_cast<c10::Half*>(base) + off, n);
  } else if constexpr (kStagedType<T>) {
    store_tile(tile, static_cast<T*>(base) + off, n);
  }
}

inline float widen_inline(const c10::BFloat16* src, int64_t i) {
  return bits_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(src)[i]) << 16);
}
inline float widen_inline(const Remainder16* src, int64_t i) {
  return bits_float(reinterpret_cast<const uint16_t*>(src)[i]);
}
inline void narrow_inline(c10::BFloat16* dst, int64_t i, float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  reinterpret_cast<uint16_t*>(dst)[i] = bf16_or_nan(bits, rounded);
}
// NOTE: [Exact stores] (elementwise_ops.h): x already holds a bf16 value.
inline void narrow_exact(c10::BFloat16* dst, int64_t i, float x) {
  const uint32_t bits = float_bits(x);
  reinterpret_cast<uint16_t*>(dst)[i] = bf16_or_nan(bits, bits >> 16);
}
inline void narrow_inline(Remainder16* dst, int64_t i, float x) {
  reinterpret_cast<uint16_t*>(dst)[i] = static_cast<uint16_t>(float_bits(x));
}

// Element i of a chunk's list (tile or memory), and its store.
template <typename T>
inline float read_element(void* base, const float* p, int64_t off, int64_t i) {
  if constexpr (kInlineType<T>) {
    return widen_inline(static_cast<const T*>(base) + off, i);
  } else {
    return p[i];
  }
}
template <typename T, bool Exact = false>
inline void write_element(void* base, float* p, int64_t off, int64_t i, float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && Exact) {
    narrow_exact(static_cast<T*>(base) + off, i, x);
  } else if constexpr (kInlineType<T>) {
    narrow_inline(static_cast<T*>(base) + off, i, x);
  } else {
    p[i] = x;
  }
}

// NOTE: [CPU lanes]
// A float sum (the l2norm) is a reduction the compiler may not reorder, so it would not
// vectorise: for such states the element loop runs in groups of kLanes with one accumulator
// per lane, merged in order at the end of the chunk (deterministic for a given chunk size).
// Every other op runs a plain loop, which the loop vectoriser handles (integer |= reductions
// included); the lanes would only get in its way.
constexpr int kLanes = 16;
static_assert(tile_elements(64) % kLanes == 0, "NOTE: [Tile size]");

template <typename State>
constexpr int lanes_for() {
  return std::is_same_v<State, SumSquaresState> ? kLanes : 1;
}

// StoreGrad: NOTE: [Unscaled gradients after the step] (optimizer_ops.h): the gradient list
// (list 0) is stored back unscaled in the element loop, from the raw gradient the functor left
// in v[0]. run_chunk picks the loop per chunk from the op's run-time store_grad, so a step
// without it runs a loop that stores nothing more.
template <typename Op, bool StoreGrad, typename... T, size_t... D>
inline void run_chunk_plain(const std::array<void*, sizeof...(T)>& base,
                      const std::array<const float*, Op::tensor_scalars>& tensor_scalars,
                      int64_t begin, int64_t end, Op op, typename Op::State& state,
                      uint32_t half_lists, std::index_sequence<D...>) {
  constexpr int Depth = sizeof...(T);
  using State = typename Op::State;
  constexpr int64_t kTile = tile_elements(Depth);
  alignas(64) float tile[Depth][kTile];
  op.load_scalars();
  if constexpr (Op::tensor_scalars > 0) op.load_tensor_scalars(tensor_scalars.data());
  if (op.skip()) return;
  constexpr int L = lanes_for<State>();
  State lanes[L];
  for (int l = 0; l < L; ++l) lanes[l] = State{};
  // fp32 lists are used where they lie; fp16 lists are converted through a float tile, bf16 and
  // remainder lists element by element (NOTE: [CPU inline conversions]).
  const bool staged[Depth] = {staged_list<T>(half_lists, D)...};
  for (int64_t off = begin; off < end; off += kTile) {
    const int64_t n = end - off < kTile ? end - off : kTile;
    float* p[Depth] = {(staged[D]        ? tile[D]
                        : kInlineType<T> ? nullptr
                                         : reinterpret_cast<float*>(base[D]) + off)...};
    ((((Op::read_mask >> D) & 1u) && staged[D] ? load_staged<T>(base[D], off, tile[D], n)
                                                : (void)0),
     ...);
    int64_t i = 0;
    // NOTE: [In place] An output list may be an input list (exactly the same memory; partial
    // overlaps are rejected by the op's checks). Element i is read before it is written and no
    // other element depends on it, so there is no loop-carried dependence: ivdep keeps the
    // compiler from falling back to scalar code when its alias check sees the overlap.
    if constexpr (L > 1) {
#pragma GCC ivdep
      for (; i + L <= n; i += L) {
#pragma GCC unroll 16
        for (int l = 0; l < L; ++l) {
          float v[Depth] = {
              (((Op::read_mask >> D) & 1u) ? read_element<T>(base[D], p[D], off, i + l) : 0.0f)...};
          apply_op(op, v, lanes[l], off + i + l);
          ((((Op::write_mask >> D) & 1u) ? write_element<T, ((Op::exact_mask >> D) & 1u) != 0>(
                                               base[D], p[D], off, i + l, v[D])
                                         : (void)0),
           ...);
          if constexpr (StoreGrad) {
            write_element<GradType<T...>>(base[0], p[0], off, i + l, op.unscaled_grad(v[0]));
          }
        }
      }
    }
#pragma GCC ivdep
    for (; i < n; ++i) {
      float v[Depth] = {
          (((Op::read_mask >> D) & 1u) ? read_element<T>(base[D], p[D], off, i) : 0.0f)...};
      // (The functors hash the index's low 32 bits: passed as such, the loop keeps no vector
      // of 64-bit indices.)
      apply_op(op, v, lanes[0], static_cast<uint32_t>(off + i));
      ((((Op::write_mask >> D) & 1u)
            ? write_element<T, ((Op::exact_mask >> D) & 1u) != 0>(base[D], p[D], off, i, v[D])
            : (void)0),
       ...);
      if constexpr (StoreGrad) {
        write_element<GradType<T...>>(base[0], p[0], off, i, op.unscaled_grad(v[0]));
      }
    }
    ((((Op::write_mask >> D) & 1u) && staged[D] ? store_staged<T>(tile[D], base[D], off, n)
                                                 : (void)0),
     ...);
    if constexpr (StoreGrad) {
      if (staged[0]) store_staged<GradType<T...>>(tile[0], base[0], off, n);
    }
  }
  for (int l = 0; l < L; ++l) state.merge(lanes[l]);
}

// NOTE: [8-bit moments] (block_quant.h) on the CPU: per block of kQBlock elements, phase 1 runs
// the functor once per element, stores what is not quantized (weights, remainders, grads) and
// keeps the new moments in a float scratch; phase 2 encodes them with the block's new absmax.
// Elements are converted one at a time (the same bits as the tiles: NOTE: [fp16 NaN bits]).
template <typename L>
inline float q8_cpu_read(void* base, const float (*scratch)[kQBlock], int64_t i, int64_t j,
                         int q) {
  if constexpr (is_q8<L>) {
    return scratch[q][j];  // (decoded into the scratch before the element loop)
  } else if constexpr (std::is_same_v<L, float>) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kInlineType<L>) {
    return widen_inline(static_cast<const L*>(base), i);
  } else {
    return half_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <typename L, bool Exact = false>
inline void q8_cpu_write(void* base, float (*scratch)[kQBlock], int64_t i, int64_t j, int q,
                         float x) {
  if constexpr (is_q8<L>) {
    scratch[q][j] = x;
  } else if constexpr (std::is_same_v<L, float>) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (std::is_same_v<L, c10::BFloat16> && Exact) {
    narrow_exact(static_cast<L*>(base), i, x);
  } else if constexpr (kInlineType<L>) {
    narrow_inline(static_cast<L*>(base), i, x);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_half(x);
  }
}

// The block's old codes, decoded into the scratch in a loop of their own (it vectorises; inside
// the element loop the byte loads kept the whole loop scalar).
template <typename L>
inline void q8_cpu_decode(void* base, float (*scratch)[kQBlock], int64_t off, int64_t n,
                          const float* units, int q) {
  if constexpr (is_q8<L>) {
    const uint8_t* codes = static_cast<const uint8_t*>(base) + off;
    const float unit = units[q];
    float* out = scratch[q];
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) out[j] = L::decode(codes[j], unit);
  }
}

// The block's absmax, an integer max over the bits (Q8::magnitude_bits): it vectorises (a float
// max with NaN semantics did not: a chain through memory cost more than the step's math), and
// max is exact and order-free, so the grid's serial fold gives the same value.
template <typename L>
inline void q8_cpu_absmax(const float (*scratch)[kQBlock], int64_t n, float* absmax, int q) {
  if constexpr (is_q8<L>) {
    const float* src = scratch[q];
    uint32_t m = 0;
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t a = L::magnitude_bits(src[j]);
      m = a > m ? a : m;
    }
    absmax[q] = bits_float(m);
  }
}

template <typename L, typename Op>
inline void q8_cpu_encode(const Op& op, void* base, const float (*scratch)[kQBlock], int64_t off,
                          int64_t n, const float* inv_units, int q) {
  if constexpr (is_q8<L>) {
    uint8_t* codes = static_cast<uint8_t*>(base) + off;
    const float inv = inv_units[q];
    const float* src = scratch[q];
    uint32_t key = 0;
    if constexpr (Op::q8_stochastic) key = op.moment_rounding.key;
    // (ivdep: the byte stores may alias anything as far as the compiler knows; without it the
    // loop stayed scalar.)
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {
      codes[j] = static_cast<uint8_t>(
          L::encode(src[j], inv, q8_round_add<Op, L>(key, static_cast<uint32_t>(off + j))));
    }
  }
}

template <typename Op, typename... T, size_t... D>
inline void run_chunk_q8(const std::array<void*, sizeof...(T)>& base,
                         const std::array<const float*, Op::tensor_scalars>& tensor_scalars,
                         int64_t begin, int64_t end, Op op, typename Op::State& state,
                         std::index_sequence<D...>) {
  constexpr int Depth = sizeof...(T);
  constexpr int NQ = q8_count<T...>;
  op.load_scalars();
  op.load_tensor_scalars(tensor_scalars.data());
  if (op.skip()) return;
  float* scales[NQ];
  for (int q = 0; q < NQ; ++q) {
    scales[q] = const_cast<float*>(tensor_scalars[Op::tensor_scalars - NQ + q]);
  }
  alignas(64) float scratch[NQ][kQBlock];
  const auto lists = std::index_sequence<D...>{};
  for (int64_t off = begin; off < end; off += kQBlock) {
    const int64_t n = end - off < kQBlock ? end - off : kQBlock;
    const int64_t block = off / kQBlock;
    float units[NQ], inv_units[NQ], absmax[NQ];
    for (int q = 0; q < NQ; ++q) absmax[q] = scales[q][block];
    q8_units<T...>(absmax, units, inv_units, lists);
    (q8_cpu_decode<T>(base[D], scratch, off, n, units, q8_index<D, T...>()), ...);
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {  // phase 1
      const int64_t i = off + j;
      float v[Depth] = {(((Op::read_mask >> D) & 1u)
                             ? q8_cpu_read<T>(base[D], scratch, i, j, q8_index<D, T...>())
                             : 0.0f)...};
      apply_op(op, v, state, static_cast<uint32_t>(i));  // (as in run_chunk_plain)
      ((((Op::write_mask >> D) & 1u)
            ? q8_cpu_write<T, ((Op::exact_mask >> D) & 1u) != 0>(base[D], scratch, i, j,
                                                                   q8_index<D, T...>(), v[D])
            : (void)0),
       ...);
    }
    if constexpr (Op::stores_grad) {  // (per block, after phase 1; never an 8-bit list)
      if (op.store_grad) {
        using G = GradType<T...>;
        for (int64_t j = 0; j < n; ++j) {
          q8_cpu_write<G>(base[0], scratch, off + j, j, 0,
                          op.unscaled_grad(q8_cpu_read<G>(base[0], scratch, off + j, j, 0)));
        }
      }
    }
    for (int q = 0; q < NQ; ++q) absmax[q] = 0.0f;
    (q8_cpu_absmax<T>(scratch, n, absmax, q8_index<D, T...>()), ...);
    q8_units<T...>(absmax, units, inv_units, lists);
    (q8_cpu_encode<T>(op, base[D], scratch, off, n, inv_units, q8_index<D, T...>()),
     ...);  // phase 2
    for (int q = 0; q < NQ; ++q) scales[q][block] = absmax[q];
  }
}

// NOTE: [Finiteness from the bits] (elementwise_ops.h): an fp16 or bf16 element is non-finite
// exactly when its exponent bits are all ones; the loop ors 32 such tests per AVX-512 vector.
inline int nonfinite_bits(const uint16_t* bits, int64_t n, uint16_t exponent) {
  int nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) nonfinite |= (bits[i] & exponent) == exponent;
  return nonfinite;
}

template <typename Op, typename... T, size_t... D>
inline void run_chunk(const std::array<void*, sizeof...(T)>& base,
                      const std::array<const float*, Op::tensor_scalars>& tensor_scalars,
                      int64_t begin, int64_t end, Op op, typename Op::State& state,
                      uint32_t half_lists, std::index_sequence<D...> lists) {
  if constexpr (Op::observes_finiteness_only) {
    using L = GradType<T...>;
    const auto* bits = static_cast<const uint16_t*>(base[0]) + begin;
    if constexpr (std::is_same_v<L, c10::BFloat16>) {
      state.nonfinite |= nonfinite_bits(bits, end - begin, 0x7f80);
      return;
    } else if constexpr (kTiledType<L>) {
      if (half_lists & 1u) {
        state.nonfinite |= nonfinite_bits(bits, end - begin, 0x7c00);
        return;
      }
    }
  }
  if constexpr (q8_count<T...> > 0) {
    run_chunk_q8<Op, T...>(base, tensor_scalars, begin, end, op, state, lists);
  } else if constexpr (Op::stores_grad) {
    if (op.store_grad) {
      run_chunk_plain<Op, true, T...>(base, tensor_scalars, begin, end, op, state, half_lists,
                                      lists);
    } else {
      run_chunk_plain<Op, false, T...>(base, tensor_scalars, begin, end, op, state, half_lists,
                                       lists);
    }
  } else {
    run_chunk_plain<Op, false, T...>(base, tensor_scalars, begin, end, op, state, half_lists,
                                     lists);
  }
}

// Runs `op` over every element of every tensor. Results per chunk go to `sink`, indexed by
// global chunk (see NOTE: [Chunking]), exactly as the CUDA blocks leave them. `half_lists`: the
// TiledList lists that hold fp16 (NOTE: [CPU tiled lists]).
template <typename Op, typename... T>
void apply(const HostTensorLists<sizeof...(T), Op::tensor_scalars>& lists, int64_t chunk_size,
           const Op& op, const BlockSink& sink, uint32_t half_lists) {
  const std::vector<int64_t> offsets = chunk_offsets(lists.numels, chunk_size);
  const int64_t total_chunks = offsets.back();
  if (total_chunks == 0) return;
  // chunk -> tensor, so that a task can start anywhere in the global chunk order.
  const std::vector<int32_t> chunk_tensor = chunk_owners(offsets);
  int64_t total_elements = 0;
  for (int64_t n : lists.numels) total_elements += n;
  // NOTE: [CPU task size] Tasks of at least 512K elements: these passes are memory-bound, so a
  // second thread pays off only on large lists, and every parallel region costs a wake-up of the
  // worker threads (milliseconds when another process holds the other core). Small lists run on
  // the calling thread; many tiny tensors are batched into one task.
  const int64_t avg = total_elements / total_chunks;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 19) / std::max<int64_t>(avg, 1));

  std::atomic<int> any_nonfinite{0};
  // One byte per chunk, so that threads never write the same per-tensor flag.
  std::vector<uint8_t> chunk_nonfinite(sink.per_tensor_flags != nullptr ? total_chunks : 0, 0);
  at::parallel_for(0, total_chunks, grain, [&](int64_t first, int64_t last) {
    int nonfinite = 0;
    for (int64_t c = first; c < last; ++c) {
      const int32_t t = chunk_tensor[c];
      const int64_t begin = (c - offsets[t]) * chunk_size;
      const int64_t end = std::min(begin + chunk_size, lists.numels[t]);
      typename Op::State state{};
      std::array<const float*, Op::tensor_scalars> scalars{};
      if constexpr (Op::tensor_scalars > 0) scalars = lists.scalars[t];
      run_chunk<Op, T...>(lists.ptrs[t], scalars, begin, end, op, state, half_lists,
                          std::make_index_sequence<sizeof...(T)>{});
      if constexpr (std::is_same_v<typename Op::State, FiniteState>) {
        nonfinite |= state.nonfinite;
        if (!chunk_nonfinite.empty()) chunk_nonfinite[c] = static_cast<uint8_t>(state.nonfinite);
      } else if constexpr (std::is_same_v<typename Op::State, SumSquaresState>) {
        sink.partials[c] = state.sumsq;
      }
    }
    if (nonfinite) any_nonfinite.store(1, std::memory_order_relaxed);
  });
  if (any_nonfinite.load() && sink.found_inf != nullptr) *sink.found_inf = 1.0f;
  for (size_t c = 0; c < chunk_nonfinite.size(); ++c) {
    if (chunk_nonfinite[c]) sink.per_tensor_flags[chunk_tensor[c]] = 1.0f;
  }
}

}  // namespace PEAK_CPU_CAPABILITY
}  // namespace cpu
}  // namespace peak
