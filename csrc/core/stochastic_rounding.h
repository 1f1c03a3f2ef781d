// Stochastic rounding of fp32 values to bf16, for optimizers that step bf16 weights directly.
//
// NOTE: [Stochastic rounding to bf16]
// Without master weights, a bf16 weight whose update is smaller than half its ulp never moves
// under round-to-nearest: the update is lost, step after step (at 1.0 the ulp is 2^-7, so an
// Adam step of lr = 1e-3 vanishes). Rounding up with probability equal to the discarded
// fraction of an ulp, and down otherwise, makes the stored weight right on average, so small
// updates accumulate. On the bits: adding a uniform 16-bit random number to the fp32 pattern and
// truncating the low 16 bits does exactly that, for either sign (the pattern is sign-magnitude),
// and a carry into the exponent gives the next binade's value. inf and NaN are passed through
// (the store's round-to-nearest keeps them), so a non-finite weight stays non-finite.
//
// The random bits are a hash of the element's index in its tensor, its new fp32 weight and its
// raw gradient, keyed by a per-optimizer seed and the tensor's step count: no generator state,
// so a resumed run continues bit-for-bit and CPU, the emulated grid and CUDA agree however the
// work is split. The index keeps equal elements of one tensor (a vector of ones with equal
// gradients) from rounding all alike, which would make the whole tensor one random walk; the
// data tells tensors apart.
#pragma once

#include "host_device.h"

namespace peak {

// A 32-bit integer finaliser with full avalanche ("lowbias32", C. Wellons' hash-prospector).
PEAK_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// x rounded to a bf16 value (returned as the float holding it), up with probability equal to
// the fraction of an ulp that truncation would drop; `random`'s low 16 bits decide.
PEAK_HD float stochastic_round_bf16(float x, uint32_t random) {
  const float rounded = bits_float((float_bits(x) + (random & 0xFFFFu)) & 0xFFFF0000u);
  return is_finite(x) ? rounded : x;
}

// The options of the optimizer functors: off, or on with a seed.
struct StochasticRounding {
  bool on = false;
  uint32_t seed = 0;
  uint32_t key = 0;  // per tensor: seed and step count

  PEAK_HD void load_step(float step) { key = mix32(seed ^ mix32(float_bits(step))); }
  // The value to store for the new weight w of element `index` (grad: its raw gradient).
  PEAK_HD float round(float w, float grad, int64_t index) const {
    if (!on) return w;
    const uint32_t data = mix32(float_bits(w) ^ mix32(float_bits(grad) ^ key));
    return stochastic_round_bf16(w, mix32(data + static_cast<uint32_t>(index)));
  }
};

}  // namespace peak
