// The O1 caster's thread state: its definition, the snapshot torch carries to its worker threads,
// and the save/restore of checkpoint recomputation. See state.h and docs/caster.md.
#include "state.h"

#include <torch/csrc/PyInterpreter.h>
#include <pybind11/pybind11.h>

#include <ATen/ThreadLocalPythonObjects.h>

namespace py = pybind11;

namespace peak::caster {

std::atomic<int> g_threads_on{0};
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

const std::string& published_key() {
  static const std::string key = kPublishedName;
  return key;
}

void destroy_published(PyObject* capsule) {
  delete static_cast<Published*>(PyCapsule_GetPointer(capsule, kPublishedName));
}

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


// Removes this thread's published state. torch 2.13 added ThreadLocalPythonObjects::erase; on
// older releases the slot is set to None instead, which handed_state() reads as "nothing
// handed" (a template, so that the branch without erase is never compiled against a torch
// that has it, and the reverse).
template <typename Objects>
void unpublish(const std::string& key) {
  if constexpr (requires { Objects::erase(key); }) {
    Objects::erase(key);
  } else {
    Objects::set(key, std::make_shared<c10::SafePyObject>(Py_NewRef(Py_None), getPyInterpreter()));
  }
}

void publish() {
  using at::impl::ThreadLocalPythonObjects;
  const bool on = thread_on() || any_region(tls.frames);
  if (on != tls.counted) {
    g_threads_on.fetch_add(on ? 1 : -1, std::memory_order_relaxed);
    tls.counted = on;
  }
  if (!on) {
    if (tls.published && ThreadLocalPythonObjects::contains(published_key())) {
      unpublish<ThreadLocalPythonObjects>(published_key());
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

const Published* handed_state() {
  using at::impl::ThreadLocalPythonObjects;
  if (!ThreadLocalPythonObjects::contains(published_key())) return nullptr;
  PyObject* capsule = ThreadLocalPythonObjects::get(published_key())->ptr(getPyInterpreter());
  if (!PyCapsule_IsValid(capsule, kPublishedName)) return nullptr;  // None: see unpublish
  return static_cast<const Published*>(PyCapsule_GetPointer(capsule, kPublishedName));
}

// NOTE: [Checkpoint recomputation]
// torch.utils.checkpoint runs a forward again during backward, possibly outside the
// disable_casts/lists.local block (or the O1 on/off state) the forward ran in; torch saves and
// restores its autocast state around the recomputation, and peak.amp._caster does the same
// with these: snapshot_state() takes the caster state in effect in this thread (its own, or the
// one torch handed it, with its own edits on top), push_state() makes a snapshot this thread's
// state until the matching pop_state().
PyObject* snapshot_state() {
  Published* snap;
  const Published* h = thread_on() ? nullptr : handed_state();
  if (h) {
    FrameStack frames = h->frames;
    frames.insert(frames.end(), tls.frames.begin(), tls.frames.end());
    snap = new Published{h->active, h->low, h->allow_banned, h->suspended + tls.suspended,
                         std::move(frames)};
  } else {
    snap = new Published(own_state());
  }
  PyObject* capsule = PyCapsule_New(snap, kPublishedName, destroy_published);
  if (!capsule) {
    delete snap;
    throw py::error_already_set();
  }
  return capsule;
}

void push_state(PyObject* snapshot) {
  auto* snap = static_cast<const Published*>(PyCapsule_GetPointer(snapshot, kPublishedName));
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
  if (!tls.published && ThreadLocalPythonObjects::contains(published_key())) {
    unpublish<ThreadLocalPythonObjects>(published_key());
  }
}

void pop_state() {
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
      unpublish<ThreadLocalPythonObjects>(published_key());
    }
    tls.published = false;
  }
}

}  // namespace peak::caster
