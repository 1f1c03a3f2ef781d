// What an op under a region edit wrote into cast copies, copied back into the caller's tensors
// (NOTE: [Region edits] in cast.cpp; docs/caster.md).
#include "cast.h"

#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/DispatchKeySet.h>

#include <string>
#include <unordered_set>

namespace peak::caster {
namespace {

// The caller's tensor for a cast copy the op wrote into (borrowed), or nullptr.
PyObject* written_orig(PyObject* r, const std::vector<const Copy*>& written) {
  if (!THPVariable_Check(r)) return nullptr;
  const c10::TensorImpl* impl = THPVariable_Unpack(r).unsafeGetTensorImpl();
  for (const Copy* c : written) {
    if (c->cast.unsafeGetTensorImpl() == impl) return c->orig;
  }
  return nullptr;
}

}  // namespace

bool in_place_call(PyObject* func, PyObject* kwargs) {
  static const std::unordered_set<std::string> kInPlaceDunders{
      "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
      "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__idiv__"};
  PyObject* flag = kwargs ? PyDict_GetItemString(kwargs, "inplace") : nullptr;  // borrowed
  if (flag == Py_True) return true;
  PyObject* name = PyObject_GetAttrString(func, "__name__");
  Py_ssize_t n = 0;
  const char* s = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &n) : nullptr;
  const bool in_place = s && n >= 2 && ((s[n - 1] == '_' && s[n - 2] != '_') ||
                                        (n > 4 && s[2] == 'i' && s[0] == '_' &&
                                         kInPlaceDunders.count(std::string(s, n))));
  Py_XDECREF(name);
  PyErr_Clear();
  return in_place;
}

uint32_t version_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->version_counter().current_version();
}

// NOTE: [Region edits]: copies back what the op wrote into cast copies (its version moved; or,
// under vmap or functionalize, whose in-place ops keep versions still, an `in_place` call returned
// it), as autograd records an in-place op; returns `result`, or the caller's tensors where it
// returned a written copy (steals `result`).
PyObject* write_back(PyObject* result, const std::vector<Copy>& copies, bool in_place) {
  static const c10::DispatchKeySet kTransforms{c10::DispatchKey::FuncTorchBatched,
                                               c10::DispatchKey::Functionalize};
  const c10::TensorImpl* returned =
      result && THPVariable_Check(result) ? THPVariable_Unpack(result).unsafeGetTensorImpl() : 0;
  std::vector<const Copy*> written;
  for (const Copy& c : copies) {
    if (version_of(c.cast) != c.version || (in_place && c.cast.unsafeGetTensorImpl() == returned &&
                                             c.cast.key_set().has_any(kTransforms))) {
      written.push_back(&c);
    }
  }
  if (!result || written.empty()) return result;
  try {
    for (const Copy* c : written) THPVariable_Unpack(c->orig).copy_(c->cast);
  } catch (...) {
    Py_DECREF(result);
    throw;
  }
  if (PyObject* orig = written_orig(result, written)) {
    Py_INCREF(orig);
    Py_DECREF(result);
    return orig;
  }
  const bool is_tuple = PyTuple_CheckExact(result), is_list = PyList_CheckExact(result);
  if (!is_tuple && !is_list) return result;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(result);
  PyObject* out = is_tuple ? PyTuple_New(n) : PyList_New(n);
  if (!out) {
    Py_DECREF(result);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(result, i);
    PyObject* orig = written_orig(item, written);
    PyObject* keep = orig ? orig : item;
    Py_INCREF(keep);
    if (is_tuple) PyTuple_SET_ITEM(out, i, keep); else PyList_SET_ITEM(out, i, keep);
  }
  Py_DECREF(result);
  return out;
}

}  // namespace peak::caster
