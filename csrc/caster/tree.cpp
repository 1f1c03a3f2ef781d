// The O1 caster's walks over argument trees (cast.h): the cast of every eligible tensor in them,
// and the read-only walks for their dtypes and first device. See docs/caster.md.
#include "cast.h"

#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <optional>

namespace peak::caster {
namespace {

// copy.copy(o): a shallow copy of o's own type (a defaultdict keeps its factory).
PyObject* shallow_copy(PyObject* o) {
  PyObject* module = PyImport_ImportModule("copy");
  if (!module) return nullptr;
  PyObject* out = PyObject_CallMethod(module, "copy", "O", o);
  Py_DECREF(module);
  return out;
}

// NOTE: [Argument trees] The walks below descend into tuples, lists and dicts, carrying the
// containers on the path to the one in hand: a container met again inside itself is left as it is
// there (nothing below it is cast or counted) instead of recursing until the stack overflows.
using Path = c10::SmallVector<PyObject*, 8>;  // (no allocation for usual depths)
struct Enter {  // `o` on the path for this scope, unless it is on it already (a cycle)
  Enter(Path& path, PyObject* o) : path(path), cycle(std::find(path.begin(), path.end(), o) !=
                                                     path.end()) {
    if (!cycle) path.push_back(o);
  }
  ~Enter() {
    if (!cycle) path.pop_back();
  }
  Path& path;
  const bool cycle;
};

// Returns a new reference: `o` itself (incref'd) when nothing inside changed.
PyObject* cast_tree(PyObject* o, const Rule& r, Path& path) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined() || !eligible(t.scalar_type()) || t.scalar_type() == r.to ||
        (!r.any_device && t.device().type() != r.device)) {
      Py_INCREF(o);
      return o;
    }
    at::Tensor c;
    {  // NOTE: [Region edits under inference mode] write_back reads a copy's version counter,
       // which inference tensors lack: the copy is made outside inference mode (grad off, as in it)
      std::optional<c10::InferenceMode> outside;
      std::optional<at::NoGradGuard> no_grad;
      if (r.copies && c10::InferenceMode::is_enabled()) outside.emplace(false), no_grad.emplace();
      c = cast_tensor(t, r.to, r.use_cache);
    }
    if (r.copies) r.copies->push_back({o, c, version_of(c)});
    return THPVariable_Wrap(std::move(c));
  }
  const bool is_tuple = PyTuple_Check(o), is_list = PyList_Check(o);
  if (!is_tuple && !is_list && !PyDict_Check(o)) {
    Py_INCREF(o);
    return o;
  }
  const Enter entered(path, o);
  if (entered.cycle) {
    Py_INCREF(o);
    return o;
  }
  if (is_tuple || is_list) {
    const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
    PyObject* out = nullptr;  // created on the first change
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = is_tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
      PyObject* c = cast_tree(item, r, path);
      if (!c) {
        Py_XDECREF(out);
        return nullptr;
      }
      if (c != item && !out) {
        out = is_tuple ? PyTuple_New(n) : PyList_New(n);
        for (Py_ssize_t j = 0; j < i; ++j) {
          PyObject* prev = is_tuple ? PyTuple_GET_ITEM(o, j) : PyList_GET_ITEM(o, j);
          Py_INCREF(prev);
          if (is_tuple) PyTuple_SET_ITEM(out, j, prev); else PyList_SET_ITEM(out, j, prev);
        }
      }
      if (out) {
        if (is_tuple) PyTuple_SET_ITEM(out, i, c); else PyList_SET_ITEM(out, i, c);
      } else {
        Py_DECREF(c);
      }
    }
    if (!out) {
      Py_INCREF(o);
      return o;
    }
    if (is_tuple && !PyTuple_CheckExact(o)) {  // rebuilt as its own type
      // A namedtuple (PackedSequence) takes its fields as arguments; other tuple types
      // (torch.return_types, a `class X(tuple)`) take one sequence, as tuple() does.
      const bool named = PyObject_HasAttrString(o, "_fields");
      PyObject* rebuilt = named
          ? PyObject_Call(reinterpret_cast<PyObject*>(Py_TYPE(o)), out, nullptr)
          : PyObject_CallOneArg(reinterpret_cast<PyObject*>(Py_TYPE(o)), out);
      Py_DECREF(out);
      return rebuilt;
    }
    return out;
  }
  if (PyDict_Check(o)) {
    // NOTE: [Dicts in cast arguments] The dict itself where nothing in it is cast (a function
    // may fill a cache dict passed to it); else a shallow copy of its own type (copy.copy keeps a
    // defaultdict's factory, an OrderedDict's order) with the cast values set in, or a plain dict
    // where its type cannot be copied and written (a frozen mapping, a copy that is itself).
    std::vector<std::pair<PyObject*, PyObject*>> cast;  // (borrowed key, new value)
    auto release = [&cast] {
      for (auto& kv : cast) Py_DECREF(kv.second);
    };
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      PyObject* c = cast_tree(v, r, path);
      if (!c) {
        release();
        return nullptr;
      }
      if (c == v) {
        Py_DECREF(c);
      } else {
        cast.emplace_back(k, c);
      }
    }
    if (cast.empty()) {
      Py_INCREF(o);
      return o;
    }
    auto set_all = [&cast](PyObject* d) {
      for (auto& kv : cast) {
        if (PyObject_SetItem(d, kv.first, kv.second) < 0) return false;
      }
      return true;
    };
    PyObject* out = PyDict_CheckExact(o) ? nullptr : shallow_copy(o);
    if (out && (out == o || !set_all(out))) Py_CLEAR(out);
    if (!out) {
      PyErr_Clear();
      out = PyDict_Copy(o);  // (a plain dict of its items)
      if (out && !set_all(out)) Py_CLEAR(out);
    }
    release();
    return out;
  }
  Py_INCREF(o);
  return o;
}

void collect_dtypes(PyObject* o, int& bits, Path& path) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined()) return;
    switch (t.scalar_type()) {
      case at::ScalarType::Half: bits |= kHalfBit; break;
      case at::ScalarType::BFloat16: bits |= kBf16Bit; break;
      case at::ScalarType::Float: bits |= kFloatBit; break;
      default: break;
    }
    return;
  }
  const Enter entered(path, o);
  if (entered.cycle) return;
  if (PyTuple_Check(o)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) {
      collect_dtypes(PyTuple_GET_ITEM(o, i), bits, path);
    }
  } else if (PyList_Check(o)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) {
      collect_dtypes(PyList_GET_ITEM(o, i), bits, path);
    }
  } else if (PyDict_Check(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) collect_dtypes(v, bits, path);
  }
}

bool first_device_type(PyObject* o, c10::DeviceType& out, Path& path) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined()) return false;
    out = t.device().type();
    return true;
  }
  const Enter entered(path, o);
  if (entered.cycle) return false;
  if (PyTuple_Check(o)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) {
      if (first_device_type(PyTuple_GET_ITEM(o, i), out, path)) return true;
    }
  } else if (PyList_Check(o)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) {
      if (first_device_type(PyList_GET_ITEM(o, i), out, path)) return true;
    }
  } else if (PyDict_Check(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      if (first_device_type(v, out, path)) return true;
    }
  }
  return false;
}

}  // namespace

PyObject* cast_tree(PyObject* o, const Rule& r) {
  Path path;
  return cast_tree(o, r, path);
}

void collect_dtypes(PyObject* o, int& bits) {
  Path path;
  collect_dtypes(o, bits, path);
}

bool first_device_type(PyObject* o, c10::DeviceType& out) {
  Path path;
  return first_device_type(o, out, path);
}

}  // namespace peak::caster
