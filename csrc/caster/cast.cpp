// The O1 caster's casting (cast.h); argument trees are walked in tree.cpp, the weight-cast cache
// is in cache.cpp. See docs/caster.md.
#include "cast.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace peak::caster {
namespace {

// NOTE: [Explicit autocast regions win]
// Code running under O1 may open its own torch.autocast (or peak.amp.autocast) region, e.g. an
// evaluation, teacher or baseline model in the same process, with its own dtype. Inside it the
// user asked for torch's rules, so the caster steps aside for ops on that region's device type
// and lets torch's autocast keys do the casting; everywhere else O1 casts as before.
bool any_autocast_enabled() {
  return at::autocast::is_autocast_enabled(c10::DeviceType::CPU) ||
         at::autocast::is_autocast_enabled(c10::DeviceType::CUDA) ||
         at::autocast::is_autocast_enabled(c10::DeviceType::XPU);
}
}  // namespace

bool in_autocast_region(PyObject* args, PyObject* kwargs, c10::DeviceType* type_out) {
  if (!any_autocast_enabled()) return false;  // the common case: one TLS read per device type
  c10::DeviceType type = c10::DeviceType::CPU;
  if (!first_device_type(args, type) && !(kwargs && first_device_type(kwargs, type))) {
    return false;
  }
  if (type_out) *type_out = type;
  return at::autocast::is_autocast_enabled(type);
}

namespace {

PyObject* func_name(PyObject* func) {
  PyObject* n = PyObject_GetAttrString(func, "__qualname__");
  if (!n) {
    PyErr_Clear();
    n = PyObject_Repr(func);
  }
  return n;
}

// The dtype of an `out=` argument (a tensor, or the first of a tuple/list), if eligible.
bool out_dtype(PyObject* out, at::ScalarType& dtype) {
  if ((PyTuple_Check(out) || PyList_Check(out)) && PySequence_Size(out) > 0) {
    out = PyTuple_Check(out) ? PyTuple_GET_ITEM(out, 0) : PyList_GET_ITEM(out, 0);
  }
  if (!THPVariable_Check(out)) return false;
  const at::Tensor& t = THPVariable_Unpack(out);
  if (!t.defined() || !eligible(t.scalar_type())) return false;
  dtype = t.scalar_type();
  return true;
}

// torch.Tensor.cpu (on Apex's fp32 list for CUDA tensors; a CPU tensor's .cpu() is itself).
bool is_cpu_of_cpu_tensor(PyObject* func, PyObject* args) {
  // TensorBase's descriptor: the one the tables hold (torch.Tensor's attribute may be our wrapper).
  static PyObject* tensor_cpu = [] {
    PyObject* c = PyImport_ImportModule("torch._C");
    PyObject* base = c ? PyObject_GetAttrString(c, "TensorBase") : nullptr;
    PyObject* cpu = base ? PyObject_GetAttrString(base, "cpu") : nullptr;
    Py_XDECREF(base);
    Py_XDECREF(c);
    if (!cpu) PyErr_Clear();
    return cpu;
  }();
  if (func != tensor_cpu || PyTuple_GET_SIZE(args) == 0) return false;
  PyObject* self = PyTuple_GET_ITEM(args, 0);
  return THPVariable_Check(self) && THPVariable_Unpack(self).is_cpu();
}

// Calls func(*args, **kwargs) with every eligible tensor cast to the dtype of `out=` (the caller
// chose the result's dtype), and `out` itself left alone: casting it would make the op write
// into a temporary copy, and the caller's buffer would never see the result.
PyObject* call_into_out(PyObject* func, PyObject* args, PyObject* kwargs, PyObject* out) {
  at::ScalarType to;
  if (!out_dtype(out, to)) return PyObject_Call(func, args, kwargs);
  const Rule rule{to, false};
  PyObject* new_args = cast_tree(args, rule);
  if (!new_args) return nullptr;
  PyObject* new_kwargs = PyDict_New();
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &k, &v)) {
    PyObject* c = v == out ? (Py_INCREF(v), v) : cast_tree(v, rule);
    if (!c || PyDict_SetItem(new_kwargs, k, c) < 0) {
      Py_XDECREF(c);
      Py_DECREF(new_kwargs);
      Py_DECREF(new_args);
      return nullptr;
    }
    Py_DECREF(c);
  }
  PyObject* result;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    result = PyObject_Call(func, new_args, new_kwargs);
  }
  Py_DECREF(new_args);
  Py_DECREF(new_kwargs);
  return result;
}

// NOTE: [Region edits]
// peak.amp.autocast(fp32_ops=..., lower_ops=...) pushes a region frame (state.h) on this thread's
// frames, and the wrappers of its callables are installed while it is open. A region edit acts
// where torch's autocast is on for the frame's device type and the call's first tensor is of that
// type (torch.autocast's own rule for which region an op belongs to), and there it wins over O1
// (which steps aside inside autocast regions: NOTE: [Explicit autocast regions win]). It casts
// the eligible tensors of that device type to float32 or to autocast's dtype for the device (read
// at the call, so an inner region's dtype counts), through the weight-cast cache when autocast's
// cache is enabled, and calls the op with torch's autocast off for the device (and its dispatch
// keys excluded), so torch does not cast again. What the op writes into a cast copy (an in-place
// op) is copied back into the caller's tensor, and the caller's tensor returned; `out=` keeps
// the caller's buffer (as for O1); batch and instance norm cast only their input, so that their
// running statistics are updated in place.

// The innermost region edit of func whose device type has torch's autocast on, if any.
const Frame* find_region(const FrameStack& frames, PyObject* func, Policy& out) {
  for (auto f = frames.rbegin(); f != frames.rend(); ++f) {
    if (!(*f)->region) continue;
    auto it = (*f)->policies.find(func);
    if (it != (*f)->policies.end() && at::autocast::is_autocast_enabled((*f)->device)) {
      out = it->second;
      return f->get();
    }
  }
  return nullptr;
}

struct AutocastOff {
  explicit AutocastOff(c10::DeviceType d) : device(d), was(at::autocast::is_autocast_enabled(d)) {
    at::autocast::set_autocast_enabled(device, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(device, was); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;
  c10::DeviceType device;
  bool was;
};

// NOTE: [Region edits]: a region's edit `p` (kFp32 or kLower) of `func`, called.
PyObject* apply_region(Policy p, const Frame& f, bool own, PyObject* func, PyObject* args,
                       PyObject* kwargs) {
  PyObject* out = kwargs ? PyDict_GetItemString(kwargs, "out") : nullptr;  // borrowed
  if (out && out != Py_None) return call_into_out(func, args, kwargs, out);
  const bool lower = p == Policy::kLower;
  const bool in_place = in_place_call(func, kwargs);  // (its copy is written: not a cached cast)
  std::vector<Copy> copies;
  const Rule rule{lower ? at::autocast::get_autocast_dtype(f.device) : at::ScalarType::Float,
                  own && lower && !in_place && at::autocast::is_autocast_cache_enabled(), false,
                  f.device, &copies};
  PyObject* new_args = nullptr;
  PyObject* new_kwargs = nullptr;
  if (f.input_only.count(func)) {  // only the input: args[0], or input=
    if (const Py_ssize_t n = PyTuple_GET_SIZE(args); n > 0) {
      PyObject* c = cast_tree(PyTuple_GET_ITEM(args, 0), rule);
      if (!c || !(new_args = PyTuple_New(n))) {
        Py_XDECREF(c);
        return nullptr;
      }
      PyTuple_SET_ITEM(new_args, 0, c);
      for (Py_ssize_t i = 1; i < n; ++i) {
        Py_INCREF(PyTuple_GET_ITEM(args, i));
        PyTuple_SET_ITEM(new_args, i, PyTuple_GET_ITEM(args, i));
      }
    } else if (PyObject* input = kwargs ? PyDict_GetItemString(kwargs, "input") : nullptr) {
      PyObject* c = cast_tree(input, rule);
      new_kwargs = c ? PyDict_Copy(kwargs) : nullptr;
      if (!new_kwargs || PyDict_SetItemString(new_kwargs, "input", c) < 0) {
        Py_XDECREF(c);
        Py_XDECREF(new_kwargs);
        return nullptr;
      }
      Py_DECREF(c);
    }
  } else {
    new_args = cast_tree(args, rule);
    if (!new_args) return nullptr;
    if (kwargs && !(new_kwargs = cast_tree(kwargs, rule))) {
      Py_DECREF(new_args);
      return nullptr;
    }
  }
  PyObject* result;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const AutocastOff off(f.device);
    result = PyObject_Call(func, new_args ? new_args : args, new_kwargs ? new_kwargs : kwargs);
  }
  Py_XDECREF(new_args);
  Py_XDECREF(new_kwargs);
  return write_back(result, copies, in_place);
}

// NOTE: [Nothing-to-cast fast path]
// Most calls of a listed op need no cast (a promote op seeing one floating dtype, an fp32 op given
// fp32): deciding that on the vectorcall's own arguments skips the general path's tuple and dict
// (bench_caster.py rows (a), (b)). `out=`, or an open torch autocast region, go the long way.
bool casts_nothing(Policy p, at::ScalarType low, PyObject* const* a, Py_ssize_t nargs,
                   PyObject* kwnames) {
  const int target = p == Policy::kFp32 ? kFloatBit
                     : p == Policy::kLower ? (low == at::ScalarType::Half ? kHalfBit : kBf16Bit)
                                           : 0;
  if ((p != Policy::kPromote && target == 0) || any_autocast_enabled()) return false;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  int bits = 0;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "out") == 0) return false;
  }
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) collect_dtypes(a[i], bits);
  return p == Policy::kPromote ? !mixed(bits) : (bits & ~target) == 0;
}

}  // namespace

// (cast.h)
PyObject* apply_policy(Policy p, PyObject* func, PyObject* args, PyObject* kwargs, const Gate& g,
                       bool exclude_autocast) {
  const at::ScalarType low = g.low;
  const bool own_state = g.own;
  PyObject* out = kwargs ? PyDict_GetItemString(kwargs, "out") : nullptr;  // borrowed
  if (out && out != Py_None && p != Policy::kBanned) return call_into_out(func, args, kwargs, out);
  if (p == Policy::kFp32 && is_cpu_of_cpu_tensor(func, args)) {
    return PyObject_Call(func, args, kwargs);
  }
  if (p == Policy::kBanned) {
    if (!g.allow_banned) {
      int bits = 0;
      collect_dtypes(args, bits);
      if (kwargs) collect_dtypes(kwargs, bits);
      if (bits & (kHalfBit | kBf16Bit)) {
        PyErr_SetString(PyExc_NotImplementedError, kBannedMessage);
        return nullptr;
      }
    }
    p = Policy::kFp32;
  }
  PyObject* new_args = nullptr;
  PyObject* new_kwargs = nullptr;
  Rule rule{at::ScalarType::Float, false};
  bool cast_all = true;  // apply `rule` to args and kwargs
  switch (p) {
    case Policy::kLower: rule = {low, own_state}; break;
    case Policy::kFp32: rule = {at::ScalarType::Float, false}; break;
    case Policy::kPromote: {
      int bits = 0;
      collect_dtypes(args, bits);
      if (kwargs) collect_dtypes(kwargs, bits);
      cast_all = mixed(bits);
      break;
    }
    case Policy::kSequencePromote: {
      cast_all = false;
      if (PyTuple_GET_SIZE(args) > 0) {
        PyObject* seq = PyTuple_GET_ITEM(args, 0);
        int bits = 0;
        if (PyTuple_Check(seq) || PyList_Check(seq)) collect_dtypes(seq, bits);
        if (mixed(bits)) {
          PyObject* c = cast_tree(seq, rule);
          if (!c) return nullptr;
          new_args = PyTuple_New(PyTuple_GET_SIZE(args));
          PyTuple_SET_ITEM(new_args, 0, c);
          for (Py_ssize_t i = 1; i < PyTuple_GET_SIZE(args); ++i) {
            PyObject* a = PyTuple_GET_ITEM(args, i);
            Py_INCREF(a);
            PyTuple_SET_ITEM(new_args, i, a);
          }
        }
      }
      break;
    }
    case Policy::kInplaceFp32:
    case Policy::kMatchSelf: {
      PyObject* self = PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : nullptr;
      if (!self || !THPVariable_Check(self)) {
        cast_all = false;
        break;
      }
      const at::ScalarType st = THPVariable_Unpack(self).scalar_type();
      if (p == Policy::kInplaceFp32 && is_low(st)) {
        PyObject* n = func_name(func);
        PyErr_Format(PyExc_NotImplementedError,
                     "Cannot call in-place function %S on %s tensors under O1 (it is on the fp32 "
                     "list): call the out-of-place version, or run it under amp.disable_casts()",
                     n, st == at::ScalarType::Half ? "fp16" : "bf16");
        Py_XDECREF(n);
        return nullptr;
      }
      if (p == Policy::kMatchSelf && !eligible(st)) {
        cast_all = false;
        break;
      }
      rule = {p == Policy::kMatchSelf ? st : at::ScalarType::Float, false};
      // Cast every argument after self.
      const Py_ssize_t n = PyTuple_GET_SIZE(args);
      new_args = PyTuple_New(n);
      Py_INCREF(self);
      PyTuple_SET_ITEM(new_args, 0, self);
      for (Py_ssize_t i = 1; i < n; ++i) {
        PyObject* c = cast_tree(PyTuple_GET_ITEM(args, i), rule);
        if (!c) {
          Py_DECREF(new_args);
          return nullptr;
        }
        PyTuple_SET_ITEM(new_args, i, c);
      }
      if (kwargs) {
        new_kwargs = cast_tree(kwargs, rule);
        if (!new_kwargs) {
          Py_DECREF(new_args);
          return nullptr;
        }
      }
      cast_all = false;
      break;
    }
    default: cast_all = false; break;
  }
  if (cast_all) {
    new_args = cast_tree(args, rule);
    if (!new_args) return nullptr;
    if (kwargs) {
      new_kwargs = cast_tree(kwargs, rule);
      if (!new_kwargs) {
        Py_DECREF(new_args);
        return nullptr;
      }
    }
  }
  PyObject* result;
  {
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    if (exclude_autocast) no_autocast.emplace(c10::autocast_dispatch_keyset);
    result = PyObject_Call(func, new_args ? new_args : args, new_kwargs ? new_kwargs : kwargs);
  }
  Py_XDECREF(new_args);
  Py_XDECREF(new_kwargs);
  return result;
}

// The wrappers' call: a builtin standing in for a listed torch callable (self = the original).
// Casting off (or not in this thread): one vectorcall through; else an autocast region's edit
// of the callable (NOTE: [Region edits]), or O1's policy.
PyObject* patched_call(PyObject* orig, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  if (g_threads_on.load(std::memory_order_relaxed) == 0) {
    return PyObject_Vectorcall(orig, a, nargs, kwnames);
  }
  ThreadState& tls_ = tls;  // one TLS lookup (see the note on `tls` in state.h)
  if (tls_.in_op > 0) return PyObject_Vectorcall(orig, a, nargs, kwnames);
  const bool own = tls_.active && tls_.low != at::ScalarType::Undefined;
  const Published* handed = own ? nullptr : handed_state();
  Policy region_policy = Policy::kNone;
  bool own_region = true;
  const Frame* region = find_region(tls_.frames, orig, region_policy);
  if (!region && handed) {
    region = find_region(handed->frames, orig, region_policy);
    own_region = false;
  }
  const Gate g = gate(tls_, handed);
  const Policy p = g.casting ? effective_policy(orig, g.handed) : Policy::kNone;
  if (!region && p == Policy::kNone) return PyObject_Vectorcall(orig, a, nargs, kwnames);
  if (!region && casts_nothing(p, g.low, a, nargs, kwnames)) {
    const InOp in_op;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return PyObject_Vectorcall(orig, a, nargs, kwnames);
  }
  PyObject* args = PyTuple_New(nargs);
  if (!args) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    Py_INCREF(a[i]);
    PyTuple_SET_ITEM(args, i, a[i]);
  }
  PyObject* kwargs = nullptr;
  if (kwnames && PyTuple_GET_SIZE(kwnames) > 0) {
    kwargs = PyDict_New();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i) {
      if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), a[nargs + i]) < 0) {
        Py_DECREF(kwargs);
        Py_DECREF(args);
        return nullptr;
      }
    }
  }
  PyObject* result;
  c10::DeviceType type;
  if (region && (first_device_type(args, type) || (kwargs && first_device_type(kwargs, type))) &&
      type == region->device) {
    const InOp in_op;
    result = apply_region(region_policy, *region, own_region, orig, args, kwargs);
  } else if (p != Policy::kNone && !in_autocast_region(args, kwargs)) {
    const InOp in_op;
    result = apply_policy(p, orig, args, kwargs, g);
  } else {
    result = PyObject_Call(orig, args, kwargs);
  }
  Py_DECREF(args);
  Py_XDECREF(kwargs);
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace peak::caster
