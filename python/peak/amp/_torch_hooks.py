"""The O1 caster's hooks into torch internals (checked against torch 2.13 and 2.14), installed by
``_caster.enable`` and removed when no thread has O1 on: ``RNNBase.check_input``'s dtype check
relaxed while O1 casts; ``torch.utils.checkpoint`` recomputing under the forward's caster state."""

from __future__ import annotations

import torch

from .. import _C

_c = _C.caster

# ---- nn.RNN/LSTM/GRU under O1

_rnn_check: dict = {}  # "orig": RNNBase.check_input while some thread has O1 on
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
    return _rnn_check["orig"](self, input, batch_sizes)


def install_rnn_check() -> None:
    if not _rnn_check:
        _rnn_check["orig"] = torch.nn.RNNBase.__dict__["check_input"]
        torch.nn.RNNBase.check_input = _rnn_check_input


def remove_rnn_check() -> None:
    if _rnn_check:
        torch.nn.RNNBase.check_input = _rnn_check.pop("orig")


# ---- torch.utils.checkpoint: recompute under the forward's caster state

_checkpoint: dict = {}  # the originals replaced in torch.utils.checkpoint while O1 is on


class _CheckpointFunctionProxy:
    """Stands in for torch.utils.checkpoint.CheckpointFunction while O1 is on: ``apply`` (what
    checkpoint() calls) hands the real Function a run_function wrapped by ``wrap_recompute``;
    anything else is the real Function's (no Function subclass is made at run time)."""

    def __init__(self, function, wrap_recompute):
        self._function = function
        self._wrap = wrap_recompute

    def apply(self, run_function, preserve_rng_state, *args):
        return self._function.apply(self._wrap(run_function), preserve_rng_state, *args)

    def __getattr__(self, name):
        return getattr(self._function, name)


def install_checkpoint(wrap_recompute) -> None:
    """Make checkpoint() recompute ``wrap_recompute(fn)`` instead of ``fn``; it looks both of these
    up in its module at each call: the non-reentrant path calls the generator (whose ``fn`` only
    recomputes), the reentrant one CheckpointFunction (whose run_function runs in the forward,
    under the state it captures itself, and again in backward)."""
    if _checkpoint:
        return
    import torch.utils.checkpoint as ckpt  # noqa: PLC0415 (only when O1 is turned on)
    # torch 2.14 calls _checkpoint_without_reentrant_generator_impl (the old name forwards to
    # it); 2.13 has only the old one. Both take the function to recompute first.
    name = ("_checkpoint_without_reentrant_generator_impl"
            if hasattr(ckpt, "_checkpoint_without_reentrant_generator_impl")
            else "_checkpoint_without_reentrant_generator")
    generator = getattr(ckpt, name)
    function = ckpt.CheckpointFunction

    def checkpoint_without_reentrant_generator(fn, *args, **kwargs):
        return generator(wrap_recompute(fn), *args, **kwargs)

    _checkpoint.update(module=ckpt, name=name, generator=generator, function=function)
    setattr(ckpt, name, checkpoint_without_reentrant_generator)
    ckpt.CheckpointFunction = _CheckpointFunctionProxy(function, wrap_recompute)


def remove_checkpoint() -> None:
    if _checkpoint:
        ckpt = _checkpoint.pop("module")
        setattr(ckpt, _checkpoint.pop("name"), _checkpoint.pop("generator"))
        ckpt.CheckpointFunction = _checkpoint.pop("function")

