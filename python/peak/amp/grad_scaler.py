"""``peak.amp.GradScaler``: torch.amp.GradScaler's API (constructor, methods, errors, state
machine, ``state_dict`` keys, pickling, fused-optimizer hand-off) as a front door over peak's
scaling core (``peak.scaling``), plus what torch's lacks: see docs/torch_dialect.md."""
from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections import abc, defaultdict
from importlib.util import find_spec
from typing import Any

import torch
import torch.amp.grad_scaler as _torch_grad_scaler

from .. import _C
from ..scaling import (SMALLEST_SCALE, LossScale, OverflowFlags, check_scale, core_attribute,
                       agree_on_overflow as _agree_on_overflow, merge_flags, optimizer_gradients,
                       skip_leaves_state_unset, unscale_grads_)
from .overflow_report import OverflowAttribution, OverflowReport

_CHUNK_SIZE = 65536
_unscale_param_grads = _C.unscale_param_grads  # the C++ walk over param_groups (param_grads.cpp)


# torch's enum and factory, so that code comparing stages with torch's OptState works.
OptState = _torch_grad_scaler.OptState
_refresh_per_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


class _ConfigError(ValueError, AssertionError):
    """A bad constructor argument where torch raises AssertionError (growth/backoff factors)."""


def _number(kind: type, name: str, value):
    """``value`` as a ``kind``, or a one-element tensor of that kind (as torch's scaler takes)."""
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool
            and (kind is float or not value.is_floating_point())):
        return kind(value)
    if isinstance(value, bool) or not isinstance(
            value, numbers.Real if kind is float else numbers.Integral):
        raise TypeError(f"GradScaler: {name} must be {'a float' if kind is float else 'an int'}, "
                        f"got {type(value).__name__} ({value!r})")
    return kind(value)


_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale",
            "growth_interval", "hysteresis")


def check_options(options: dict, on_min_scale) -> dict:
    """GradScaler's options as numbers, or the error torch (or peak, for its own) raises."""
    ints, optional = ("growth_interval", "hysteresis"), ("min_scale", "max_scale")
    o = {name: None if value is None and name in optional
         else _number(int if name in ints else float, name, value)
         for name, value in options.items()}
    if on_min_scale not in ("warn", "raise", "keep"):
        raise ValueError(f"GradScaler: on_min_scale must be one of ('warn', 'raise', 'keep'), "
                         f"got {on_min_scale!r}")
    # torch's two checks (AssertionError there; _ConfigError is also an AssertionError).
    if not o["growth_factor"] > 1.0:  # (NaN too)
        raise _ConfigError("The growth factor must be > 1.0.")
    if not o["backoff_factor"] < 1.0:
        raise _ConfigError("The backoff factor must be < 1.0.")
    init_scale, min_scale, max_scale = o["init_scale"], o["min_scale"], o["max_scale"]
    check_scale("GradScaler: init_scale", init_scale)
    if not o["backoff_factor"] > 0:
        raise ValueError(f"GradScaler: backoff_factor must be > 0, got {o['backoff_factor']}")
    for name, what in (("growth_interval", ""), ("hysteresis", " (1 backs off at the first "
                                                               "overflow, as torch)")):
        if not 1 <= o[name] <= 2**31 - 1:  # (the update kernel's counters are int32)
            raise ValueError(f"GradScaler: {name} must be in [1, 2**31 - 1]{what}, got {o[name]}")
    if min_scale is not None and not (0 <= min_scale <= init_scale):
        raise ValueError(f"GradScaler: min_scale={min_scale} must be in [0, init_scale="
                         f"{init_scale}]; lower min_scale or raise init_scale")
    if max_scale is not None and not (max_scale >= init_scale):
        raise ValueError(f"GradScaler: max_scale={max_scale} must be >= init_scale="
                         f"{init_scale}; raise max_scale or lower init_scale")
    return o


# NOTE: [GradScaler under torch.compile] _eager methods run eagerly, whole (a graph break): one
# traced in part lost the state it set before the break (a defaultdict entry): unscaled twice.
_eager = torch._disable_dynamo  # (torch.optim's lazy form: importing Dynamo costs a second)


class GradScaler(OverflowAttribution, torch.amp.GradScaler):
    """Gradient scaling for mixed-precision training; a drop-in for ``torch.amp.GradScaler`` (a
    subclass: ``isinstance(scaler, torch.amp.GradScaler)`` holds), used as torch's,
    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``, with the same
    arguments. Beyond torch (docs/torch_dialect.md): back off only after ``hysteresis``
    overflowing iterations in a row (overflowing steps are always skipped);
    ``min_scale``/``max_scale`` bound the scale (None: unbounded); ``on_min_scale`` ("warn",
    "raise" or "keep"): what ``update()`` does when gradients overflow at the floor."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, hysteresis: int = 1,
                 min_scale: float | None = None, max_scale: float | None = None,
                 on_min_scale: str = "warn") -> None:
        if isinstance(device, torch.device):
            device = device.type
        if not isinstance(device, str):
            raise TypeError(f"GradScaler: device must be a device type string such as 'cuda' or "
                            f"'cpu', got {type(device).__name__}")
        try:
            self._device = torch.device(device).type  # only the type matters: "cuda:1" is "cuda"
        except RuntimeError as e:
            raise ValueError(f"GradScaler: device={device!r} is not a device type "
                             f"(use 'cuda', 'cpu', ...): {e}") from None
        self._enabled = bool(enabled)  # torch takes any truthy value (1, None, ...)
        if (self._device == "cuda" and self._enabled
                and not (torch.cuda.is_available() or find_spec("torch_xla") is not None)):
            warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  "
                          "Disabling.", stacklevel=2)
            self._enabled = False
        options = dict(zip(_OPTIONS, (init_scale, growth_factor, backoff_factor, min_scale,
                                      max_scale, growth_interval, hysteresis)))
        if self._enabled:  # a disabled scaler checks nothing (as torch's): it never uses them
            options = check_options(options, on_min_scale)
        # The state: 0-dim tensors created on the device of the first tensor scale() sees.
        self._core = LossScale(**options, shape=())
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(
            _refresh_per_optimizer_state)
        self._on_min_scale = on_min_scale
        self._reset_transient_state()
        self._reset_overflow_state()

    def _reset_transient_state(self) -> None:
        """State that lives within one iteration or is derived from the tensors (never pickled)."""
        self._inv_scale: torch.Tensor | None = None  # 1/scale for this iteration (float64 math)
        self._host_found_inf: dict[int, float] = {}  # found_inf already read by a non-fused step
        self._last_skipped: bool | torch.Tensor = False
        self._step_sig_cache: dict = {}

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._core.materialize(dev)

    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool, *, _check_only: bool = False
                        ) -> dict[torch.device, torch.Tensor]:
        """Unscale and check ``optimizer``'s gradients in place, one multi-tensor pass per (device,
        dtype): ``{device: found_inf}``. ``allow_fp16`` is ignored (fp16/bf16: fp32 math)."""
        flags = OverflowFlags((), first=found_inf)
        report = self._report_enabled
        if not report and inv_scale.device == found_inf.device:
            # Plain gradients on the scale's device, gathered in C++ (benchmarks/README.md: it
            # pays for many small gradients); -1: nothing was written, gather them here.
            count = _unscale_param_grads(optimizer.param_groups, inv_scale, found_inf,
                                         _check_only, _CHUNK_SIZE)
            if count >= 0:
                return {found_inf.device: found_inf} if count else {}
        grads, owners = optimizer_gradients(optimizer, report)
        _refuse_overlapping(grads)  # (before any gradient is unscaled or stepped)
        on_group = None
        if report:
            def on_group(indices, per_grad_flags):
                self._record_flags(optimizer, [owners[i] for i in indices], per_grad_flags)
        with torch.no_grad():
            unscale_grads_(grads, inv_scale, flags, check_only=_check_only, float64=True,
                           on_group=on_group)
        _agree_on_overflow(optimizer, flags)
        return flags

    @staticmethod
    def _check_optimizer(optimizer, method: str) -> None:
        if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
            raise TypeError(f"GradScaler.{method}: optimizer must be a torch.optim.Optimizer (an "
                            f"object with param_groups and step()), got "
                            f"{type(optimizer).__name__}; pass the optimizer, not the model")

    @_eager
    def unscale_(self, optimizer) -> None:
        """Divides ("unscales") the optimizer's gradients (fp32, fp16 or bf16) by the scale
        factor, in place, checking them for inf/NaN (one pass). Optional: ``step()`` does it if
        you don't. No host sync."""
        if not self._enabled:
            return
        self._check_optimizer(optimizer, "unscale_")
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        if self._inv_scale is None:  # one per iteration
            self._inv_scale = self._core.inv_scale()
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, self._inv_scale, found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED

    @_eager
    def _check_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        """Check gradients for inf/NaN without unscaling them (fused-optimizer path)."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.ones((), dtype=torch.float32, device=_scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=_scale.device)
        # A read-only pass; a subclass's override keeps torch's 4-argument contract (as FSDP's).
        own = type(self)._unscale_grads_ is GradScaler._unscale_grads_
        per_device = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True,
                                          **({"_check_only": True} if own else {}))
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    @_eager
    def _check_inf_by_norm(self, optimizer) -> torch.Tensor | None:
        """Fused path of an optimizer that clips (peak's, ``max_grad_norm > 0``): the global norm
        of the still-scaled gradients is the inf/NaN check too, and the step clips with it."""
        self._check_scale_growth_tracker("_check_inf_by_norm")
        norm = optimizer.grad_norm()
        per_device = {} if norm is None else {
            norm.device: (~torch.isfinite(norm)).to(torch.float32).reshape(())}
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return norm

    def _combined_found_inf(self, optimizer_state) -> torch.Tensor:
        """The optimizer's overflow flags merged ("any") on the scale's device (a new tensor)."""
        return merge_flags(optimizer_state["found_inf_per_device"].values(), self._scale.device)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        """Run ``optimizer.step`` unless a gradient held inf/NaN: the one host read of a non-fused
        step (torch reads once per device, this reads once per optimizer)."""
        found = float(self._combined_found_inf(optimizer_state).item())
        self._host_found_inf[id(optimizer)] = found
        retval = None if found else optimizer.step(*args, **kwargs)
        self._record_skip(found != 0)
        return retval

    def _step_signature(self, optimizer) -> tuple[bool, bool, bool]:
        """(takes ``grad_scaler=`` (torch's legacy contract), takes ``grad_scale=``/``found_inf=``
        keywords (peak's fused optimizers), takes ``grad_norm=``), cached per step function."""
        step = optimizer.step
        key = getattr(step, "__func__", step)
        cached = self._step_sig_cache.get(key)
        if cached is None:
            params = inspect.signature(step).parameters
            cached = ("grad_scaler" in params, "grad_scale" in params and "found_inf" in params,
                      "grad_norm" in params)
            if len(self._step_sig_cache) >= 64:  # code that re-wraps step() every iteration
                self._step_sig_cache.clear()
            self._step_sig_cache[key] = cached
        return cached

    @_eager
    def step(self, optimizer, *args, **kwargs):
        """Unscale the gradients (unless ``unscale_`` did already) and call ``optimizer.step()``
        if none of them held inf/NaN; returns its return value, or None when skipped.

        Optimizers with ``_step_supports_amp_scaling = True`` (torch's fused Adam/AdamW/SGD,
        peak's fused optimizers) get ``optimizer.grad_scale`` and ``optimizer.found_inf`` (device
        tensors) and skip on the device: no host sync (torch's fused SGD with momentum: one read
        until its buffers exist, ``scaling.skip_leaves_state_unset``). Else one host read decides.
        ``*args``/``**kwargs`` go to ``optimizer.step``; a ``closure`` is not supported."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_optimizer(optimizer, "step")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            unset, kwargs_ = skip_leaves_state_unset(optimizer), kwargs
            has_grad_scaler_kwarg, takes_scale_kwargs, takes_norm = self._step_signature(optimizer)
            grad_norm = None
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the "
                    "passed optimizer. In the near future GradScaler registers `grad_scale: "
                    "Tensor` and `found_inf: Tensor` to the passed optimizer and let the optimizer "
                    "use them directly.", FutureWarning, stacklevel=2)
                kwargs_.update({"grad_scaler": self})
            else:
                if optimizer_state["stage"] is OptState.READY:
                    if (takes_norm and getattr(optimizer, "clips_by_norm", False)
                            and not self._report_enabled):
                        grad_norm = self._check_inf_by_norm(optimizer)
                    else:
                        self._check_inf_per_device(optimizer)
                # No gradients at all this iteration: found_inf is zero (torch: sum([])).
                found_inf = self._combined_found_inf(optimizer_state)
                # After unscale_ the gradients carry no scale of ours: the optimizer gets only
                # what the user set (as torch). Else fresh tensors, which the optimizer may write.
                scale = getattr(optimizer, "grad_scale", None)
                if optimizer_state["stage"] is not OptState.UNSCALED:
                    scale = self._scale.clone() if scale is None else self._scale * scale
                optimizer.grad_scale = scale
                optimizer.found_inf = found_inf
                if takes_scale_kwargs:
                    # peak's fused optimizers take them as keywords; torch's read the attributes.
                    kwargs_ = {"grad_scale": optimizer.grad_scale, "found_inf": found_inf, **kwargs}
                    if grad_norm is not None:
                        kwargs_.setdefault("grad_norm", grad_norm)
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale, optimizer.found_inf
            if optimizer_state["found_inf_per_device"]:
                self._record_skip(found := self._combined_found_inf(optimizer_state))
                for p in unset if unset and found.item() else ():  # (one read: its new buffers
                    optimizer.state[p].pop("momentum_buffer", None)  # are uninitialised)
            return retval
        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    @_eager
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale at the end of an iteration (after ``step`` for every optimizer):
        back off if any step overflowed (after ``hysteresis`` overflowing iterations in a row, not
        below ``min_scale``), grow after ``growth_interval`` clean iterations (not above
        ``max_scale``), on the device (no host sync but ``on_min_scale``'s); or set ``new_scale``:
        a float >= 2**-127, or a one-element tensor (on the device: raised to 2**-127 if below)."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        floor_hit = False
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                self._scale.fill_(check_scale("GradScaler.update: new_scale", float(new_scale)))
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if not isinstance(new_scale, torch.Tensor):
                    raise TypeError(f"{reason} Got {type(new_scale).__name__}.")
                if (new_scale.device.type != self._device or new_scale.numel() != 1
                        or new_scale.requires_grad):
                    raise AssertionError(reason)
                self._scale.copy_(new_scale.reshape(())).clamp_(min=SMALLEST_SCALE)
        else:  # every optimizer's per-device flags: the op sums them on the scale's device
            found_infs = [found_inf for state in self._per_optimizer_states.values()
                          for found_inf in state["found_inf_per_device"].values()]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            check_floor = (self._min_scale is not None and self._on_min_scale != "keep"
                           and self._may_have_overflowed())
            if check_floor:  # one host read of the state before the update
                scale_before, hyst_before, *flags = torch.stack(
                    [_scale, self._hysteresis_tracker.float()]
                    + [f.reshape(()).to(_scale.device) for f in found_infs]).tolist()
            self._core.update(found_infs)
            if check_floor:
                backs_off = any(f != 0 for f in flags) and hyst_before <= 1
                floor_hit = backs_off and scale_before * self._backoff_factor < self._min_scale
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._inv_scale, self._host_found_inf = None, {}
        self._iteration += 1
        if floor_hit:
            msg = (f"GradScaler: gradients held inf/NaN while the loss scale was at its floor "
                   f"min_scale={self._min_scale}, so it cannot back off further (the step was "
                   "skipped). Training has probably diverged: check the loss for NaN or lower the "
                   "learning rate; or lower min_scale. on_min_scale='keep' continues silently."
                   + self._floor_culprits())
            if self._on_min_scale == "raise":
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _may_have_overflowed(self) -> bool:
        """False only if every optimizer's flags were already read on the host and were clean."""
        return any(state["found_inf_per_device"] and self._host_found_inf.get(opt_id, 1) != 0
                   for opt_id, state in self._per_optimizer_states.items())

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), which ``torch.amp.GradScaler.load_state_dict``
        reads, plus peak's (``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``,
        ``_skipped_steps``), which it ignores. Empty when disabled. Call it after ``update()``."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker(), "hysteresis": self._hysteresis,
                "_hysteresis_tracker": (self._init_hysteresis_tracker
                                        if self._hysteresis_tracker is None
                                        else int(self._hysteresis_tracker.item())),
                "min_scale": self._min_scale, "max_scale": self._max_scale,
                "_skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler`` (then the hysteresis
        tracker refills and peak's settings stay as constructed). No-op when disabled."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"GradScaler.load_state_dict: expected a dict from state_dict(), got "
                            f"{type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                               "_growth_tracker") if k not in state_dict]
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: the state dict lacks {missing}; pass a "
                           f"dict returned by GradScaler.state_dict() (peak's or torch's)")
        # Checked as the constructor checks its arguments, before anything changes: a damaged state
        # would silently misdrive the scale (a min_scale above it raises it at a backoff). A state
        # without bounds (torch's) gets this scaler's bounds from its next update.
        try:
            o = check_options(dict(
                init_scale=state_dict["scale"], growth_factor=state_dict["growth_factor"],
                backoff_factor=state_dict["backoff_factor"],
                growth_interval=state_dict["growth_interval"],
                hysteresis=state_dict.get("hysteresis", self._hysteresis),
                min_scale=state_dict.get("min_scale"), max_scale=state_dict.get("max_scale")),
                self._on_min_scale)
            for bound in ("min_scale", "max_scale"):
                o[bound] = o[bound] if bound in state_dict else getattr(self, "_" + bound)
            trackers = {name: _number(int, name, state_dict.get(name, default)) for name, default
                        in (("_growth_tracker", 0), ("_hysteresis_tracker", o["hysteresis"]),
                            ("_skipped_steps", 0))}
            # (no upper bound on the growth tracker: torch's set_growth_interval may leave it
            # past a lowered interval, and torch's scaler saves it so)
            for name, value in trackers.items():
                high = o["hysteresis"] if name == "_hysteresis_tracker" else math.inf
                if not 0 <= value <= high:
                    raise ValueError(f"GradScaler: {name}={value} must be in [0, {high}]")
        except (TypeError, ValueError) as e:
            saved = str(e).replace("init_scale", "scale")  # (the entry's name in the dict)
            raise type(e)(f"GradScaler.load_state_dict: the state dict holds a value no "
                          f"GradScaler can ({saved}); nothing was loaded. Pass a dict returned "
                          "by GradScaler.state_dict(), peak's or torch's") from None
        for name in _OPTIONS:
            setattr(self, "_" + name, o[name])
        if self._scale is not None:
            self._scale.fill_(o["init_scale"])
        self._init_growth_tracker = trackers["_growth_tracker"]
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
        self._init_hysteresis_tracker = trackers["_hysteresis_tracker"]
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        self._skipped_steps_host = trackers["_skipped_steps"]
        self._skipped_steps_device = self._inv_scale = None
        self._last_skipped = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            # Tensors become Python numbers, re-created lazily after unpickling (as torch does).
            state["_core"] = self._core.dematerialized()
            state["_skipped_steps_host"] = self.skipped_steps
        state["_skipped_steps_device"] = None
        # Parameter names are keyed by object identity, which does not survive pickling: call
        # register_model again after unpickling. The last report (plain strings) is kept.
        if state.get("_report_records"):
            self._finish_report_records()
            state["_last_report"] = self._last_report
        state["_param_names"], state["_named_models"], state["_report_records"] = {}, [], []
        for key in ("_inv_scale", "_host_found_inf", "_last_skipped", "_step_sig_cache"):
            state.pop(key, None)
        state["_last_skipped_value"] = self.last_step_skipped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        last = state.pop("_last_skipped_value", False)
        self.__dict__.update(state)
        self._reset_transient_state()
        self._last_skipped = last


# torch's private names of the state (read by torch's own code and by users), kept on the core.
for _attr in ("scale", "growth_tracker", "hysteresis_tracker", "init_scale", "init_growth_tracker",
              "init_hysteresis_tracker", "growth_factor", "backoff_factor", "growth_interval",
              "hysteresis", "min_scale", "max_scale"):
    setattr(GradScaler, "_" + _attr, core_attribute(_attr))


def _refuse_overlapping(grads) -> None:
    """torch's error for a gradient with shared elements (``expand``): written out of bounds."""
    if any(any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape)) for g in grads):
        raise RuntimeError("unsupported operation: more than one element of the written-to tensor "
                           "refers to a single memory location (a gradient made by expand()). "
                           "Please clone() the tensor before assigning it to .grad.")


def _run_torch_code(name: str, option: str | None = None) -> None:
    """GradScaler's ``name``: torch's code, run over peak's state (the core's values under torch's
    private names, above), with the signature and docstring of torch's; a setter of ``option``
    checks its value first, as the constructor does (update() raised it after the step)."""
    theirs = getattr(torch.amp.GradScaler, name)

    def method(self, *args, **kwargs):
        if option is not None and self._enabled and (args or kwargs):  # (checked alone)
            check_options({**{k: getattr(self._core, k) for k in _OPTIONS}, "min_scale": None,
                           "max_scale": None, option: [*args, *kwargs.values()][0]}, "keep")
        return theirs(self, *args, **kwargs)
    method.__name__, method.__qualname__ = name, f"GradScaler.{name}"
    method.__module__, method.__doc__ = __name__, theirs.__doc__
    method.__signature__ = inspect.signature(theirs)
    setattr(GradScaler, name, method)


for _attr in ("scale", "get_scale", "_get_scale_async", "_get_growth_tracker", "is_enabled",
              "_check_scale_growth_tracker", "_found_inf_per_device", "get_growth_factor",
              "set_growth_factor", "get_backoff_factor", "set_backoff_factor",
              "get_growth_interval", "set_growth_interval"):
    _run_torch_code(_attr, _attr.removeprefix("set_") if _attr.startswith("set_") else None)
del _attr
