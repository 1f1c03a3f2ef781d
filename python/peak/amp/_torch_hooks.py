"""The O1 caster's hooks into torch internals (torch 2.13, 2.14), while some thread has O1 on:
RNNBase's dtype check relaxed and nn's attention fast path off while O1 casts; and while anything
holds the caster's wrappers (O1, a list edit, a recomputation): the cast cache cleared at each
step, ``torch.utils.checkpoint`` recomputing under the forward's caster state."""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _C

_c = _C.caster
_undo: dict = {"o1": [], "held": []}  # what takes each group's hooks out again, in order
_original: dict = {}  # what the hooks replaced, by name (kept after: for a caller in flight)

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # what O1 casts (not float64)


def _rnn_check_input(self, input, batch_sizes):
    """RNNBase.check_input without its input-vs-weight dtype check while O1 casts in this thread:
    O1 casts the RNN op's input and weights alike (torch._VF.lstm & co. are listed; torch skips
    the check under autocast too), so an fp16/bf16 input (a cast Linear's output) is fine."""
    weights = self._flat_weights
    w = weights[0] if weights else None
    if (w is not None and input.dtype != w.dtype and input.dtype in _CASTABLE
            and w.dtype in _CASTABLE and not torch.compiler.is_compiling() and _c.is_casting()):
        input = torch.empty(input.shape, dtype=w.dtype, device="meta")  # shape checks only
    return _original["check_input"](self, input, batch_sizes)


# ---- torch.utils.checkpoint: recompute under the forward's caster state

class _CheckpointFunctionProxy:
    """Stands in for torch.utils.checkpoint.CheckpointFunction while installed: ``apply`` (what
    checkpoint() calls) hands the real Function a run_function wrapped by ``wrap_recompute``;
    anything else is the real Function's (no Function subclass is made at run time)."""

    def __init__(self, function, wrap_recompute):
        self._function, self._wrap = function, wrap_recompute

    def apply(self, run_function, preserve_rng_state, *args):
        return self._function.apply(self._wrap(run_function), preserve_rng_state, *args)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _replace(owner, name: str, new, group: str = "o1") -> None:
    _original[name] = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, new)
    _undo[group].append(lambda: setattr(owner, name, _original[name]))


def install(wrap_recompute, o1: bool = True) -> None:
    """Each hook once (``o1=False``: not O1's own). checkpoint() is made to recompute
    ``wrap_recompute(fn)``; it looks both of these up in its module at each call: the non-reentrant
    path calls the generator (``fn`` only recomputes), the reentrant one CheckpointFunction (its
    run_function runs in the forward, under the state it captures itself, and again in backward).
    NOTE: [Cast cache and fused steps] A fused step (peak's, torch's fused=True) bumps no version
    counter, so a cache entry made between the backward and the step (a grad-mode metric or a
    validation forward) would outlive it: torch's global step hook clears it at every step."""
    if o1 and not _undo["o1"]:
        _replace(torch.nn.RNNBase, "check_input", _rnn_check_input)
        fastpath = torch.backends.mha.get_fastpath_enabled  # (held: a caller may outlive it)
        _replace(torch.backends.mha, "get_fastpath_enabled",  # (Dynamo cannot trace is_casting)
                 lambda: fastpath() and (torch.compiler.is_compiling() or not _c.is_casting()))
    if _undo["held"]:
        return
    clear = torch._disable_dynamo(lambda *_: _c.clear_cache())  # (as amp's step: eager)
    _undo["held"].append(register_optimizer_step_post_hook(clear).remove)
    import torch.utils.checkpoint as ckpt  # noqa: PLC0415 (only when the caster is used)
    # torch 2.14 calls _checkpoint_without_reentrant_generator_impl (the old name forwards to
    # it); 2.13 has only the old one. Both take the function to recompute first.
    name = ("_checkpoint_without_reentrant_generator_impl"
            if hasattr(ckpt, "_checkpoint_without_reentrant_generator_impl")
            else "_checkpoint_without_reentrant_generator")
    generator = getattr(ckpt, name)
    _replace(ckpt, name, lambda fn, *a, **kw: generator(wrap_recompute(fn), *a, **kw), "held")
    _replace(ckpt, "CheckpointFunction",
             _CheckpointFunctionProxy(ckpt.CheckpointFunction, wrap_recompute), "held")


def remove(o1: bool = True) -> None:
    undo = _undo["o1" if o1 else "held"]
    while undo:
        undo.pop()()
