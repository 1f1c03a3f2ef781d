// The dynamic loss-scale update: one implementation for the Apex dialect (amp.scale_loss) and the
// torch dialect (GradScaler), run on the host for CPU state and by a one-thread kernel for CUDA
// state, so a training step never has to read the scale back to the host.
#pragma once

#include <cmath>

#include "host_device.h"

namespace peak {

struct LossScaleParams {
  double growth_factor;
  double backoff_factor;
  int growth_interval;
  int hysteresis;     // consecutive overflows tolerated before backing off (1 = back off at once)
  double min_scale;   // floor applied on backoff (0 = none)
  double max_scale;   // ceiling applied on growth (inf = none)
};

// NOTE: [The scale never reaches zero] Without a min_scale, about 150 overflows in a row back an
// fp32 scale of 2^16 off to 0; the next loss times 0 has zero gradients, which pass the inf/NaN
// check, and unscaling them by 1/0 writes NaN into the weights (torch's scaler does so). So a
// backoff stops at the smallest normal float, 2^-126 (or where the scale is, if it is lower).

// With hysteresis = 1, min_scale = 0 and max_scale = inf this is exactly torch._amp_update_scale_
// (but for the floor above): back off on overflow; after `growth_interval` clean updates in a row
// grow, computed in double, stored only if finite. Apex's LossScaler is the same algorithm with
// growth 2, backoff 0.5, interval 2000 and its min/max. The hysteresis tracker follows Apex's
// update_scale_hysteresis: it counts down on overflow and is refilled by any clean update.
PEAK_HD void update_loss_scale(float* scale, int* growth_tracker, int* hysteresis_tracker,
                               const float* found_inf, const LossScaleParams p) {
  if (*found_inf != 0.0f) {
    int remaining = 0;
    if (hysteresis_tracker != nullptr) {
      remaining = *hysteresis_tracker - 1;
      *hysteresis_tracker = remaining > 0 ? remaining : 0;
    }
    if (remaining <= 0) {
      double backed_off = static_cast<double>(*scale) * p.backoff_factor;
      if (backed_off < p.min_scale) backed_off = p.min_scale;
      constexpr double kSmallestNormalFloat = 1.1754943508222875e-38;  // 2^-126
      if (backed_off < kSmallestNormalFloat) {
        backed_off = *scale < kSmallestNormalFloat ? *scale : kSmallestNormalFloat;
      }
      *scale = static_cast<float>(backed_off);
    }
    *growth_tracker = 0;
    return;
  }
  if (hysteresis_tracker != nullptr) *hysteresis_tracker = p.hysteresis;
  const int successful = *growth_tracker + 1;
  if (successful == p.growth_interval) {
    double grown = static_cast<double>(*scale) * p.growth_factor;
    if (grown > p.max_scale) grown = p.max_scale;
    const float grown_f = static_cast<float>(grown);
    if (is_finite(grown_f)) *scale = grown_f;
    *growth_tracker = 0;
  } else {
    *growth_tracker = successful;
  }
}

}  // namespace peak
