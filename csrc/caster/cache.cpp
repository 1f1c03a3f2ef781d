// The O1 caster's weight-cast cache (cast.h; NOTE: [Weight-cast cache lifetime] in state.h).
#include "cast.h"

#include <torch/csrc/autograd/function_hook.h>
// torch::autograd::Node: node.h from torch 2.13 on, function.h before (which still includes it).
#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else
#include <torch/csrc/autograd/function.h>
#endif

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>

namespace peak::caster {
namespace {

struct MarkUsedOnBackward : torch::autograd::FunctionPreHook {
  explicit MarkUsedOnBackward(std::shared_ptr<std::atomic<bool>> flag) : used(std::move(flag)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    used->store(true, std::memory_order_relaxed);
    return grads;
  }
  // Compiled autograd asks every hook of a graph it runs for its arguments instead of calling it:
  // that is the backward pass reaching the cast too.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const override {
    used->store(true, std::memory_order_relaxed);
  }
  std::shared_ptr<std::atomic<bool>> used;
};

constexpr size_t kCacheCapacity = 4096;

// NOTE: [Weight-cast cache lifetime]: drops what can never serve again; bounds the rest.
void sweep_cache() {
  ThreadState& tls_ = tls;  // one TLS lookup (see the note on `tls` in state.h)
  for (auto it = tls_.cache.begin(); it != tls_.cache.end();) {
    const bool dead = it->second.source.expired() ||
                      it->second.used->load(std::memory_order_relaxed);
    it = dead ? tls_.cache.erase(it) : std::next(it);
  }
  if (tls_.cache.size() >= kCacheCapacity) tls_.cache.clear();
  tls_.next_sweep = std::min(kCacheCapacity, std::max<size_t>(64, 2 * tls_.cache.size()));
}

}  // namespace

// (cast.h)
at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, bool use_cache) {
  ThreadState& tls_ = tls;  // one TLS lookup (see the note on `tls` in state.h)
  if (t.scalar_type() == to) return t;
  // (an inference tensor, e.g. a weight made under inference mode, has no version counter; a
  // torch.func wrapper has no storage to key by)
  const bool cacheable = use_cache && t.scalar_type() == at::ScalarType::Float && t.is_leaf() &&
                         t.requires_grad() && !t.is_view() && !c10::InferenceMode::is_enabled() &&
                         !t.is_inference() && t.has_storage();
  if (!cacheable) {
    ++tls_.casts;
    return t.to(to);
  }
  CacheKey key{t.unsafeGetTensorImpl(), to};
  const uint32_t version = t.unsafeGetTensorImpl()->version_counter().current_version();
  auto it = tls_.cache.find(key);
  if (it != tls_.cache.end()) {
    const CacheEntry& e = it->second;
    if (!e.source.expired() && e.version == version && e.data == t.data_ptr() &&
        !e.used->load(std::memory_order_relaxed) &&
        e.cast.unsafeGetTensorImpl()->version_counter().current_version() == e.cast_version) {
      ++tls_.hits;
      return e.cast;
    }
    tls_.cache.erase(it);  // stale (NOTE: [Weight-cast cache lifetime])
  }
  ++tls_.casts;
  at::Tensor out = t.to(to);
  // Only a grad-mode cast is stored: one made under no_grad has no autograd history, and reusing
  // it in a later grad-enabled forward would silently cut the weight's gradient (torch #112583).
  if (c10::GradMode::is_enabled() && out.grad_fn()) {
    if (tls_.cache.size() >= tls_.next_sweep) sweep_cache();
    ++tls_.stores;
    auto used = std::make_shared<std::atomic<bool>>(false);
    out.grad_fn()->add_pre_hook(std::make_unique<MarkUsedOnBackward>(used));
    const uint32_t cast_version = out.unsafeGetTensorImpl()->version_counter().current_version();
    tls_.cache.emplace(key, CacheEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(
                                          t.getIntrusivePtr()),
                                      version, t.data_ptr(), std::move(used), out, cast_version});
  }
  return out;
}

}  // namespace peak::caster
