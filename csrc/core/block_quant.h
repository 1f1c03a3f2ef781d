// 8-bit block-quantized moments: the storage formats and the two-phase block step.
//
// NOTE: [8-bit moments]
// A moment list may be stored as one uint8 code per element plus one fp32 scale per block of
// kQBlock = 256 consecutive elements of a tensor (the last block of a tensor may be short). The
// scale is the block's absmax of the *new* moment values (for exp_avg_sq: of v, whose square
// root is what is coded), so a block cannot be stored before all its elements are computed:
//   phase 1  decode the block's old codes with its old scale, run the optimizer's functor on each
//            element (the weight update uses the unquantized new moments, as bitsandbytes'),
//            and reduce the absmax of the new moments;
//   phase 2  encode the new moments with the new scale, store codes, scale, weights.
// The CPU launcher keeps phase 1's values in a 256-float scratch per moment (cpu_apply.h); the
// grid (CUDA and its CPU emulation) gives each block to a warp whose lanes keep their eight
// elements in registers, the absmax a max over the lanes (NOTE: [8-bit moments on the grid] in
// grid_block.h). Both run the functor once per element, so both launchers store the same bits.
//
// The maps are small floating-point formats relative to the block's absmax, computed with a few
// integer operations on float bits (no table, no search: they vectorise on the CPU and are exact
// on every launcher):
//   exp_avg     (Q8<3, 4, true, false>)  sign + 3 exponent + 4 mantissa bits of |m| / absmax:
//               8 binades (down to 2^-7 of the block's absmax; smaller values code as 0),
//               6.25% steps (3.1% error);
//   exp_avg_sq  (Q8<3, 5, false, true>)  3 exponent + 5 mantissa bits of sqrt(v) / sqrt(absmax):
//               sqrt(v) is what the update divides by, so its relative error (1.6% at most) is
//               what matters; 8 binades of sqrt(v) are 16 of v. A positive v never codes as 0
//               (it takes the smallest code): a zero denominator would turn m / (sqrt(v) + eps)
//               into m / eps.
// The formats were chosen by the error they put into Adam's update on a trained model's moments
// (examples/transformer_lm/q8_map_error.py, docs/core.md): E3M4 / E3M5-on-sqrt beat E4M3 /
// E4M4-on-sqrt by about 2x there; a linear map of v is the failure to avoid.
// Code 0 is the value 0 (the format's smallest level, 2^-7, is given up for it). exp_avg rounds
// to nearest (half up in magnitude), on the bits; exp_avg_sq rounds stochastically unless the
// optimizer asks for nearest (moment_rounding="nearest"): as for bf16 moments, v changes by
// 0.1% per step, far below half a code step (1.6% of sqrt(v)), and a block's absmax carries only the changes
// common to the block; an element whose gradient shrinks while its neighbours' do not would
// keep its old code (measured in docs/core.md: 22x too large a v after 3,000 steps). The random
// bits are a stateless hash of the element's index and the step's key (q8_random), so every
// launcher and a resumed run draw the same. docs/core.md has the measurements behind the
// choices (against linear maps, and for stochastic rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "host_device.h"

namespace peak {

constexpr int kQBlock = 256;

template <int E, int M, bool Signed, bool Sqrt>
struct Q8 {
  uint8_t bits;
  static_assert(E + M + (Signed ? 1 : 0) == 8, "an 8-bit code");
  static constexpr bool is_signed = Signed, sqrt_coded = Sqrt;
  // The largest level, 1.1...1 (M ones) in binary, so that the absmax codes exactly.
  static constexpr float kTop = 2.0f - 1.0f / static_cast<float>(1 << M);
  static constexpr uint32_t kExpBias = 127u - ((1u << E) - 1u);  // exponent field of binade 0
  static constexpr uint32_t kMagMask = (1u << (E + M)) - 1u;

  // The block's scale as the unit the levels multiply (decode) and its inverse (encode).
  PEAK_HD static float coded_scale(float absmax) { return Sqrt ? sqrtf(absmax) : absmax; }
  PEAK_HD static float unit(float absmax) { return coded_scale(absmax) * (1.0f / kTop); }
  PEAK_HD static float inv_unit(float absmax) {
    const float s = coded_scale(absmax);
    return s > 0.0f ? kTop / s : 0.0f;
  }
  // The block's absmax is taken of |x| (v >= 0 anyway), compared as bits: for non-negative
  // floats the unsigned order of the bits is the order of the values (a NaN compares above
  // every number, so it reaches the scale), and an integer max reduction vectorises.
  PEAK_HD static uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

  PEAK_HD static float decode(uint32_t code, float unit) {
    const uint32_t q = code & kMagMask;
    const uint32_t bits = (q << (23 - M)) + (kExpBias << 23);
    float mag = (q == 0u ? 0.0f : bits_float(bits)) * unit;
    if constexpr (Sqrt) mag = mag * mag;
    if constexpr (Signed) return bits_float(float_bits(mag) ^ ((code & 0x80u) << 24));
    return mag;
  }

  // Round to nearest (half up in magnitude) on the bits of x / unit.
  static constexpr uint32_t kNearest = 1u << (22 - M);
  // Stochastic rounding instead: the bits added below the code's last mantissa bit are random.
  PEAK_HD static uint32_t stochastic(uint32_t random) { return random & ((1u << (23 - M)) - 1u); }

  PEAK_HD static uint32_t encode(float x, float inv_unit, uint32_t round_add = kNearest) {
    float a = Sqrt ? sqrtf(x) : fabsf(x);
    float t = a * inv_unit;
    t = t < kTop ? t : kTop;  // (rounding may overshoot the top by an ulp; NaN codes as the top)
    // The code is the rounded value's exponent (rebiased to binade 0) and top M mantissa bits,
    // i.e. its bits shifted down less the bias; below binade 0 it is 0.
    const uint32_t f = float_bits(t) + round_add;
    uint32_t q = f < (kExpBias << 23) ? 0u : (f >> (23 - M)) - (kExpBias << M);
    // A positive v never codes as 0 (see the NOTE). a > 0 is compared on the bits (a = sqrt(x)
    // is >= 0 or NaN): a float compare among the integer ones kept the CPU loop scalar.
    if constexpr (!Signed) q = (q == 0u && float_bits(a) - 1u < 0x7f800000u) ? 1u : q;
    if constexpr (Signed) q |= (x < 0.0f) ? 0x80u : 0u;
    return q;
  }
};

using Q8ExpAvg = Q8<3, 4, true, false>;
using Q8ExpAvgSq = Q8<3, 5, false, true>;

template <typename T>
struct IsQ8 : std::false_type {};
template <int E, int M, bool S, bool R>
struct IsQ8<Q8<E, M, S, R>> : std::true_type {};
template <typename T>
constexpr bool is_q8 = IsQ8<T>::value;

template <typename... T>
constexpr int q8_count = (0 + ... + (is_q8<T> ? 1 : 0));

// The position of list D among the quantized lists (its scale's index).
template <int D, typename... T>
constexpr int q8_index() {
  constexpr bool flags[] = {is_q8<T>..., false};
  int n = 0;
  for (int d = 0; d < D; ++d) n += flags[d] ? 1 : 0;
  return n;
}

// The random bits of element `index` of a tensor for a key from the seed and its step count.
PEAK_HD uint32_t q8_random(uint32_t key, int64_t index) {
  uint32_t h = key ^ (static_cast<uint32_t>(index) * 0x9E3779B9u);
  h ^= h >> 16;  // (murmur3's finalizer, as mix32 in stochastic_rounding.h)
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// How list L's codes round for an op: stochastically for exp_avg_sq when the op asks.
// (`key`: the op's moment_rounding.key, read once outside the element loop: read inside it, the
// CPU loop did not vectorise.)
template <typename Op, typename L>
PEAK_HD uint32_t q8_round_add(uint32_t key, int64_t index) {
  if constexpr (Op::q8_stochastic && L::sqrt_coded) {
    return L::stochastic(q8_random(key, index));
  } else {
    return L::kNearest;
  }
}
template <typename Op, typename L>
PEAK_HD uint32_t q8_round_add(const Op& op, int64_t index) {
  if constexpr (Op::q8_stochastic) {
    return q8_round_add<Op, L>(op.moment_rounding.key, index);
  } else {
    return L::kNearest;
  }
}

template <typename Tuple>
struct TupleQ8Count;
template <typename... T>
struct TupleQ8Count<std::tuple<T...>> {
  static constexpr int value = q8_count<T...>;
};

}  // namespace peak
