// The O1 caster's Python binding (peak._C.caster): the CastWrapper type put in place of a listed
// callable, and the module functions peak.amp._caster calls. The state lives in
// state.cpp, the casting in cast.cpp. See docs/caster.md.
#include "caster.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/autocast_mode.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "cast.h"
#include "policy.h"
#include "state.h"

namespace py = pybind11;

namespace peak::caster {
namespace {

// NOTE: [Patch wrapper objects]
// What peak.amp._caster puts in place of a listed callable: a small object of its own type,
// not a builtin function. A builtin's __name__/__qualname__/__module__ are fixed by its
// PyMethodDef, so every wrapper read 'peak_o1_cast', and code that keys callables by name
// broke (inductor registers torch.mm and torch.addmm as extern kernels by __name__: "duplicate
// extern kernel"). This type has an instance __dict__, so peak.amp._caster gives each wrapper
// the wrapped function's metadata (functools.update_wrapper: __name__, __qualname__, __module__,
// __doc__, __wrapped__), and it is called through vectorcall, as fast as the builtin was.
// Pickling one pickles a reference to the wrapped function (cast_wrapper_reduce).
struct CastWrapper {
  PyObject_HEAD
  PyObject* orig;
  PyObject* dict;
  PyObject* weakrefs;
  vectorcallfunc vectorcall;
};

PyObject* cast_wrapper_call(PyObject* self, PyObject* const* a, size_t nargsf, PyObject* kwnames) {
  return patched_call(reinterpret_cast<CastWrapper*>(self)->orig, a, PyVectorcall_NARGS(nargsf),
                      kwnames);
}

int cast_wrapper_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* w = reinterpret_cast<CastWrapper*>(self);
  Py_VISIT(w->orig);
  Py_VISIT(w->dict);
  return 0;
}

int cast_wrapper_clear(PyObject* self) {
  auto* w = reinterpret_cast<CastWrapper*>(self);
  Py_CLEAR(w->orig);
  Py_CLEAR(w->dict);
  return 0;
}

void cast_wrapper_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  auto* w = reinterpret_cast<CastWrapper*>(self);
  if (w->weakrefs) PyObject_ClearWeakRefs(self);
  cast_wrapper_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* cast_wrapper_repr(PyObject* self) {
  return PyUnicode_FromFormat("<peak O1 cast of %R>", reinterpret_cast<CastWrapper*>(self)->orig);
}

// Pickled by name, as pickle saves functions: pydoc.locate("module.name") finds whatever is
// there when loaded (the function itself once O1 is off). A callable without a module-level
// name pickles as itself (copy.copy of a function is the function).
PyObject* cast_wrapper_reduce(PyObject* self, PyObject*) {
  PyObject* orig = reinterpret_cast<CastWrapper*>(self)->orig;
  PyObject* module = PyObject_GetAttrString(orig, "__module__");
  PyObject* name = module ? PyObject_GetAttrString(orig, "__name__") : nullptr;
  PyErr_Clear();
  if (module && name && PyUnicode_Check(module) && PyUnicode_Check(name)) {
    PyObject* locate = nullptr;
    if (PyObject* pydoc = PyImport_ImportModule("pydoc")) {
      locate = PyObject_GetAttrString(pydoc, "locate");
      Py_DECREF(pydoc);
    }
    PyObject* path = PyUnicode_FromFormat("%U.%U", module, name);
    Py_DECREF(module);
    Py_DECREF(name);
    if (!locate || !path) {
      Py_XDECREF(locate);
      Py_XDECREF(path);
      return nullptr;
    }
    return Py_BuildValue("(N(N))", locate, path);
  }
  Py_XDECREF(module);
  Py_XDECREF(name);
  PyObject* copy_module = PyImport_ImportModule("copy");
  if (!copy_module) return nullptr;
  PyObject* copy_fn = PyObject_GetAttrString(copy_module, "copy");
  Py_DECREF(copy_module);
  if (!copy_fn) return nullptr;
  return Py_BuildValue("(N(O))", copy_fn, orig);
}

PyMethodDef kCastWrapperMethods[] = {
    {"__reduce__", cast_wrapper_reduce, METH_NOARGS, "pickles the wrapped function"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kCastWrapperGetSet[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject* cast_wrapper_type() {
  static PyTypeObject* type = [] {
    static PyTypeObject t = {PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "peak._C.caster.CastWrapper";
    t.tp_basicsize = sizeof(CastWrapper);
    t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
    t.tp_doc = "peak O1 caster wrapper: casts as the policy of the wrapped function says "
               "(docs/caster.md)";
    t.tp_vectorcall_offset = offsetof(CastWrapper, vectorcall);
    t.tp_call = PyVectorcall_Call;
    t.tp_dictoffset = offsetof(CastWrapper, dict);
    t.tp_weaklistoffset = offsetof(CastWrapper, weakrefs);
    t.tp_traverse = cast_wrapper_traverse;
    t.tp_clear = cast_wrapper_clear;
    t.tp_dealloc = cast_wrapper_dealloc;
    t.tp_repr = cast_wrapper_repr;
    t.tp_methods = kCastWrapperMethods;
    t.tp_getset = kCastWrapperGetSet;
    if (PyType_Ready(&t) < 0) throw py::error_already_set();
    return &t;
  }();
  return type;
}

PyObject* new_cast_wrapper(PyObject* orig) {
  auto* w = PyObject_GC_New(CastWrapper, cast_wrapper_type());
  if (!w) return nullptr;
  Py_INCREF(orig);
  w->orig = orig;
  w->dict = nullptr;
  w->weakrefs = nullptr;
  w->vectorcall = cast_wrapper_call;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(w));
  return reinterpret_cast<PyObject*>(w);
}

Policy policy_from_int(int p, const char* arg) {
  if (p < 0 || p >= kNumPolicies) {
    throw py::value_error(std::string(arg) + " must be a policy code 0.." +
                          std::to_string(kNumPolicies - 1) + ", got " + std::to_string(p) +
                          "; use peak.amp.lists, which takes policy names");
  }
  return static_cast<Policy>(p);
}

at::ScalarType low_from_obj(py::handle dtype) {
  if (dtype.is_none()) return at::ScalarType::Undefined;
  if (!THPDtype_Check(dtype.ptr())) {
    throw py::type_error("low_dtype must be torch.float16, torch.bfloat16 or None, got " +
                         py::repr(dtype).cast<std::string>());
  }
  auto s = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  if (!is_low(s)) {
    throw py::value_error("low_dtype must be torch.float16 or torch.bfloat16, got " +
                          py::repr(dtype).cast<std::string>());
  }
  return s;
}

}  // namespace

// torch's CUDA autocast lists, from the macros of its own header (ATen/autocast_mode.h), as
// aten "op" / "op.overload" names by policy.
#define PEAK_OP_NAME(op, ...) \
  (std::string(#op) + (sizeof(#__VA_ARGS__) > 1 ? "." #__VA_ARGS__ : ""))
#define PEAK_LOWER(...) lists["lower_precision_fp"].push_back(PEAK_OP_NAME(__VA_ARGS__));
#define PEAK_FP32(...) lists["fp32"].push_back(PEAK_OP_NAME(__VA_ARGS__));
#define PEAK_SET_OPT(...) lists["fp32_set_opt_dtype"].push_back(PEAK_OP_NAME(__VA_ARGS__));
#define PEAK_APPEND(ns, name, sig1, sig2, policy) lists[#policy].push_back(name);
#define PEAK_PROMOTE(...) lists["promote"].push_back(PEAK_OP_NAME(__VA_ARGS__));
std::map<std::string, std::vector<std::string>> torch_autocast_lists() {
  std::map<std::string, std::vector<std::string>> lists;
  AT_FORALL_LOWER_PRECISION_FP(PEAK_LOWER)
  AT_FORALL_FP32(PEAK_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(PEAK_SET_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(PEAK_APPEND)
  AT_FORALL_PROMOTE(PEAK_PROMOTE)
  return lists;
}

void register_bindings(py::module_& m) {
  py::module_ c = m.def_submodule("caster", "The O1 caster's C++ side (docs/caster.md)");
  c.def(
      "wrap",
      [](py::handle orig) {
        if (!PyCallable_Check(orig.ptr())) throw py::type_error("wrap: orig must be callable");
        PyObject* f = new_cast_wrapper(orig.ptr());
        if (!f) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(f);
      },
      py::arg("orig"),
      "A CastWrapper that calls orig with the caster's casts (NOTE: [Patch wrapper objects])");
  c.def(
      "unwrap",
      [](py::handle obj) -> py::object {
        if (Py_TYPE(obj.ptr()) == cast_wrapper_type()) {
          return py::reinterpret_borrow<py::object>(reinterpret_cast<CastWrapper*>(obj.ptr())->orig);
        }
        return py::reinterpret_borrow<py::object>(obj);
      },
      py::arg("obj"), "The callable behind a CastWrapper; anything else as it is");
  c.def(
      "instancemethod",
      [](py::handle f) {
        PyObject* m = PyInstanceMethod_New(f.ptr());
        if (!m) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(m);
      },
      py::arg("func"), "Make a builtin bind self when stored on a class");

  for (int p = 0; p < kNumPolicies; ++p) {
    c.attr(("POLICY_" + std::string(policy_name(static_cast<Policy>(p)))).c_str()) = p;
  }
  c.def("policy_name", [](int p) { return std::string(policy_name(policy_from_int(p, "policy"))); });
  c.def(
      "set_policy",
      [](py::handle func, int p) {
        if (!PyCallable_Check(func.ptr())) {
          throw py::type_error("func must be callable (a torch function, Tensor method or "
                               "torch.nn.functional function), got " +
                               py::repr(func).cast<std::string>());
        }
        set_policy(func.ptr(), policy_from_int(p, "policy"));
      },
      py::arg("func"), py::arg("policy"));
  c.def("get_policy", [](py::handle func) { return static_cast<int>(lookup(func.ptr())); },
        py::arg("func"));
  c.def("clear_table", &clear_table);
  c.def("table", []() {
    py::list out;
    for (auto& [f, p] : table_items())
      out.append(py::make_tuple(py::reinterpret_borrow<py::object>(f), static_cast<int>(p)));
    return out;
  });
  c.def("default_entries", []() {
    py::list out;
    for (auto& e : default_entries())
      out.append(py::make_tuple(e.where, e.name, static_cast<int>(e.policy)));
    return out;
  }, "Apex's O1 lists as (where, name, policy) with where in torch/functional/Tensor");

  c.def("set_low_dtype", [](py::handle d) {
    tls.low = low_from_obj(d);
    publish();
  }, py::arg("low_dtype"), "This thread's low dtype (None: O1 off here)");
  c.def("low_dtype", []() -> py::object {
    const Published* handed = thread_on() ? nullptr : handed_state();
    const at::ScalarType low = thread_on() ? tls.low : handed ? handed->low : at::ScalarType::Undefined;
    if (low == at::ScalarType::Undefined) return py::none();
    return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(low)));
  });
  c.def("set_allow_banned", [](bool v) {
    tls.allow_banned = v;
    publish();
  }, py::arg("allow_banned"));
  c.def("threads_on", []() { return g_threads_on.load(); },
        "How many threads have O1 on or a region edit open (their own state, not handed)");
  c.def("set_thread_active", [](bool v) {
    tls.active = v;
    publish();
  }, py::arg("active"));
  c.def("suspend", []() {
    ++tls.suspended;
    publish();
  });
  c.def("resume", []() {
    if (tls.suspended <= 0) throw py::value_error("caster.resume() without a matching suspend()");
    --tls.suspended;
    publish();
  });
  c.def("is_casting", []() { return current_gate().casting; },
        "True when O1 casts in this thread now: enabled, switched on here (or handed to this "
        "thread by torch with its thread-local state), not in disable_casts");
  c.def("handed_state", []() -> py::object {
    if (thread_on()) return py::none();
    const Published* h = handed_state();
    if (!h) return py::none();
    return py::make_tuple(h->active, h->suspended, h->frames.size());
  }, "(on, disable_casts depth, list-edit frames) of the caster state torch handed this thread, "
     "or None (this thread switched O1 on itself, or was handed nothing)");
  // NOTE: [Checkpoint recomputation] in state.cpp
  c.def("snapshot", []() { return py::reinterpret_steal<py::object>(snapshot_state()); },
        "The caster state in effect in this thread now (an opaque object for push_state)");
  c.def("push_state", [](py::handle snapshot) { push_state(snapshot.ptr()); }, py::arg("snapshot"),
        "Make a snapshot() this thread's caster state until pop_state()");
  c.def("pop_state", []() { pop_state(); });
  c.def(
      "call",
      [](int p, py::handle func, py::handle args, py::handle kwargs) -> py::object {
        const Policy pol = policy_from_int(p, "policy");
        if (!PyTuple_Check(args.ptr())) throw py::type_error("args must be a tuple");
        PyObject* kw = kwargs.is_none() ? nullptr : kwargs.ptr();
        if (kw && !PyDict_Check(kw)) throw py::type_error("kwargs must be a dict or None");
        PyObject* r;
        Gate g = current_gate();
        c10::DeviceType region = c10::DeviceType::CPU;
        if (pol == Policy::kNone || !g.casting) {
          r = PyObject_Call(func.ptr(), args.ptr(), kw);
        } else {
          // NOTE: [Explicit autocast regions win] A decorated function is not an op: its body
          // keeps torch's autocast (its ops step aside in a region), and in a region its
          // arguments are cast with the region's low dtype, as custom_fwd(cast_inputs=) casts.
          if (in_autocast_region(args.ptr(), kw, &region)) {
            g.low = at::autocast::get_autocast_dtype(region);
          }
          r = apply_policy(pol, func.ptr(), args.ptr(), kw, g, /*exclude_autocast=*/false);
        }
        if (!r) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(r);
      },
      py::arg("policy"), py::arg("func"), py::arg("args"), py::arg("kwargs") = py::none(),
      "Call func(*args, **kwargs) with the policy's casts when O1 casts in this thread (decorators)");

  c.def(
      "push_local",
      [](py::dict edits, py::object device_type, py::list input_only) {
        auto frame = std::make_shared<Frame>();
        for (auto item : edits) {
          if (!PyCallable_Check(item.first.ptr())) {
            throw py::type_error("local edits: keys must be callables, got " +
                                 py::repr(item.first).cast<std::string>());
          }
          frame->policies[item.first.ptr()] = policy_from_int(item.second.cast<int>(), "policy");
        }
        if (!device_type.is_none()) {  // NOTE: [Region edits] in cast.cpp
          frame->region = true;
          frame->device = c10::Device(device_type.cast<std::string>()).type();
          for (auto f : input_only) {
            if (frame->policies.count(f.ptr())) frame->input_only.insert(f.ptr());
          }
        }
        for (auto& kv : frame->policies) Py_INCREF(kv.first);
        tls.frames.push_back(std::move(frame));
        publish();
      },
      py::arg("edits"), py::arg("device_type") = py::none(), py::arg("input_only") = py::list(),
      "Push thread-local edits {func: policy code} (0: unlisted here); with a device_type, a "
      "region edit of peak.amp.autocast (NOTE: [Region edits])");
  c.def("pop_local", []() {
    if (tls.frames.empty()) throw py::value_error("pop_local() without a matching push_local()");
    const bool region = tls.frames.back()->region;
    tls.frames.pop_back();
    publish();
    // As torch.autocast drops its cast cache when its outermost region ends.
    if (region && !thread_on() && !any_region(tls.frames)) tls.cache.clear();
  });
  c.def("effective_policy", [](py::handle f) {
    return static_cast<int>(effective_policy(f.ptr(), tls.active ? nullptr : handed_state()));
  },
        py::arg("func"), "The policy of func in this thread (local edits first)");
  c.def("clear_cache", []() { tls.cache.clear(); }, "Drop this thread's weight-cast cache");
  c.def("cache_stats", []() {
    py::dict d;
    d["hits"] = tls.hits;
    d["casts"] = tls.casts;
    d["stores"] = tls.stores;
    d["size"] = tls.cache.size();
    return d;
  });
  c.def("torch_autocast_lists", &torch_autocast_lists,
        "torch's CUDA autocast lists {policy: [aten op names]}, read from its header");
  c.def("reset_cache_stats", []() { tls.hits = tls.casts = tls.stores = 0; });
}

}  // namespace peak::caster