"""The O1 caster's hooks into torch internals (torch 2.13, 2.14), in place while anything holds
the caster's wrappers (O1, a list edit, a recomputation): RNNBase's dtype check relaxed and nn's
attention fast path off while O1 casts; ``torch.utils.checkpoint`` recomputing under the caster
state of the forward (torch's re-enters torch.autocast's); the cast cache cleared at each step."""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _C

_c = _C.caster
_undo: list = []  # while installed: what takes each hook out again, in order
_original: dict = {}  # what the hooks replaced, by name

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # what O1 casts (not float64)


def _rnn_check_input(self, input, batch_sizes):
    """RNNBase.check_input without its input-vs-weight dtype check while O1 casts in this thread:
    O1 casts the RNN op's input and weights alike (torch._VF.lstm & co. are listed; torch skips
    the check under autocast too), so an fp16/bf16 input (a cast Linear's output) is fine."""
    weights = self._flat_weights
    w = weights[0] if weights else None
    if (w is not None and input.dtype != w.dtype and input.dtype in _CASTABLE
            and w.dtype in _CASTABLE and _c.is_casting()):
        input = torch.empty(input.shape, dtype=w.dtype, device="meta")  # shape checks only
    return _original["check_input"](self, input, batch_sizes)


# ---- torch.utils.checkpoint: recompute under the forward's caster state

class _CheckpointFunctionProxy:
    """Stands in for torch.utils.checkpoint.CheckpointFunction while installed: ``apply`` (what
    checkpoint() calls) hands the real Function a run_function wrapped by ``wrap_recompute``;
    anything else is the real Function's (no Function subclass is made at run time)."""

    def __init__(self, function, wrap_recompute):
        self._function = function
        self._wrap = wrap_recompute

    def apply(self, run_function, preserve_rng_state, *args):
        return self._function.apply(self._wrap(run_function), preserve_rng_state, *args)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _replace(owner, name: str, new) -> None:
    _original[name] = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, new)
    _undo.append(lambda: setattr(owner, name, _original.pop(name)))


def install(wrap_recompute) -> None:
    """Every hook, once. checkpoint() is made to recompute ``wrap_recompute(fn)`` instead of
    ``fn``; it looks both of these up in its module at each call: the non-reentrant path calls the
    generator (whose ``fn`` only recomputes), the reentrant one CheckpointFunction (whose
    run_function runs in the forward, under the state it captures itself, and again in backward).
    NOTE: [Cast cache and fused steps] A fused step (peak's kernels, torch's fused=True) leaves the
    weights' version counters as they were, so a cache entry made between the backward and the
    step (a grad-mode metric or validation forward) would outlive it: any torch.optim step clears
    the cache, through torch's global step hook (optimizers not given to amp.initialize too)."""
    if _undo:
        return
    _replace(torch.nn.RNNBase, "check_input", _rnn_check_input)
    fastpath = torch.backends.mha.get_fastpath_enabled  # (held: a caller may outlive the hook)
    _replace(torch.backends.mha, "get_fastpath_enabled", lambda: fastpath() and not _c.is_casting())
    import torch.utils.checkpoint as ckpt  # noqa: PLC0415 (only when the caster is used)
    # torch 2.14 calls _checkpoint_without_reentrant_generator_impl (the old name forwards to
    # it); 2.13 has only the old one. Both take the function to recompute first.
    name = ("_checkpoint_without_reentrant_generator_impl"
            if hasattr(ckpt, "_checkpoint_without_reentrant_generator_impl")
            else "_checkpoint_without_reentrant_generator")
    generator = getattr(ckpt, name)
    _replace(ckpt, name, lambda fn, *args, **kwargs: generator(wrap_recompute(fn), *args, **kwargs))
    _replace(ckpt, "CheckpointFunction",
             _CheckpointFunctionProxy(ckpt.CheckpointFunction, wrap_recompute))
    # (run eagerly: a compiled step breaks its graph here, as amp's own step does)
    clear = torch._disable_dynamo(lambda *_: _c.clear_cache())
    _undo.append(register_optimizer_step_post_hook(clear).remove)


def remove() -> None:
    while _undo:
        _undo.pop()()
