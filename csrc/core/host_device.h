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

}  // namespace peak
