// Portability macros so that one header of math compiles under g++ (CPU) and nvcc (CUDA).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PEAK_HD __host__ __device__ __forceinline__
#else
#define PEAK_HD inline
#endif

namespace peak {

// Storage types of the lists; the math always happens in float ("opmath", as in ATen).
template <typename T>
PEAK_HD float to_opmath(T x) {
  return static_cast<float>(x);
}

template <typename T>
PEAK_HD T from_opmath(float x) {
  return static_cast<T>(x);
}

// NOTE: [Finite test]
// (x - x) is 0 for every finite x and NaN for +-inf and NaN, so this is a branch-free
// isfinite that vectorises on CPU (std::isfinite often does not) and costs one FSUB on
// CUDA. It relies on IEEE semantics: never build the core with -ffast-math.
PEAK_HD bool is_finite(float x) {
  return (x - x) == 0.0f;
}

PEAK_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

PEAK_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// NOTE: [Remainder masters]
// A bf16 model can keep its fp32 masters as the 16 low bits the bf16 weight drops
// (TransformerEngine's and Megatron's `store_param_remainders`): (bf16 weight, int16 remainder)
// is exactly the fp32 master, for 2 bytes per parameter instead of 4. The rounding cannot be
// round-to-nearest-even: under RNE 65,537 fp32 patterns round to each even bf16 value (the
// two exact ties included) and only 65,536 remainders exist. So, as TE does, the weight is the
// master rounded half away from zero in magnitude: high = (bits >> 16) + bit 15 of the low half,
// and the low half is stored as it is; a set bit 15 of the remainder (a negative int16) says
// the high half was rounded up, and undoing the +1 rebuilds the master, for every bit pattern
// (arithmetic mod 2^16 on the high half). It differs from RNE only on exact ties of an even
// weight (low half 0x8000): the weight is one bf16 ulp larger in magnitude. docs/core.md has the
// count and the drift this causes against an fp32-master run.
//
// The launchers carry a remainder through the float element arrays as a float whose bit pattern
// is the 16 bits (a subnormal): only moved, never computed with (so flush-to-zero cannot touch
// it); the functor combines it with the weight's bits (master_from_remainder / split_master).
struct Remainder16 {
  uint16_t bits;
};

PEAK_HD float to_opmath(Remainder16 r) { return bits_float(r.bits); }

template <>
PEAK_HD Remainder16 from_opmath<Remainder16>(float x) {
  return Remainder16{static_cast<uint16_t>(float_bits(x) & 0xFFFFu)};
}

// The fp32 master from the bf16 weight (as a widened float) and its remainder carrier.
PEAK_HD float master_from_remainder(float weight, float remainder) {
  const uint32_t low = float_bits(remainder) & 0xFFFFu;
  const uint32_t high = (float_bits(weight) >> 16) - (low >> 15);
  return bits_float((high << 16) | low);
}

// The inverse: the bf16 weight (as a float with zero low bits) and the remainder carrier.
PEAK_HD void split_master(float master, float& weight, float& remainder) {
  const uint32_t bits = float_bits(master);
  const uint32_t low = bits & 0xFFFFu;
  weight = bits_float(((bits >> 16) + (low >> 15)) << 16);
  remainder = bits_float(low);
}

}  // namespace peak
