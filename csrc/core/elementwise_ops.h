// The per-element math of every multi-tensor op, written once for CPU and CUDA.
//
// An op is a small struct with:
//   depth        number of tensor lists it walks (one element of each per call);
//   read_mask    bit d set: list d is loaded before the call;
//   write_mask   bit d set: list d is stored after the call;
//   State        per-thread (CUDA) or per-chunk (CPU) accumulator, see below;
//   load_scalars() reads per-step scalars that may live in device memory (once per block/chunk,
//                never inside the element loop, so the CPU loop keeps them in registers);
//   operator()(float* v, State& s)   the math, on float values of every list.
// Launchers (cpu_apply.h, grid_block.h) own loads, stores, dtype conversions and scheduling.
#pragma once

#include <cmath>

#include "host_device.h"

namespace peak {

// Accumulates "saw a non-finite value". An int, not a bool, so `|=` vectorises.
struct FiniteState {
  int nonfinite = 0;
  PEAK_HD void observe(float x) { nonfinite |= is_finite(x) ? 0 : 1; }
  PEAK_HD void merge(const FiniteState& o) { nonfinite |= o.nonfinite; }
};

// Sum of squares in fp32 (Apex and torch both accumulate norms in fp32).
struct SumSquaresState {
  float sumsq = 0.0f;
  PEAK_HD void merge(const SumSquaresState& o) { sumsq += o.sumsq; }
};

// A per-step scalar given either as a value or as a pointer to a float in the tensors' memory
// space (a device tensor on CUDA: no host sync to read it).
struct StepScalar {
  const float* ptr = nullptr;
  float value = 0.0f;
  PEAK_HD void load() {
    if (ptr != nullptr) value = *ptr;
  }
};

// Defaults for the optional parts of the op interface:
//   tensor_scalars          how many per-tensor scalars (pointers) the op reads, e.g. a step count;
//   load_tensor_scalars(p)  reads them (once per block/chunk);
//   skip()                  true when the whole step is to be skipped (device-side found_inf):
//                           checked before any element is touched.
struct OpDefaults {
  static constexpr int tensor_scalars = 0;
  // An op that needs each element's index within its tensor (the random bits of stochastic
  // rounding) sets this and takes the index as operator()'s third argument.
  static constexpr bool indexed = false;
  // 8-bit exp_avg_sq codes round stochastically, keyed by `moment_rounding` (block_quant.h).
  static constexpr bool q8_stochastic = false;
  // The master list holds 16-bit remainders (NOTE: [Remainder masters]).
  static constexpr bool remainder_master = false;
  // NOTE: [Exact stores] Lists whose written values the op has already rounded to their bf16
  // storage (a split master's weight, a stochastically rounded moment or weight): the launchers
  // store them by truncation, which gives the bits the round-to-nearest store would (a NaN
  // still stores as 0x7fc0) with fewer operations per element.
  static constexpr unsigned exact_mask = 0;
  // NOTE: [Unscaled gradients after the step] (optimizer_ops.h): an op that can write its
  // gradient list (list 0) back unscaled sets this and has a run-time `store_grad` and
  // `unscaled_grad(g)`; the launchers store list 0 when store_grad is set, outside write_mask.
  static constexpr bool stores_grad = false;
  // bf16 weights stepped without masters and rounded stochastically (AdamOp, SgdOp): such an op
  // is launched for bf16 params only.
  static constexpr bool rounded_weights = false;
  // NOTE: [Finiteness from the bits] An op whose only effect is to observe whether list 0 holds a
  // non-finite value (CheckFiniteOp) sets this: a launcher may then test a 16-bit list's exponent
  // bits instead of widening every element (fp16 and bf16 widen inf/NaN to inf/NaN and finite
  // values to finite ones, so the flag is the same); the CPU launcher does, which makes the
  // check of fp16/bf16 gradients one read of them.
  static constexpr bool observes_finiteness_only = false;
  PEAK_HD void load_tensor_scalars(const float* const*) {}
  PEAK_HD bool skip() const { return false; }
};

// How the launchers call an op on one element (`index`: its position in its tensor).
template <typename Op>
PEAK_HD void apply_op(const Op& op, float* v, typename Op::State& s, int64_t index) {
  if constexpr (Op::indexed) {
    op(v, s, index);
  } else {
    op(v, s);
  }
}

// Reads one element of every list and reports non-finite values; writes nothing.
struct CheckFiniteOp : OpDefaults {
  static constexpr int depth = 1;
  static constexpr bool observes_finiteness_only = true;
  static constexpr unsigned read_mask = 0b1;
  static constexpr unsigned write_mask = 0b0;
  using State = FiniteState;
  PEAK_HD void load_scalars() {}
  PEAK_HD void operator()(float* v, State& s) const { s.observe(v[0]); }
};

// out = in * scale; observes `in` (before scaling, as Apex and torch do). In place (InPlace:
// `in` is written over) the op is one list, so that a launch holds as many tensors as a one-list
// kernel can (NOTE: [Launch metadata budget]: 136 against 106 for two lists): a fifth fewer
// launches for an unscale over many small gradients.
template <bool InPlace>
struct ScaleOpOf : OpDefaults {
  static constexpr int depth = InPlace ? 1 : 2;
  static constexpr unsigned read_mask = 0b01;
  static constexpr unsigned write_mask = InPlace ? 0b01 : 0b10;
  using State = FiniteState;
  StepScalar scale;

  PEAK_HD void load_scalars() { scale.load(); }
  PEAK_HD void operator()(float* v, State& s) const {
    s.observe(v[0]);
    v[depth - 1] = v[0] * scale.value;
  }
};
using ScaleOp = ScaleOpOf<false>;
using ScaleInPlaceOp = ScaleOpOf<true>;

// Which inputs of axpby report non-finite values (bit 0: x, bit 1: y).
enum AxpbyCheck : int { kCheckNone = 0, kCheckX = 1, kCheckY = 2, kCheckBoth = 3 };

// out = a*x + b*y. fmaf pins the rounding (one rounding of a*x, fused with b*y's product sum)
// so CPU and CUDA give the same bits whatever each compiler would contract on its own.
struct AxpbyOp : OpDefaults {
  static constexpr int depth = 3;
  static constexpr unsigned read_mask = 0b011;
  static constexpr unsigned write_mask = 0b100;
  using State = FiniteState;
  StepScalar a;
  StepScalar b;
  int check = kCheckBoth;

  PEAK_HD void load_scalars() {
    a.load();
    b.load();
  }
  PEAK_HD void operator()(float* v, State& s) const {
    if (check & kCheckX) s.observe(v[0]);
    if (check & kCheckY) s.observe(v[1]);
    v[2] = fmaf(b.value, v[1], a.value * v[0]);
  }
};

// Partial sums of squares for l2norm.
struct SumSquaresOp : OpDefaults {
  static constexpr int depth = 1;
  static constexpr unsigned read_mask = 0b1;
  static constexpr unsigned write_mask = 0b0;
  using State = SumSquaresState;

  PEAK_HD void load_scalars() {}
  PEAK_HD void operator()(float* v, State& s) const { s.sumsq = fmaf(v[0], v[0], s.sumsq); }
};

}  // namespace peak
