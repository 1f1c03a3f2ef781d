// The O1 caster's thread state (internal to csrc/caster): what each thread has switched on, its
// list-edit frames, its weight-cast cache, and the snapshot of it torch carries to its worker
// threads. state.cpp defines it; cast.cpp reads it on every call; caster.cpp (the Python
// binding) changes it. See docs/caster.md.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/SafePyObject.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "policy.h"

namespace peak::caster {

// Per thread (ThreadState below): O1 on or off, the low dtype, allow_banned. Process-wide: how
// many threads have O1 on or a region edit open (the wrappers' fast path when none has).
extern std::atomic<int> g_threads_on;

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
// would otherwise be served). A fused optimizer step writes weights without moving their version
// counters, so every optimizer step clears the cache (NOTE: [Cast cache and fused steps] in
// python/peak/amp/_torch_hooks.py). Entries also keep their weight alive (the cast's autograd graph
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
  uint32_t cast_version;  // the cast's own: an in-place op on it (an edited region's) drops it
};

// One list-edit frame: a peak.amp.lists.local block's edits (acting where O1 casts), or a region
// edit of peak.amp.autocast(fp32_ops=..., lower_ops=...) (`region`: acting where torch's autocast
// is on for `device`, on tensors of that device type, in autocast's dtype). Immutable once
// pushed, so that published snapshots share it (its references are released by the last owner,
// the snapshot capsule's destructor).
struct Frame {
  std::unordered_map<PyObject*, Policy> policies;
  bool region = false;
  c10::DeviceType device = c10::DeviceType::CPU;
  std::unordered_set<PyObject*> input_only;  // region: cast only the first argument (batch norm)
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

// Per thread: O1 on or off here, disable_casts depth, list-edit frames, the weight-cast cache.
struct ThreadState {
  at::ScalarType low = at::ScalarType::Undefined;  // this thread's low dtype (Undefined: O1 off)
  bool allow_banned = false;
  bool counted = false;  // counted in g_threads_on
  ~ThreadState() {
    if (counted) g_threads_on.fetch_sub(1, std::memory_order_relaxed);
  }
  int suspended = 0;
  // Listed ops running now in this thread: calls they make in turn are not cast again (the op
  // is cast once, at its entry point, as if by hand).
  int in_op = 0;
  bool active = false;
  bool published = false;  // this thread's snapshot is in its ThreadLocalPythonObjects
  std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> cache;
  size_t next_sweep = 64;  // cache size at which a store sweeps dead entries first
  int64_t hits = 0, casts = 0, stores = 0;
  FrameStack frames;  // thread-local list edits (lists.local, autocast regions), innermost last
  std::vector<SavedState> saved;  // push_state's stack
};
// Defined in state.cpp. Outside that file every mention of `tls` calls its TLS init function and
// looks the address up again (the compiler cannot merge the calls), so the per-call paths bind a
// reference once (`ThreadState& tls_ = tls;`) and use that.
extern thread_local ThreadState tls;

// The key of this thread's snapshot in at::impl::ThreadLocalPythonObjects (NOTE: [Caster state
// in torch's worker threads] in state.cpp).
inline constexpr char kPublishedName[] = "peak.caster.state";
const std::string& published_key();
void destroy_published(PyObject* capsule);  // a snapshot capsule's destructor

inline bool thread_on() { return tls.active && tls.low != at::ScalarType::Undefined; }
inline bool any_region(const FrameStack& frames) {
  for (const auto& f : frames) {
    if (f->region) return true;
  }
  return false;
}

Published own_state();
void set_own_state(Published s);
// Called after every change of this thread's state.
void publish();
// The snapshot torch handed this thread, or nullptr.
const Published* handed_state();

// NOTE: [Checkpoint recomputation] in state.cpp.
PyObject* snapshot_state();  // new reference: a capsule for push_state
void push_state(PyObject* snapshot);  // throws if it is not a snapshot capsule
void pop_state();

struct InOp {
  InOp() : state(tls) { ++state.in_op; }
  ~InOp() { --state.in_op; }
  InOp(const InOp&) = delete;
  InOp& operator=(const InOp&) = delete;
  ThreadState& state;
};

// Whether O1 casts in this thread now, and whose state says so.
struct Gate {
  bool casting = false;
  bool own = false;                   // this thread's own state: the weight-cast cache may serve
  const Published* handed = nullptr;  // else the snapshot handed to this thread, if any
  at::ScalarType low = at::ScalarType::Undefined;
  bool allow_banned = false;
};

// `handed`: handed_state() when this thread has not switched O1 on itself, else nullptr.
inline Gate gate(const ThreadState& t, const Published* handed) {
  if (t.suspended > 0 || t.in_op > 0) return {};
  if (t.active && t.low != at::ScalarType::Undefined) {  // thread_on()
    return {true, true, nullptr, t.low, t.allow_banned};
  }
  if (!handed) return {};
  return {handed->active && handed->suspended == 0, false, handed, handed->low,
          handed->allow_banned};
}

inline Gate current_gate() {
  if (g_threads_on.load(std::memory_order_relaxed) == 0) return {};
  ThreadState& tls_ = tls;
  const bool own = tls_.active && tls_.low != at::ScalarType::Undefined;
  return gate(tls_, own ? nullptr : handed_state());
}

// O1's edits only: region frames act on their own terms (cast.cpp).
inline bool find_in(const FrameStack& frames, PyObject* func, Policy& out) {
  for (auto f = frames.rbegin(); f != frames.rend(); ++f) {
    if ((*f)->region) continue;
    auto it = (*f)->policies.find(func);
    if (it != (*f)->policies.end()) {
      out = it->second;
      return true;
    }
  }
  return false;
}

// The O1 policy of func in this thread: the innermost lists.local edit (this thread's, then the
// handed snapshot's), else the process-wide table.
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

}  // namespace peak::caster
