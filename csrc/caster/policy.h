// The O1 caster's policy tables: op identity (the Python callable torch code calls, e.g.
// torch.mm, torch.Tensor.__add__) -> cast policy. See docs/caster.md.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

namespace peak::caster {

enum class Policy : uint8_t {
  kNone = 0,          // not listed: call straight through
  kLower = 1,         // cast floating args (f32/f16/bf16) to the low dtype (weights cached)
  kFp32 = 2,          // cast f16/bf16 args to float32
  kPromote = 3,       // mixed f16/bf16/f32 args: cast them all to float32
  kSequencePromote = 4,  // the same for the elements of the first (sequence) argument
  kBanned = 5,        // error on low-precision args unless allow_banned (then kFp32)
  kInplaceFp32 = 6,   // in-place twin of an fp32 op: error if self is low precision
  kMatchSelf = 7,     // in-place twin of a lower/promote op: cast the other args to self's dtype
};
constexpr int kNumPolicies = 8;
const char* policy_name(Policy p);

// One default entry: where the callable lives ("torch", "functional", "Tensor"), its name, policy.
struct DefaultEntry {
  const char* where;
  const char* name;
  Policy policy;
};
// Apex's O1 lists (spec apex_amp.md 3.3) plus the RNN entry points, expanded as Apex expands them
// (Tensor twins of the torch names, in-place derivations). Names missing in this torch are skipped.
std::vector<DefaultEntry> default_entries();

// Apex's error for a banned function called with fp16/bf16 tensors (Policy::kBanned).
extern const char kBannedMessage[];

// The table (process-wide, guarded by the GIL: every access is from Python).
Policy lookup(PyObject* func);
void set_policy(PyObject* func, Policy p);  // p == kNone removes
void clear_table();
std::vector<std::pair<PyObject*, Policy>> table_items();  // borrowed references

}  // namespace peak::caster
