// The O1 caster's casting: argument trees cast as a policy says, the weight-cast cache, and the
// wrappers' call, which decides between O1's policy and an autocast region's edit.
// Internal to csrc/caster; see docs/caster.md.
#pragma once

#include <Python.h>

#include <vector>

#include "policy.h"
#include "state.h"

namespace peak::caster {

// `t` cast to `to` (a new tensor, visible to autograd); with `use_cache`, an fp32 leaf that
// requires grad goes through this thread's weight-cast cache (cache.cpp).
at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, bool use_cache);

// Whether torch's autocast is on for the device type of the first tensor in the arguments (an
// explicit autocast region, where O1 steps aside); `type`, if given, receives that device type.
bool in_autocast_region(PyObject* args, PyObject* kwargs, c10::DeviceType* type = nullptr);

// Cast the arguments as `p` says and call `func` with torch's autocast keys excluded (so
// torch.autocast, if also on, does not re-cast this op). New reference or nullptr.
// `g`: whose state casts (its low dtype, allow_banned; its own state may use the cache).
// `exclude_autocast=false` (decorated functions, not ops): the call keeps torch's autocast.
PyObject* apply_policy(Policy p, PyObject* func, PyObject* args, PyObject* kwargs, const Gate& g,
                       bool exclude_autocast = true);

// A cast made for a region edit: written back if the op wrote into it (`out=`, an in-place op).
struct Copy {
  PyObject* orig;  // borrowed: the call's arguments hold it
  at::Tensor cast;
  uint32_t version;
};
uint32_t version_of(const at::Tensor& t);

// A cast rule applied to every eligible tensor found in an argument tree (tree.cpp).
struct Rule {
  at::ScalarType to;
  bool use_cache;
  bool any_device = true;                       // else only tensors of `device`'s type
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<Copy>* copies = nullptr;          // region edits record their casts
};

// The tree `o` with its eligible tensors cast as `r` says (NOTE: [Argument trees]): a new
// reference, `o` itself when nothing inside changed; nullptr with a Python error set.
PyObject* cast_tree(PyObject* o, const Rule& r);

// The eligible floating dtypes in the tree, one bit each.
constexpr int kHalfBit = 1, kBf16Bit = 2, kFloatBit = 4;
void collect_dtypes(PyObject* o, int& bits);
inline bool mixed(int bits) { return bits != 0 && (bits & (bits - 1)) != 0; }

// The device type of the first tensor in `o` (depth first), if any.
bool first_device_type(PyObject* o, c10::DeviceType& out);

// Whether the call writes its input: `func` named as torch names an in-place op (`exp_`,
// `Tensor.add_`, `__iadd__`), or called with `inplace=True` (`F.relu`).
bool in_place_call(PyObject* func, PyObject* kwargs);

// What the op wrote into `copies`, copied back into the caller's tensors (write_back.cpp): returns
// `result`, or the caller's tensors where it returned a written copy (steals `result`).
PyObject* write_back(PyObject* result, const std::vector<Copy>& copies, bool in_place);

// The call of a wrapped torch callable (`orig`), vectorcall convention.
PyObject* patched_call(PyObject* orig, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames);

}  // namespace peak::caster
