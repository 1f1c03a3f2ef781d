"""The torch-private hooks of the O1 caster, in one module: what depends on torch internals, and
so on the torch release, lives here and nowhere else (checked against torch 2.13 and 2.14).

- the autograd engine entry (``torch.autograd.graph._engine_run_backward`` and the argument
  helpers of ``torch.autograd``): backward runs with a caster mode still on the stack;
- ``torch.nn.RNNBase.check_input``: its input-vs-weight dtype check, relaxed while O1 casts;
- ``torch.utils.checkpoint``'s non-reentrant generator and ``CheckpointFunction``: the
  recomputation runs under the forward's caster state.

Each hook is installed by ``_caster.enable`` and removed when no thread has O1 on any more.
"""

from __future__ import annotations

import torch

from .. import _C

_c = _C.caster

__all__ = ["AUTOGRAD_ENTRIES", "run_autograd_in_mode", "remove_mode", "install_rnn_check",
           "remove_rnn_check", "install_checkpoint", "remove_checkpoint"]

def run_autograd_in_mode(mode, func, args, kwargs):
    """Run an autograd entry point (``Tensor.backward``, ``torch.autograd.backward``,
    ``torch.autograd.grad``) with ``mode`` on the torch-function mode stack.

    torch pops a mode while its ``__torch_function__`` runs, so a plain call-through would run
    the engine -- and with it the recomputation of ``torch.utils.checkpoint`` -- without the
    mode: recomputed activations would not get the forward's dtypes (checkpoint then raises, or
    the gradients differ). So the argument handling of the entry point is done here and the
    engine is run with the mode back on the stack (as Apex's process-wide patches did). Used by
    the O1 caster's mode dispatch and by ``peak.amp.autocast``'s list edits."""
    kwargs = dict(kwargs or {})
    if _engine is None or func not in _AUTOGRAD_SIGNATURES:
        return func(*args, **kwargs)
    a = _AUTOGRAD_SIGNATURES[func].bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    if func is torch.autograd.grad:
        if a["is_grads_batched"]:
            return func(*args, **kwargs)  # vmap over the engine: left to torch (not re-moded)
        outputs = (a["outputs"],) if _is_one(a["outputs"]) else tuple(a["outputs"])
        inputs = (a["inputs"],) if _is_one(a["inputs"]) else tuple(a["inputs"])
        allow_unused = a["allow_unused"]
        if a["materialize_grads"] and allow_unused is False:
            return func(*args, **kwargs)  # torch's own error
        if allow_unused is None:
            allow_unused = a["materialize_grads"]
        grads = _engine["make_grads"](outputs, _engine["to_tuple"](a["grad_outputs"], len(outputs)),
                                      is_grads_batched=False)
        retain_graph = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
        with _mode_pushed(mode):
            result = _engine["run"](outputs, grads, retain_graph, a["create_graph"], inputs,
                                    allow_unused, accumulate_grad=False)
            if a["materialize_grads"]:
                result = tuple(r if r is not None else torch.zeros_like(i, requires_grad=True)
                               for r, i in zip(result, inputs))
        return result
    if func is torch.Tensor.backward:
        tensors, grad_tensors = a["self"], a["gradient"]
    else:
        tensors = a["tensors"]
        grad_tensors = a["grad_tensors"] if a["grad_variables"] is None else a["grad_variables"]
    inputs = a["inputs"]
    if inputs is not None and not _is_one(inputs) and len(inputs) == 0:
        return func(*args, **kwargs)  # torch's own error
    tensors = (tensors,) if _is_one(tensors) else tuple(tensors)
    inputs = (inputs,) if _is_one(inputs) else tuple(inputs) if inputs is not None else ()
    grads = _engine["make_grads"](tensors, _engine["to_tuple"](grad_tensors, len(tensors)),
                                  is_grads_batched=False)
    retain_graph = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
    with _mode_pushed(mode):
        _engine["run"](tensors, grads, retain_graph, a["create_graph"], inputs,
                       allow_unreachable=True, accumulate_grad=True)
    return None


def _is_one(x) -> bool:
    return isinstance(x, torch.Tensor) or type(x).__name__ == "GradientEdge"


class _mode_pushed:
    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        torch._C._push_on_torch_function_stack(self.mode)

    def __exit__(self, *exc):
        remove_mode(self.mode)


try:  # torch internals used by run_autograd_in_mode (present in 2.3 .. 2.14); else call through
    import inspect as _inspect

    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
    _engine = {"make_grads": _make_grads, "to_tuple": _tensor_or_tensors_to_tuple,
               "run": _engine_run_backward}
    _AUTOGRAD_SIGNATURES = {f: _inspect.signature(f) for f in
                            (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)}
except (ImportError, ValueError, TypeError):  # pragma: no cover
    _engine = None
    _AUTOGRAD_SIGNATURES = {}

#: The autograd entry points that get the "hook" policy (see run_autograd_in_mode).
AUTOGRAD_ENTRIES = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def remove_mode(mode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack (wherever it sits)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


# ---- nn.RNN/LSTM/GRU under O1

_rnn_check: dict = {}  # "orig": RNNBase.check_input while some thread has O1 on
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # what O1 casts (not float64)


def _rnn_check_input(self, input, batch_sizes):
    """RNNBase.check_input, without its input-vs-weight dtype check while O1 casts in this thread:
    O1 casts the RNN op's input and weights alike (torch._VF.lstm & co. are listed), and torch
    skips the same check under autocast for the same reason. An fp16/bf16 input (the output of a
    cast Linear, of a previous LSTM) would otherwise be refused by the fp32 module."""
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
    """Make checkpoint() recompute ``wrap_recompute(fn)`` instead of ``fn``. checkpoint() looks
    both of these up in its module at each call: the non-reentrant path calls the generator
    (whose ``fn`` is used only to recompute), the reentrant one CheckpointFunction (whose
    run_function runs in the forward, under the state it captures itself, and again in
    backward)."""
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

