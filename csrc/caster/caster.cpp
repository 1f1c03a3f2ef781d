// The O1 caster: the C++ __torch_function__ of peak's TorchFunctionMode, the thread-local state
// and the weight-cast cache. See docs/caster.md.
#include "caster.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "policy.h"

namespace py = pybind11;

namespace peak::caster {
namespace {

// ---- state
// Per thread (ThreadState below): O1 on or off, the low dtype, allow_banned. Process-wide: how
// many threads have O1 on (the patch wrappers' fast path when none has), and the hook.
std::atomic<int> g_threads_on{0};
PyObject* g_hook = nullptr;  // strong reference, for Policy::kHook

struct CacheKey {
  c10::TensorImpl* impl;
  at::ScalarType dtype;
  bool operator==(const CacheKey& o) const { return impl == o.impl && dtype == o.dtype; }
};
struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    return std::hash<void*>()(k.impl) ^ (static_cast<size_t>(k.dtype) << 1);
  }
};
// NOTE: [Weight-cast cache lifetime]
// An entry serves while the weight it was cast from is unchanged: same version counter (an
// in-place update through the tensor), same data pointer (`w.data = other`), and no backward
// through the cast yet. The last rule catches what the first two cannot see: an update through
// `w.data.add_(...)` (a `.data` view has a version counter of its own), the manual-SGD idiom;
// a weight is updated after the backward of the forward that used it, so an entry is never
// reused across that point (without scale_loss, which clears the cache as in Apex, stale copies
// would otherwise be served). Entries also keep their weight alive (the cast's autograd graph
// holds it, and the preserved Python object of a dead parameter looks just like a live one), so
// a store now and then sweeps the entries backward has used, and a cache still above
// kCacheCapacity entries after that (grad-mode forwards of throwaway models, never backward) is
// dropped whole: memory stays bounded, and a dropped entry only costs a cast.
struct CacheEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> source;  // keeps the address from being reused
  uint32_t version;                                  // the source's version when cast
  const void* data;                                  // the source's data pointer when cast
  std::shared_ptr<std::atomic<bool>> used;           // backward went through the cast
  at::Tensor cast;
};

// Marks a cache entry used when backward reaches its cast (any thread: the flag is atomic).
struct MarkUsedOnBackward : torch::autograd::FunctionPreHook {
  explicit MarkUsedOnBackward(std::shared_ptr<std::atomic<bool>> flag) : used(std::move(flag)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    used->store(true, std::memory_order_relaxed);
    return grads;
  }
  std::shared_ptr<std::atomic<bool>> used;
};

// One peak.amp.lists.local block's edits. Immutable once pushed, so that published snapshots
// share it; holds strong references to its keys (dropped with the GIL held: by pop_local, or by
// the snapshot capsule's destructor).
struct Frame {
  std::unordered_map<PyObject*, Policy> policies;
  Frame() = default;
  Frame(const Frame&) = delete;
  Frame& operator=(const Frame&) = delete;
  ~Frame() {
    for (auto& kv : policies) Py_DECREF(kv.first);
  }
};
using FrameStack = std::vector<std::shared_ptr<const Frame>>;  // innermost last

// A thread's caster state, as published (NOTE: [Caster state in torch's worker threads]) and as
// snapshot() takes it.
struct Published {
  bool active;
  at::ScalarType low;
  bool allow_banned;
  int suspended;
  FrameStack frames;
};

// A thread's caster state as push_state saves it (NOTE: [Checkpoint recomputation]), with what
// the thread had in ThreadLocalPythonObjects (its own published snapshot, or the one torch
// handed it, which push_state's publish() overwrites).
struct SavedState {
  Published state;
  bool published;
  std::shared_ptr<c10::SafePyObject> slot;
};

// Per thread: disable_casts depth, whether O1 was switched on in this thread (for the decorators;
// the mode itself lives on the thread's torch-function mode stack), the weight-cast cache.
struct ThreadState {
  at::ScalarType low = at::ScalarType::Undefined;  // this thread's low dtype (Undefined: O1 off)
  bool allow_banned = false;
  bool counted = false;  // counted in g_threads_on
  ~ThreadState() {
    if (counted) g_threads_on.fetch_sub(1, std::memory_order_relaxed);
  }
  int suspended = 0;
  // Listed ops running now in this thread: calls they make in turn are not cast again (the op
  // is cast once, at its entry point, as if by hand; torch pops the mode for the same effect).
  int in_op = 0;
  bool active = false;
  bool published = false;  // this thread's snapshot is in its ThreadLocalPythonObjects
  std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> cache;
  size_t next_sweep = 64;  // cache size at which a store sweeps dead entries first
  int64_t hits = 0, casts = 0, stores = 0;
  FrameStack frames;  // thread-local list edits (peak.amp.lists.local)
  std::vector<SavedState> saved;  // push_state's stack
};
thread_local ThreadState tls;

// NOTE: [Caster state in torch's worker threads]
// torch runs some of a thread's work on its own threads: autograd runs backward for CUDA tensors
// on its device threads (custom Function.backward code, the recomputation of a non-reentrant
// torch.utils.checkpoint), and at::launch's inter-op pool runs TorchScript forks (which may call
// Python). It hands them the caller's at::ThreadLocalState (grad mode, autocast, the
// torch-function mode stack, ...), which knows nothing of `tls` above. So a thread that switched
// O1 on also publishes an immutable snapshot of its state (on, disable_casts depth, list edits)
// in at::impl::ThreadLocalPythonObjects, which ThreadLocalState carries, at every change. A
// thread that did not switch O1 on itself casts as the snapshot it was handed says (Apex's patches
// were process-wide, so such threads were cast under Apex too), plus its own disable_casts and
// list edits; a thread torch did not start for this one (a plain Python thread) is handed nothing
// and sees no casting. Casts made under a handed snapshot bypass the weight-cast cache: the cache
// belongs to the thread whose scale_loss clears it.
constexpr const char kPublishedName[] = "peak.caster.state";

const std::string& published_key() {
  static const std::string key = kPublishedName;
  return key;
}

void destroy_published(PyObject* capsule) {
  delete static_cast<Published*>(PyCapsule_GetPointer(capsule, kPublishedName));
}

inline bool thread_on() { return tls.active && tls.low != at::ScalarType::Undefined; }

Published own_state() {
  return {tls.active, tls.low, tls.allow_banned, tls.suspended, tls.frames};
}

void set_own_state(Published s) {
  tls.active = s.active;
  tls.low = s.low;
  tls.allow_banned = s.allow_banned;
  tls.suspended = s.suspended;
  tls.frames = std::move(s.frames);
}

// Called after every change of this thread's state.
void publish() {
  using at::impl::ThreadLocalPythonObjects;
  const bool on = thread_on();
  if (on != tls.counted) {
    g_threads_on.fetch_add(on ? 1 : -1, std::memory_order_relaxed);
    tls.counted = on;
  }
  if (!on) {
    if (tls.published && ThreadLocalPythonObjects::contains(published_key())) {
      ThreadLocalPythonObjects::erase(published_key());
    }
    tls.published = false;
    return;
  }
  auto* snapshot = new Published(own_state());
  PyObject* capsule = PyCapsule_New(snapshot, kPublishedName, destroy_published);
  if (!capsule) {
    delete snapshot;
    throw py::error_already_set();
  }
  ThreadLocalPythonObjects::set(published_key(),
                                std::make_shared<c10::SafePyObject>(capsule, getPyInterpreter()));
  tls.published = true;
}

// The snapshot torch handed this thread, or nullptr.
const Published* handed_state() {
  using at::impl::ThreadLocalPythonObjects;
  if (!ThreadLocalPythonObjects::contains(published_key())) return nullptr;
  PyObject* capsule = ThreadLocalPythonObjects::get(published_key())->ptr(getPyInterpreter());
  return static_cast<const Published*>(PyCapsule_GetPointer(capsule, kPublishedName));
}

struct InOp {
  InOp() { ++tls.in_op; }
  ~InOp() { --tls.in_op; }
  InOp(const InOp&) = delete;
  InOp& operator=(const InOp&) = delete;
};

// Whether O1 casts in this thread now, and whose state says so.
struct Gate {
  bool casting = false;
  bool own = false;                   // this thread's own state: the weight-cast cache may serve
  const Published* handed = nullptr;  // else the snapshot handed to this thread, if any
  at::ScalarType low = at::ScalarType::Undefined;
  bool allow_banned = false;
};

// `in_mode`: asked by the mode's handler (the mode on this thread's stack means O1 is on).
inline Gate gate(bool in_mode) {
  if (g_threads_on.load(std::memory_order_relaxed) == 0 || tls.suspended > 0 || tls.in_op > 0) {
    return {};
  }
  if (thread_on()) return {true, true, nullptr, tls.low, tls.allow_banned};
  const Published* handed = handed_state();
  if (!handed) return {};
  return {(in_mode || handed->active) && handed->suspended == 0, false, handed, handed->low,
          handed->allow_banned};
}

inline bool find_in(const FrameStack& frames, PyObject* func, Policy& out) {
  for (auto f = frames.rbegin(); f != frames.rend(); ++f) {
    auto it = (*f)->policies.find(func);
    if (it != (*f)->policies.end()) {
      out = it->second;
      return true;
    }
  }
  return false;
}

// The policy of func in this thread: the innermost local edit (this thread's, then the handed
// snapshot's), else the process-wide table.
inline Policy effective_policy(PyObject* func, const Published* handed) {
  Policy p;
  if (find_in(tls.frames, func, p)) return p;
  if (handed && find_in(handed->frames, func, p)) return p;
  return lookup(func);
}

inline bool is_low(at::ScalarType s) {
  return s == at::ScalarType::Half || s == at::ScalarType::BFloat16;
}
// Tensors the caster may cast: f16, bf16, f32 (float64, integers, complex are left alone).
inline bool eligible(at::ScalarType s) { return is_low(s) || s == at::ScalarType::Float; }

constexpr size_t kCacheCapacity = 4096;

// NOTE: [Weight-cast cache lifetime]: drops what can never serve again; bounds the rest.
void sweep_cache() {
  for (auto it = tls.cache.begin(); it != tls.cache.end();) {
    const bool dead = it->second.source.expired() ||
                      it->second.used->load(std::memory_order_relaxed);
    it = dead ? tls.cache.erase(it) : std::next(it);
  }
  if (tls.cache.size() >= kCacheCapacity) tls.cache.clear();
  tls.next_sweep = std::min(kCacheCapacity, std::max<size_t>(64, 2 * tls.cache.size()));
}

at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, bool use_cache) {
  if (t.scalar_type() == to) return t;
  const bool cacheable = use_cache && t.scalar_type() == at::ScalarType::Float && t.is_leaf() &&
                         t.requires_grad() && !t.is_view() && !c10::InferenceMode::is_enabled();
  if (!cacheable) {
    ++tls.casts;
    return t.to(to);
  }
  CacheKey key{t.unsafeGetTensorImpl(), to};
  const uint32_t version = t.unsafeGetTensorImpl()->version_counter().current_version();
  auto it = tls.cache.find(key);
  if (it != tls.cache.end()) {
    const CacheEntry& e = it->second;
    if (!e.source.expired() && e.version == version && e.data == t.data_ptr() &&
        !e.used->load(std::memory_order_relaxed)) {
      ++tls.hits;
      return e.cast;
    }
    tls.cache.erase(it);  // stale (NOTE: [Weight-cast cache lifetime])
  }
  ++tls.casts;
  at::Tensor out = t.to(to);
  // Only a grad-mode cast is stored: one made under no_grad has no autograd history, and reusing
  // it in a later grad-enabled forward would silently cut the weight's gradient (torch #112583).
  if (c10::GradMode::is_enabled() && out.grad_fn()) {
    if (tls.cache.size() >= tls.next_sweep) sweep_cache();
    ++tls.stores;
    auto used = std::make_shared<std::atomic<bool>>(false);
    out.grad_fn()->add_pre_hook(std::make_unique<MarkUsedOnBackward>(used));
    tls.cache.emplace(key, CacheEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(
                                          t.getIntrusivePtr()),
                                      version, t.data_ptr(), std::move(used), out});
  }
  return out;
}

// A cast rule applied to every eligible tensor found in an argument tree.
struct Rule {
  at::ScalarType to;
  bool use_cache;
};

// Returns a new reference: `o` itself (incref'd) when nothing inside changed.
PyObject* cast_tree(PyObject* o, const Rule& r) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined() || !eligible(t.scalar_type()) || t.scalar_type() == r.to) {
      Py_INCREF(o);
      return o;
    }
    return THPVariable_Wrap(cast_tensor(t, r.to, r.use_cache));
  }
  const bool is_tuple = PyTuple_Check(o), is_list = PyList_Check(o);
  if (is_tuple || is_list) {
    const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
    PyObject* out = nullptr;  // created on the first change
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = is_tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
      PyObject* c = cast_tree(item, r);
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
    if (is_tuple && !PyTuple_CheckExact(o)) {  // a namedtuple (e.g. PackedSequence): rebuild it
      PyObject* rebuilt = PyObject_Call(reinterpret_cast<PyObject*>(Py_TYPE(o)), out, nullptr);
      Py_DECREF(out);
      return rebuilt;
    }
    return out;
  }
  if (PyDict_Check(o)) {
    PyObject* out = PyDict_New();
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      PyObject* c = cast_tree(v, r);
      if (!c || PyDict_SetItem(out, k, c) < 0) {
        Py_XDECREF(c);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(c);
    }
    return out;
  }
  Py_INCREF(o);
  return o;
}

// Walks the tree and records which eligible floating dtypes occur (bit per dtype).
constexpr int kHalfBit = 1, kBf16Bit = 2, kFloatBit = 4;
void collect_dtypes(PyObject* o, int& bits) {
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
  if (PyTuple_Check(o)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) collect_dtypes(PyTuple_GET_ITEM(o, i), bits);
  } else if (PyList_Check(o)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) collect_dtypes(PyList_GET_ITEM(o, i), bits);
  } else if (PyDict_Check(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) collect_dtypes(v, bits);
  }
}
inline bool mixed(int bits) { return bits != 0 && (bits & (bits - 1)) != 0; }

// The device type of the first tensor in o (depth first), if any.
bool first_device_type(PyObject* o, c10::DeviceType& out) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined()) return false;
    out = t.device().type();
    return true;
  }
  if (PyTuple_Check(o)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i) {
      if (first_device_type(PyTuple_GET_ITEM(o, i), out)) return true;
    }
  } else if (PyList_Check(o)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i) {
      if (first_device_type(PyList_GET_ITEM(o, i), out)) return true;
    }
  } else if (PyDict_Check(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      if (first_device_type(v, out)) return true;
    }
  }
  return false;
}

// NOTE: [Explicit autocast regions win]
// Code running under O1 may open its own torch.autocast (or peak.amp.autocast) region, e.g. an
// evaluation, teacher or baseline model in the same process, with its own dtype. Inside it the
// user asked for torch's rules, so the caster steps aside for ops on that region's device type
// and lets torch's autocast keys do the casting; everywhere else O1 casts as before.
bool in_autocast_region(PyObject* args, PyObject* kwargs) {
  if (!at::autocast::is_autocast_enabled(c10::DeviceType::CPU) &&
      !at::autocast::is_autocast_enabled(c10::DeviceType::CUDA) &&
      !at::autocast::is_autocast_enabled(c10::DeviceType::XPU)) {
    return false;  // the common case: one TLS read per device type
  }
  c10::DeviceType type = c10::DeviceType::CPU;
  if (!first_device_type(args, type) && !(kwargs && first_device_type(kwargs, type))) {
    return false;
  }
  return at::autocast::is_autocast_enabled(type);
}

const char kBannedMessage[] =
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` It "
    "requires that the output of the previous function be already a FloatTensor. \n\n"
    "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
    "    torch.nn.BCEWithLogitsLoss (torch.nn.functional.binary_cross_entropy_with_logits)\n"
    "to combine Sigmoid+BCELoss into a single layer that is compatible with amp.\n"
    "Another option is to add\n"
    "    amp.register_float_function(torch, 'sigmoid')\n"
    "before calling `amp.initialize()`.\n"
    "If you _really_ know what you are doing, you can disable this warning by passing "
    "allow_banned=True to `amp.init()` (or peak.amp.lists.set_allow_banned(True)).";

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

// Cast the arguments as `p` says and call `func` with torch's autocast keys excluded (so
// torch.autocast, if also on, does not re-cast this op). New reference or nullptr.
// `g`: whose state casts (its low dtype, allow_banned; its own state may use the cache).
PyObject* apply_policy(Policy p, PyObject* func, PyObject* args, PyObject* kwargs, const Gate& g) {
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
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    result = PyObject_Call(func, new_args ? new_args : args, new_kwargs ? new_kwargs : kwargs);
  }
  Py_XDECREF(new_args);
  Py_XDECREF(new_kwargs);
  return result;
}

// __torch_function__(func, types, args=(), kwargs=None), installed as a staticmethod of the mode.
PyObject* torch_function(PyObject* mode, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 2 || n > 4) {
    PyErr_SetString(PyExc_TypeError,
                    "peak caster __torch_function__(func, types, args=(), kwargs=None): wrong "
                    "number of arguments");
    return nullptr;
  }
  PyObject* func = a[0];
  PyObject* args = n > 2 ? a[2] : nullptr;
  PyObject* kwargs = n > 3 && a[3] != Py_None ? a[3] : nullptr;
  if (kwargs && PyDict_GET_SIZE(kwargs) == 0) kwargs = nullptr;
  PyObject* empty = nullptr;
  if (!args || args == Py_None) {
    empty = PyTuple_New(0);
    args = empty;
  }
  const Gate g = gate(/*in_mode=*/true);
  const Policy p = g.casting ? effective_policy(func, g.handed) : Policy::kNone;
  PyObject* result;
  if (p == Policy::kNone || !PyTuple_Check(args) ||
      (p != Policy::kHook && in_autocast_region(args, kwargs))) {
    result = PyObject_Call(func, args, kwargs);
  } else if (p == Policy::kHook) {
    if (!g_hook) {
      result = PyObject_Call(func, args, kwargs);
    } else {
      PyObject* kw = kwargs ? kwargs : Py_None;
      result = PyObject_CallFunctionObjArgs(g_hook, mode ? mode : Py_None, func, args, kw, nullptr);
    }
  } else {
    const InOp in_op;
    result = apply_policy(p, func, args, kwargs, g);
  }
  Py_XDECREF(empty);
  return result;
  END_HANDLE_TH_ERRORS
}

// The "patch" dispatch: a builtin standing in for a listed torch callable (self = the original).
// Casting off (or not in this thread): one vectorcall through; on: the table's policy.
PyObject* patched_call(PyObject* orig, PyObject* const* a, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  if (g_threads_on.load(std::memory_order_relaxed) == 0) {
    return PyObject_Vectorcall(orig, a, nargs, kwnames);
  }
  const Gate g = gate(/*in_mode=*/false);
  if (!g.casting) return PyObject_Vectorcall(orig, a, nargs, kwnames);
  const Policy p = effective_policy(orig, g.handed);
  if (p == Policy::kNone || p == Policy::kHook) {
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
  if (in_autocast_region(args, kwargs)) {
    result = PyObject_Call(orig, args, kwargs);
  } else {
    const InOp in_op;
    result = apply_policy(p, orig, args, kwargs, g);
  }
  Py_DECREF(args);
  Py_XDECREF(kwargs);
  return result;
  END_HANDLE_TH_ERRORS
}

// NOTE: [Patch wrapper objects]
// What the patch dispatch puts in place of a listed callable: a small object of its own type,
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

PyMethodDef kTorchFunctionDef = {
    "caster_torch_function", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(torch_function)),
    METH_FASTCALL,
    "The O1 caster's __torch_function__(func, types, args=(), kwargs=None) (docs/caster.md)"};

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

void register_bindings(py::module_& m) {
  py::module_ c = m.def_submodule("caster", "The O1 caster's C++ side (docs/caster.md)");
  // torch requires a mode's __torch_function__ to be bound to the mode (__self__ is the mode):
  // bind(mode) makes the C++ handler a builtin bound to it, stored on the instance.
  c.def(
      "bind",
      [](py::handle mode) {
        PyObject* tf = PyCFunction_NewEx(&kTorchFunctionDef, mode.ptr(), nullptr);
        if (!tf) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(tf);
      },
      py::arg("mode"), "The C++ __torch_function__ bound to mode");

  c.def(
      "wrap",
      [](py::handle orig) {
        if (!PyCallable_Check(orig.ptr())) throw py::type_error("wrap: orig must be callable");
        PyObject* f = new_cast_wrapper(orig.ptr());
        if (!f) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(f);
      },
      py::arg("orig"),
      "A CastWrapper that calls orig with the caster's casts (patch dispatch; NOTE: [Patch "
      "wrapper objects])");
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
  c.def(
      "set_hook",
      [](py::handle hook) {
        Py_XDECREF(g_hook);
        g_hook = nullptr;
        if (!hook.is_none()) {
          Py_INCREF(hook.ptr());
          g_hook = hook.ptr();
        }
      },
      py::arg("hook"), "hook(mode, func, args, kwargs) for functions with the 'hook' policy");
  c.def("set_allow_banned", [](bool v) {
    tls.allow_banned = v;
    publish();
  }, py::arg("allow_banned"));
  c.def("allow_banned", []() { return tls.allow_banned; });
  c.def("threads_on", []() { return g_threads_on.load(); },
        "How many threads have O1 on (their own state, not handed)");
  c.def("set_thread_active", [](bool v) {
    tls.active = v;
    publish();
  }, py::arg("active"));
  c.def("thread_active", []() { return tls.active; });
  c.def("suspend", []() {
    ++tls.suspended;
    publish();
  });
  c.def("resume", []() {
    if (tls.suspended <= 0) throw py::value_error("caster.resume() without a matching suspend()");
    --tls.suspended;
    publish();
  });
  c.def("suspended", []() { return tls.suspended; });
  c.def("is_casting", []() { return gate(/*in_mode=*/false).casting; },
        "True when O1 casts in this thread now: enabled, switched on here (or handed to this "
        "thread by torch with its thread-local state), not in disable_casts");
  c.def("handed_state", []() -> py::object {
    if (thread_on()) return py::none();
    const Published* h = handed_state();
    if (!h) return py::none();
    return py::make_tuple(h->active, h->suspended, h->frames.size());
  }, "(on, disable_casts depth, list-edit frames) of the caster state torch handed this thread, "
     "or None (this thread switched O1 on itself, or was handed nothing)");
  // NOTE: [Checkpoint recomputation]
  // torch.utils.checkpoint runs a forward again during backward, possibly outside the
  // disable_casts/lists.local block (or the O1 on/off state) the forward ran in; torch saves and
  // restores its autocast state around the recomputation, and peak.amp._caster does the same
  // with these: snapshot() takes the caster state in effect in this thread (its own, or the one
  // torch handed it, with its own edits on top), push_state() makes a snapshot this thread's
  // state until the matching pop_state().
  c.def("snapshot", []() -> py::object {
    Published* snap;
    if (thread_on()) {
      snap = new Published(own_state());
    } else if (const Published* h = handed_state()) {
      FrameStack frames = h->frames;
      frames.insert(frames.end(), tls.frames.begin(), tls.frames.end());
      snap = new Published{h->active, h->low, h->allow_banned, h->suspended + tls.suspended,
                           std::move(frames)};
    } else {
      snap = new Published{false, at::ScalarType::Undefined, false, 0, {}};
    }
    PyObject* capsule = PyCapsule_New(snap, kPublishedName, destroy_published);
    if (!capsule) {
      delete snap;
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(capsule);
  }, "The caster state in effect in this thread now (an opaque object for push_state)");
  c.def("push_state", [](py::handle snapshot) {
    auto* snap = static_cast<const Published*>(PyCapsule_GetPointer(snapshot.ptr(), kPublishedName));
    if (!snap) throw py::error_already_set();
    using at::impl::ThreadLocalPythonObjects;
    std::shared_ptr<c10::SafePyObject> slot;
    if (ThreadLocalPythonObjects::contains(published_key())) {
      slot = ThreadLocalPythonObjects::get(published_key());
    }
    tls.saved.push_back({own_state(), tls.published, std::move(slot)});
    set_own_state(*snap);
    publish();
    // An "off" snapshot must also hide what torch handed this thread (saved above, put back by
    // pop_state): publish() only removes what this thread published itself.
    if (!thread_on() && at::impl::ThreadLocalPythonObjects::contains(published_key())) {
      at::impl::ThreadLocalPythonObjects::erase(published_key());
    }
  }, py::arg("snapshot"), "Make a snapshot() this thread's caster state until pop_state()");
  c.def("pop_state", []() {
    if (tls.saved.empty()) throw py::value_error("pop_state() without a matching push_state()");
    SavedState prev = std::move(tls.saved.back());
    tls.saved.pop_back();
    set_own_state(std::move(prev.state));
    publish();
    if (!prev.published) {  // put back what torch handed this thread (or nothing)
      using at::impl::ThreadLocalPythonObjects;
      if (prev.slot) {
        ThreadLocalPythonObjects::set(published_key(), std::move(prev.slot));
      } else if (ThreadLocalPythonObjects::contains(published_key())) {
        ThreadLocalPythonObjects::erase(published_key());
      }
      tls.published = false;
    }
  });
  c.def(
      "call",
      [](int p, py::handle func, py::handle args, py::handle kwargs) -> py::object {
        const Policy pol = policy_from_int(p, "policy");
        if (!PyTuple_Check(args.ptr())) throw py::type_error("args must be a tuple");
        PyObject* kw = kwargs.is_none() ? nullptr : kwargs.ptr();
        if (kw && !PyDict_Check(kw)) throw py::type_error("kwargs must be a dict or None");
        PyObject* r;
        const Gate g = gate(/*in_mode=*/false);
        if (pol == Policy::kNone || !g.casting) {
          r = PyObject_Call(func.ptr(), args.ptr(), kw);
        } else {
          r = apply_policy(pol, func.ptr(), args.ptr(), kw, g);
        }
        if (!r) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(r);
      },
      py::arg("policy"), py::arg("func"), py::arg("args"), py::arg("kwargs") = py::none(),
      "Call func(*args, **kwargs) with the policy's casts when O1 casts in this thread (decorators)");

  c.def(
      "push_local",
      [](py::dict edits) {
        std::unordered_map<PyObject*, Policy> policies;
        for (auto item : edits) {
          if (!PyCallable_Check(item.first.ptr())) {
            throw py::type_error("local edits: keys must be callables, got " +
                                 py::repr(item.first).cast<std::string>());
          }
          policies[item.first.ptr()] = policy_from_int(item.second.cast<int>(), "policy");
        }
        auto frame = std::make_shared<Frame>();
        frame->policies = std::move(policies);
        for (auto& kv : frame->policies) Py_INCREF(kv.first);
        tls.frames.push_back(std::move(frame));
        publish();
      },
      py::arg("edits"), "Push thread-local edits {func: policy code} (0: unlisted here)");
  c.def("pop_local", []() {
    if (tls.frames.empty()) throw py::value_error("pop_local() without a matching push_local()");
    tls.frames.pop_back();
    publish();
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
  c.def("reset_cache_stats", []() { tls.hits = tls.casts = tls.stores = 0; });
}

}  // namespace peak::caster
