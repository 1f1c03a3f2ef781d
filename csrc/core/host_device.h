// Portability macros so that one header of math compiles under g++ (CPU) and nvcc (CUDA).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PEAK_HD __host__ __device__ __forceinline__
#define PEAK_HD_ALWAYS_INLINE __host__ __device__ __forceinline__
#else
#define PEAK_HD inline
// Always inlined on the host: the CPU kernels are compiled once per CPU level (NOTE: [CPU levels]
// in csrc/ops/cpu_dispatch.cpp), and an out-of-line copy of a shared function would be one
// link-once symbol for every level.
#define PEAK_HD_ALWAYS_INLINE inline __attribute__((always_inline))
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

// NOTE: [fp16 NaN bits] The F16C/AVX-512 conversions keep a NaN's payload (quietened: the
// quiet bit set) both ways; c10's portable conversions, which c10 itself uses without F16C, store
// every NaN as 0x7e00, and CUDA's __float2half stores 0x7fff. So that every CPU level, the tail of
// a CPU tile (converted one element at a time), the emulated grid and the CUDA kernels give the
// same bits, these scalar conversions treat NaNs as F16C does. Otherwise they are c10's portable
// algorithm (from the FP16 library: exact, round to nearest even), written without branches so
// that the baseline level's loops vectorise with SSE2 (c10's scalar casts did not, and were ~9x
// slower than F16C). Every multiplication is by a power of two and no two operations may be
// contracted (NOTE: [No FP contraction]), so host and device round alike.
PEAK_HD_ALWAYS_INLINE float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Exponent rebiased by 0xE0 (so that inf/NaN land on 0xFF), then scaled by 2^-112.
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * bits_float(15u << 23);
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized);
  const uint32_t quiet_nan = 0x7fc00000u | ((two_w >> 4) & 0x007fe000u);
  return bits_float(sign | (two_w > 0xf8000000u ? quiet_nan : magnitude));
}

PEAK_HD_ALWAYS_INLINE uint16_t float_to_half(float f) {
  const uint32_t w = float_bits(f);
  const float magnitude = bits_float(w & 0x7fffffffu);
  const float scaled = (magnitude * bits_float(239u << 23)) * bits_float(17u << 23);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t exp_bits = shl1_w & 0xff000000u;
  const uint32_t bias = exp_bits < 0x71000000u ? 0x71000000u : exp_bits;
  const uint32_t bits = float_bits(bits_float((bias >> 1) + 0x07800000u) + scaled);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  const uint32_t quiet_nan = 0x7e00u | ((w >> 13) & 0x03ffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? quiet_nan : nonsign));
}

// The bf16 bits to store for the fp32 pattern `bits` whose high half is `high`: every NaN as
// 0x7fc0, as c10's host conversion stores it (its device conversion, __float2bfloat16, stores
// 0x7fff: the grid does not use it).
PEAK_HD_ALWAYS_INLINE uint16_t bf16_or_nan(uint32_t bits, uint32_t high) {
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>(high);
}

// fp32 -> bf16, round to nearest even (c10's rounding), NaN as above.
PEAK_HD_ALWAYS_INLINE uint16_t float_to_bf16(float x) {
  const uint32_t bits = float_bits(x);
  return bf16_or_nan(bits, (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16);
}

// NOTE: [Device conversions]
// The grid's loads and stores of fp16/bf16 (grid_block.h) give the bits of the conversions
// above, NaNs included, so the CUDA kernels store what the CPU launcher stores. On the device
// they are the hardware conversion (one cvt: round to nearest even, subnormals kept, as above)
// with the NaN case selected from the rule above: the integer emulation cost about 15
// instructions per element each way, a third of a memory-bound kernel's issue slots on an H100.
// (The emulated grid runs the host branch: the same bits by the rule.)
PEAK_HD float to_opmath(c10::Half x) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.x));
  const uint32_t h = x.x;
  const uint32_t nan = ((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x3ffu) << 13);
  return (h & 0x7fffu) > 0x7c00u ? bits_float(nan) : f;
#else
  return half_to_float(x.x);
#endif
}
PEAK_HD float to_opmath(c10::BFloat16 x) { return bits_float(static_cast<uint32_t>(x.x) << 16); }

template <>
PEAK_HD c10::Half from_opmath<c10::Half>(float x) {
#ifdef __CUDA_ARCH__
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  const uint32_t w = float_bits(x);
  const uint16_t nan = static_cast<uint16_t>(((w >> 16) & 0x8000u) | 0x7e00u | ((w >> 13) & 0x3ffu));
  return c10::Half((w & 0x7fffffffu) > 0x7f800000u ? nan : h, c10::Half::from_bits());
#else
  return c10::Half(float_to_half(x), c10::Half::from_bits());
#endif
}

template <>
PEAK_HD c10::BFloat16 from_opmath<c10::BFloat16>(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return c10::BFloat16(bf16_or_nan(float_bits(x), b), c10::BFloat16::from_bits());
#else
  return c10::BFloat16(float_to_bf16(x), c10::BFloat16::from_bits());
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
