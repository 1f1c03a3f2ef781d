"""``peak.amp.GradScaler``: torch.amp.GradScaler's API on peak's kernels, plus what torch's lacks.

A drop-in for ``torch.amp.GradScaler`` (same constructor, methods, errors, per-optimizer state
machine, ``state_dict`` keys, pickling rules, lazy device choice and fused-optimizer hand-off),
built on the C++ core:

* unscale + inf/NaN check: one ``peak::multi_tensor_scale_`` pass per (device, dtype) group of
  gradients (fp32, fp16 *and* bf16 gradients; the math is fp32, the result is stored back);
* the scale update: ``peak::update_scale_`` on the scale's device -- the same core function as the
  Apex dialect's ``LossScaler`` (one algorithm, configured two ways).

Beyond torch: ``hysteresis``, ``min_scale`` / ``max_scale`` with a policy when the floor is hit
(``on_min_scale``), skipped-step visibility (``last_step_skipped``, ``skipped_steps``) without an
extra host sync in ``step()``, and ``overflow_report()`` (which parameters' gradients held inf/NaN,
flagged by the same unscale pass). See docs/torch_dialect.md.
"""
from __future__ import annotations

import inspect
import math
import numbers
import warnings
import weakref
from collections import abc, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.amp.grad_scaler as _torch_grad_scaler

from .. import _C

__all__ = ["GradScaler", "OptState", "OverflowReport"]

_CHUNK_SIZE = 65536
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ON_MIN_SCALE = ("warn", "raise", "keep")

# The C++ op, called directly: the typed wrapper in peak.ops copies the lists and re-checks the
# scalars, which costs more than the kernel for a model with many small gradients.
_multi_tensor_scale = torch.ops.peak.multi_tensor_scale_.default
_update_scale = torch.ops.peak.update_scale_.default
_group_by_device_dtype = torch._C._group_tensors_by_device_and_dtype
_check_finite = torch.ops.peak.multi_tensor_check_finite_.default
_unscale_param_grads = _C.unscale_param_grads


class _ConfigError(ValueError, AssertionError):
    """A bad constructor argument. torch raises AssertionError for some of these (growth/backoff
    factors), so the error is both a ValueError and an AssertionError."""


class _MultiDeviceReplicator(_torch_grad_scaler._MultiDeviceReplicator):
    """torch's helper (lazily serves copies of a tensor to requested devices, cached per device),
    optionally serving the master itself on its own device."""

    def __init__(self, master_tensor: torch.Tensor, share_master: bool = False) -> None:
        super().__init__(master_tensor)
        self._share_master = share_master

    def get(self, device: torch.device) -> torch.Tensor:
        retval = self._per_device_tensors.get(device, None)
        if retval is None:
            retval = (self.master if self._share_master and device == self.master.device
                      else self.master.to(device=device, non_blocking=True, copy=True))
            self._per_device_tensors[device] = retval
        return retval


# torch's own enum and factory, so that code comparing stages with torch's OptState works.
OptState = _torch_grad_scaler.OptState
_refresh_per_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


@dataclass(frozen=True)
class OverflowReport:
    """Which parameters' gradients held inf/NaN on the last skipped step.

    ``iteration``: the index of that iteration (the number of ``update()`` calls before it), or
    ``None`` if no skipped step was seen since overflow attribution was turned on.
    ``parameters``: their names, in optimizer order (``register_model`` names; parameters of no
    registered model are named ``"<optimizer N>.param_groups[g][i]"``).
    """

    iteration: int | None
    parameters: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.parameters)

    def __str__(self) -> str:
        if self.iteration is None:
            return "no skipped step seen since overflow attribution was turned on"
        names = ", ".join(self.parameters) if self.parameters else "(none recorded)"
        return f"iteration {self.iteration} skipped: inf/NaN gradients in {names}"


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient (FSDP2's ``fully_shard``) is unscaled through its local shard, which
    shares its storage; anything else is itself."""
    local = getattr(grad, "_local_tensor", None)
    return local if local is not None and hasattr(grad, "device_mesh") else grad


def _sharded_meshes(optimizer) -> list:
    """The device meshes of the optimizer's DTensor gradients (none for ordinary tensors)."""
    meshes = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p.grad, "device_mesh", None) if p.grad is not None else None
            if mesh is not None and all(m is not mesh for m in meshes):
                meshes.append(mesh)
    return meshes


def _agree_on_overflow(optimizer, per_device_found_inf: dict) -> None:
    """Sharded gradients: an inf/NaN in one rank's shard must skip the step on every rank, so the
    overflow flags are all-reduced (MAX) over every dimension of the gradients' meshes (what
    torch's ShardedGradScaler does for FSDP1). Ordinary gradients (DDP all-reduced them already,
    or one process) cost nothing here."""
    meshes = _sharded_meshes(optimizer)
    if not meshes:
        return
    import torch.distributed as dist  # noqa: PLC0415 (only for sharded gradients)

    for device in sorted(per_device_found_inf, key=str):
        flag = per_device_found_inf[device]
        for mesh in meshes:
            for dim in range(mesh.ndim):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def _is_dense(t: torch.Tensor) -> bool:
    """``t`` covers its memory exactly once (contiguous in some dimension order), as the
    multi-tensor kernels require; transposed gradients qualify, slices like ``g[:, :5]`` do not."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).is_contiguous()


def _check_float(name: str, value, *, allow_none: bool = False) -> float | None:
    """A real number (Python, numpy or a one-element tensor, as torch takes) as a float."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"GradScaler: {name} must be a float, got {type(value).__name__} ({value!r})")
    return float(value)


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"GradScaler: {name} must be an int, got {type(value).__name__} ({value!r})")
    return int(value)


class GradScaler(torch.amp.GradScaler):
    """Gradient scaling for mixed-precision training; a drop-in for ``torch.amp.GradScaler``
    (a subclass, so ``isinstance(scaler, torch.amp.GradScaler)`` holds; every method is peak's).

    ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`` as with torch.
    The first five keyword arguments and ``enabled`` mean what they mean in torch. Beyond torch:

    Args:
        hysteresis (int): the scale backs off only after this many overflowing iterations in a
            row (Megatron/DeepSpeed style; 1 = back off at once, as torch). Steps with inf/NaN
            gradients are always skipped, whatever the hysteresis.
        min_scale (float or None): floor of the scale (None: no floor, as torch).
        max_scale (float or None): ceiling of the scale (None: no ceiling, as torch).
        on_min_scale ("warn", "raise" or "keep"): what happens when gradients overflow while the
            scale cannot back off any further (a backoff below ``min_scale`` is clamped to it):
            ``"warn"`` keeps the scale at ``min_scale`` and emits a RuntimeWarning; ``"raise"``
            updates the state the same way, then raises RuntimeError from ``update()``;
            ``"keep"`` keeps the scale at ``min_scale`` silently (overflowing steps are still
            skipped and counted in ``skipped_steps``). ``"warn"`` and ``"raise"`` read the overflow
            state on the host in ``update()`` when an overflow may have happened (no read when the
            non-fused ``step()`` already saw that every gradient was finite); ``"keep"`` never does.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: str = "warn",
    ) -> None:
        if isinstance(device, torch.device):
            device = device.type
        if not isinstance(device, str):
            raise TypeError(f"GradScaler: device must be a device type string such as 'cuda' or 'cpu', "
                            f"got {type(device).__name__}")
        try:
            device_type = torch.device(device).type
        except RuntimeError as e:
            raise ValueError(f"GradScaler: device={device!r} is not a device type "
                             f"(use 'cuda', 'cpu', ...): {e}") from None
        # Only the device type matters ("cuda:1" means "cuda"): the scaler's tensors go to the
        # device of the first tensor passed to scale().
        device = device_type
        enabled = bool(enabled)  # torch takes any truthy value (1, None, ...)
        self._device = device
        self._enabled = enabled
        if self._device == "cuda":
            if enabled and not (torch.cuda.is_available() or _has_torch_xla()):
                warnings.warn(
                    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                    stacklevel=2,
                )
                self._enabled = False

        if self._enabled:
            # A disabled scaler checks nothing (as torch's): it never uses these values.
            init_scale = _check_float("init_scale", init_scale)
            growth_factor = _check_float("growth_factor", growth_factor)
            backoff_factor = _check_float("backoff_factor", backoff_factor)
            min_scale = _check_float("min_scale", min_scale, allow_none=True)
            max_scale = _check_float("max_scale", max_scale, allow_none=True)
            growth_interval = _check_int("growth_interval", growth_interval)
            hysteresis = _check_int("hysteresis", hysteresis)
            if on_min_scale not in _ON_MIN_SCALE:
                raise ValueError(f"GradScaler: on_min_scale must be one of {_ON_MIN_SCALE}, "
                                 f"got {on_min_scale!r}")
            # torch's two checks (AssertionError there; _ConfigError is also an AssertionError).
            if growth_factor <= 1.0:
                raise _ConfigError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise _ConfigError("The backoff factor must be < 1.0.")
            if not (math.isfinite(init_scale) and init_scale > 0):
                raise ValueError(f"GradScaler: init_scale must be finite and > 0, got {init_scale}")
            if not backoff_factor > 0:
                raise ValueError(f"GradScaler: backoff_factor must be > 0, got {backoff_factor}")
            if growth_interval < 1:
                raise ValueError(f"GradScaler: growth_interval must be >= 1, got {growth_interval}")
            if hysteresis < 1:
                raise ValueError(f"GradScaler: hysteresis must be >= 1 (1 backs off at the first "
                                 f"overflow, as torch), got {hysteresis}")
            if min_scale is not None and not (0 <= min_scale <= init_scale):
                raise ValueError(f"GradScaler: min_scale={min_scale} must be in [0, init_scale="
                                 f"{init_scale}]; lower min_scale or raise init_scale")
            if max_scale is not None and not (max_scale >= init_scale):
                raise ValueError(f"GradScaler: max_scale={max_scale} must be >= init_scale="
                                 f"{init_scale}; raise max_scale or lower init_scale")

        self._init_scale = init_scale
        self._scale: torch.Tensor | None = None  # 0-dim float32, created by the first scale()
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._growth_tracker: torch.Tensor | None = None  # 0-dim int32
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        # peak's extensions
        self._hysteresis = hysteresis
        self._init_hysteresis_tracker = hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None  # 0-dim int32
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._on_min_scale = on_min_scale
        self._reset_transient_state()
        self._skipped_steps_host = 0
        self._skipped_steps_device: torch.Tensor | None = None
        self._iteration = 0
        # overflow attribution (off until register_model)
        self._report_enabled = False
        self._param_names: dict[int, tuple[weakref.ref, str]] = {}
        self._report_records: list = []
        self._report_records_iteration = -1
        self._last_report: OverflowReport | None = None
        self._overflow_counts: dict[str, int] = {}  # name -> skipped iterations it overflowed in

    def _reset_transient_state(self) -> None:
        """State that lives within one iteration or is derived from the tensors (never pickled)."""
        self._inv_scale: torch.Tensor | None = None  # 1/scale for this iteration (float64 math)
        self._host_found_inf: dict[int, float] = {}  # found_inf already read by a non-fused step
        self._last_skipped: bool | torch.Tensor = False
        self._step_sig_cache: dict = {}

    # ------------------------------------------------------------------ lazy state
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32,
                                              device=dev)

    # ------------------------------------------------------------------ scale
    def scale(self, outputs):
        """Multiplies ('scales') a tensor or an (arbitrarily nested) iterable of tensors by the
        scale factor. Returns the outputs unchanged when disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        stash: list[_MultiDeviceReplicator] = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                if len(stash) == 0:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    stash.append(_MultiDeviceReplicator(self._scale))
                return val * stash[0].get(val.device)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ------------------------------------------------------------------ unscale
    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool, *, _check_only: bool = False
                        ) -> dict[torch.device, torch.Tensor]:
        """Unscale (multiply by ``inv_scale``) and check every gradient of ``optimizer`` in place,
        one multi-tensor pass per (device, dtype); returns ``{device: found_inf}``.

        ``allow_fp16`` is accepted for torch compatibility and ignored: fp16 and bf16 gradients
        are unscaled in fp32 math and stored back. ``_check_only``: check without writing (the
        fused-optimizer path; ``inv_scale`` must then be 1)."""
        check_only = _check_only
        report = self._report_enabled
        if not report and inv_scale.device == found_inf.device:
            # The common case in one C++ call (plain dense gradients on the scale's device);
            # -1: nothing was written, take the general path below.
            count = _unscale_param_grads(optimizer.param_groups, inv_scale, found_inf,
                                         check_only, _CHUNK_SIZE)
            if count >= 0:
                return {found_inf.device: found_inf} if count else {}
        # The master tensors serve their own device without a copy (fresh tensors, read or
        # written only here).
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale, share_master=True)
        per_device_found_inf = _MultiDeviceReplicator(found_inf, share_master=True)
        if not report:
            self._unscale_fast(optimizer, per_device_inv_scale, per_device_found_inf, check_only)
            _agree_on_overflow(optimizer, per_device_found_inf._per_device_tensors)
            return per_device_found_inf._per_device_tensors
        groups: dict[tuple, list[torch.Tensor]] = {}
        owners: dict[tuple, list] = {} if report else None
        strided: list = []  # non-contiguous gradients (transposed ones are still dense)
        with torch.no_grad():
            for gi, group in enumerate(optimizer.param_groups):
                for pi, param in enumerate(group["params"]):
                    grad = param.grad
                    if grad is None:
                        continue
                    grad = _local(grad)
                    if grad.is_sparse:
                        # Duplicate indices of a low-precision sparse gradient may overflow only
                        # once summed: check the coalesced values (torch does this for fp16).
                        if grad.dtype in (torch.float16, torch.bfloat16):
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    key = (grad.device, grad.dtype)
                    bucket = groups.get(key)
                    if bucket is None:
                        bucket = groups[key] = []
                        if report:
                            owners[key] = []
                    if not grad.is_contiguous():
                        strided.append((key, len(bucket)))
                    bucket.append(grad)
                    if report:
                        owners[key].append((param, gi, pi))
            # Non-dense (sliced) gradients go through the same pass as dense copies.
            copies: dict[tuple, list] = {}
            for key, index in strided:
                if key[1] not in _KERNEL_DTYPES:
                    continue  # torch's per-tensor kernel takes any strides
                g = groups[key][index]
                if not _is_dense(g):
                    dense = g.contiguous()
                    groups[key][index] = dense
                    copies.setdefault(key, []).append((g, dense))
            for key, grads in groups.items():
                device, dtype = key
                dev_found_inf = per_device_found_inf.get(device)
                dev_inv_scale = per_device_inv_scale.get(device)
                flags = (torch.zeros(len(grads), dtype=torch.float32, device=device)
                         if report else None)
                if dtype in _KERNEL_DTYPES and check_only:
                    # A read-only pass: nothing written back.
                    if flags is None:
                        _check_finite(grads, dev_found_inf, _CHUNK_SIZE)
                    else:
                        _check_finite(grads, dev_found_inf, _CHUNK_SIZE, flags)
                elif dtype in _KERNEL_DTYPES:
                    if flags is None:
                        _multi_tensor_scale(grads, None, dev_inv_scale, dev_found_inf, _CHUNK_SIZE)
                    else:
                        _multi_tensor_scale(grads, None, dev_inv_scale, dev_found_inf, _CHUNK_SIZE,
                                            flags)
                    for g, dense in copies.get(key, ()):
                        g.copy_(dense)
                else:
                    # float64 (not a kernel dtype): torch's own per-tensor kernel.
                    if flags is None:
                        torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found_inf,
                                                                         dev_inv_scale)
                    else:
                        for i, g in enumerate(grads):
                            torch._amp_foreach_non_finite_check_and_unscale_([g], flags[i],
                                                                             dev_inv_scale)
                        torch.maximum(dev_found_inf, flags.max(), out=dev_found_inf)
                if report:
                    self._record_flags(optimizer, owners[key], flags)
        _agree_on_overflow(optimizer, per_device_found_inf._per_device_tensors)
        return per_device_found_inf._per_device_tensors

    def _unscale_fast(self, optimizer, per_device_inv_scale, per_device_found_inf,
                      check_only: bool) -> None:
        """The common case without per-gradient flags: gather the gradients, group them by
        (device, dtype) in C++ and make one kernel call per group. A group the kernel rejects
        (sparse or non-dense gradients; the kernel validates before it writes anything) goes
        through ``_unscale_group_slow``."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        grads = [_local(g) for g in grads if g is not None]
        if not grads:
            return
        with torch.no_grad():
            grouped = _group_by_device_dtype([grads], False)
            for (device, dtype), ((group,), _) in grouped.items():
                dev_found_inf = per_device_found_inf.get(device)
                dev_inv_scale = per_device_inv_scale.get(device)
                if dtype in _KERNEL_DTYPES:
                    try:
                        if check_only:
                            _check_finite(group, dev_found_inf, _CHUNK_SIZE)
                        else:
                            _multi_tensor_scale(group, None, dev_inv_scale, dev_found_inf,
                                                _CHUNK_SIZE)
                        continue
                    except RuntimeError:
                        pass
                self._unscale_group_slow(optimizer, group, dtype, dev_inv_scale, dev_found_inf,
                                         check_only)

    @staticmethod
    def _unscale_group_slow(optimizer, group, dtype, inv_scale, found_inf, check_only) -> None:
        """One (device, dtype) group with sparse, non-dense or float64 gradients."""
        if any(g.is_sparse for g in group) and dtype in (torch.float16, torch.bfloat16):
            # Duplicate indices of a low-precision sparse gradient may overflow only once
            # summed: check the coalesced values (torch does this for fp16), replacing .grad.
            owner = {id(p.grad): p for grp in optimizer.param_groups for p in grp["params"]
                     if p.grad is not None}
            for i, g in enumerate(group):
                if g.is_sparse:
                    group[i] = owner[id(g)].grad = g.coalesce()
        tensors = [g._values() if g.is_sparse else g for g in group]
        if dtype not in _KERNEL_DTYPES:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
            return
        copies = []
        for i, t in enumerate(tensors):
            if not _is_dense(t):
                tensors[i] = t.contiguous()
                copies.append((t, tensors[i]))
        if check_only:
            _check_finite(tensors, found_inf, _CHUNK_SIZE)
        else:
            _multi_tensor_scale(tensors, None, inv_scale, found_inf, _CHUNK_SIZE)
            for t, dense in copies:
                t.copy_(dense)

    @staticmethod
    def _check_optimizer(optimizer, method: str) -> None:
        if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
            raise TypeError(f"GradScaler.{method}: optimizer must be a torch.optim.Optimizer (an "
                            f"object with param_groups and step()), got {type(optimizer).__name__}; "
                            f"pass the optimizer, not the model")

    def _get_inv_scale(self) -> torch.Tensor:
        inv = self._inv_scale
        if inv is None:
            scale = self._scale
            # FP32 division can be imprecise for certain compile options: reciprocal in FP64 (torch).
            inv = (scale.double().reciprocal().float() if scale.device.type != "mps"
                   else scale.reciprocal())
            self._inv_scale = inv
        return inv

    def unscale_(self, optimizer) -> None:
        """Divides ("unscales") the optimizer's gradients by the scale factor, in place, checking
        them for inf/NaN (one pass). Optional: ``step()`` does it if you don't. No host sync.

        fp16 and bf16 gradients are accepted (fp32 math, stored back in their dtype)."""
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
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, self._get_inv_scale(), found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        """Check gradients for inf/NaN without unscaling them (fused-optimizer path)."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        dummy_inv_scale = torch.ones((), dtype=torch.float32, device=_scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=_scale.device)
        if type(self)._unscale_grads_ is GradScaler._unscale_grads_:
            per_device = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True,
                                              _check_only=True)  # a read-only pass
        else:  # a subclass's override keeps torch's 4-argument contract (ShardedGradScaler-style)
            per_device = self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return per_device

    def _check_inf_by_norm(self, optimizer) -> torch.Tensor | None:
        """Fused path of an optimizer that clips (peak's, ``max_grad_norm > 0``): the global norm
        of the still-scaled gradients, one read pass by the optimizer, is the inf/NaN check too
        (a non-finite gradient makes it non-finite), and the step clips with it -- one pass
        where a check and ``clip_grad_norm_`` would make two or three."""
        self._check_scale_growth_tracker("_check_inf_by_norm")
        norm = optimizer._global_grad_norm()
        per_device = {}
        if norm is not None:
            per_device[norm.device] = (~torch.isfinite(norm)).to(torch.float32).reshape(())
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = per_device
        return norm

    def _found_inf_per_device(self, optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ------------------------------------------------------------------ step
    def _combined_found_inf(self, optimizer_state) -> torch.Tensor:
        """The optimizer's overflow flags summed on the scale's device, as a new tensor (an
        optimizer it is handed to may write to it); zero when it recorded none."""
        flags = list(optimizer_state["found_inf_per_device"].values())
        dev = self._scale.device
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=dev)
        total = flags[0].to(dev, non_blocking=True, copy=True)
        for f in flags[1:]:
            total = total + f.to(dev, non_blocking=True)
        return total

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        """Run ``optimizer.step`` unless a gradient held inf/NaN: the one host read of a non-fused
        step (torch reads once per device, this reads once per optimizer)."""
        found = float(self._combined_found_inf(optimizer_state).item())
        self._host_found_inf[id(optimizer)] = found
        retval = None
        if not found:
            retval = optimizer.step(*args, **kwargs)
        self._record_skip(found != 0)
        return retval

    def _record_skip(self, skipped) -> None:
        """``skipped``: a host bool, or a device tensor (> 0 means skipped) read only on demand."""
        self._last_skipped = skipped
        if isinstance(skipped, bool):
            self._skipped_steps_host += skipped
        else:
            if self._skipped_steps_device is None:
                self._skipped_steps_device = torch.zeros((), dtype=torch.int64, device=skipped.device)
            self._skipped_steps_device.add_(skipped != 0)

    def _step_signature(self, optimizer) -> tuple[bool, bool, bool]:
        """(takes ``grad_scaler=`` (torch's legacy contract), takes ``grad_scale=``/``found_inf=``
        keywords (peak's fused optimizers), takes ``grad_norm=``), cached per step function."""
        step = optimizer.step
        key = getattr(step, "__func__", step)
        cached = self._step_sig_cache.get(key)
        if cached is None:
            params = inspect.signature(step).parameters
            cached = ("grad_scaler" in params,
                      "grad_scale" in params and "found_inf" in params,
                      "grad_norm" in params)
            if len(self._step_sig_cache) >= 64:  # code that re-wraps step() every iteration
                self._step_sig_cache.clear()
            self._step_sig_cache[key] = cached
        return cached

    def step(self, optimizer, *args, **kwargs):
        """Unscale the gradients (unless ``unscale_`` did already) and call ``optimizer.step()``
        if none of them held inf/NaN; returns its return value, or None when skipped.

        Optimizers with ``_step_supports_amp_scaling = True`` (torch's fused Adam/AdamW/SGD,
        peak's fused optimizers) get ``optimizer.grad_scale`` and ``optimizer.found_inf`` (device
        tensors) and skip on the device: no host sync. Otherwise one host read decides.
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
            kwargs_ = kwargs
            has_grad_scaler_kwarg, takes_scale_kwargs, takes_norm = self._step_signature(optimizer)
            grad_norm = None
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs_.update({"grad_scaler": self})
            else:
                if optimizer_state["stage"] is OptState.READY:
                    if (takes_norm and getattr(optimizer, "_wants_grad_norm", False)
                            and not self._report_enabled):
                        grad_norm = self._check_inf_by_norm(optimizer)
                    else:
                        self._check_inf_per_device(optimizer)
                # No gradients at all this iteration: found_inf is zero (torch: sum([])).
                found_inf = self._combined_found_inf(optimizer_state)
                if optimizer_state["stage"] is OptState.UNSCALED:
                    # unscale_ already ran: the gradients carry no scale of ours, so the
                    # optimizer gets only what the user set (torch does the same).
                    optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
                else:  # fresh tensors, as torch hands over: the optimizer may write to them
                    user_scale = getattr(optimizer, "grad_scale", None)
                    optimizer.grad_scale = (self._scale.clone() if user_scale is None
                                            else self._scale * user_scale)
                optimizer.found_inf = found_inf
                if takes_scale_kwargs:
                    # peak's fused optimizers take them as keywords; torch's read the attributes.
                    kwargs_ = dict(kwargs)
                    kwargs_.setdefault("grad_scale", optimizer.grad_scale)
                    kwargs_.setdefault("found_inf", found_inf)
                    if grad_norm is not None:
                        kwargs_.setdefault("grad_norm", grad_norm)
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
                if optimizer_state["found_inf_per_device"]:
                    self._record_skip(self._combined_found_inf(optimizer_state))
            elif optimizer_state["found_inf_per_device"]:
                self._record_skip(self._combined_found_inf(optimizer_state))
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale at the end of an iteration (after ``step`` for every optimizer):
        back off if any step overflowed (after ``hysteresis`` overflowing iterations in a row, not
        below ``min_scale``), grow after ``growth_interval`` clean iterations (not above
        ``max_scale``). On the device: no host sync (see ``on_min_scale`` for the exception).

        ``new_scale`` (a float, or a one-element tensor on the scaler's device type) sets the scale
        instead."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        floor_hit = False
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                self._scale.fill_(float(new_scale))
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if not isinstance(new_scale, torch.Tensor):
                    raise TypeError(f"{reason} Got {type(new_scale).__name__}.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale.reshape(()))
        else:
            found_infs = [
                found_inf.to(device=_scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found_inf_combined = found_infs[0]
            for f in found_infs[1:]:
                found_inf_combined = found_inf_combined + f
            check_floor = (self._min_scale is not None and self._on_min_scale != "keep"
                           and self._may_have_overflowed())
            if check_floor:
                before = torch.stack((found_inf_combined.reshape(()), _scale,
                                      self._hysteresis_tracker.float())).tolist()
            _update_scale(
                _scale, _growth_tracker, self._hysteresis_tracker, found_inf_combined,
                self._growth_factor, self._backoff_factor, self._growth_interval,
                self._hysteresis,
                0.0 if self._min_scale is None else self._min_scale,
                math.inf if self._max_scale is None else self._max_scale,
            )
            if check_floor:
                found, scale_before, hyst_before = before
                backs_off = found != 0 and hyst_before <= 1
                floor_hit = backs_off and scale_before * self._backoff_factor < self._min_scale
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._inv_scale = None
        self._host_found_inf = {}
        self._iteration += 1
        if floor_hit:
            msg = (f"GradScaler: gradients held inf/NaN while the loss scale was at its floor "
                   f"min_scale={self._min_scale}, so it cannot back off further (the step was "
                   f"skipped). Training has probably diverged: check the loss for NaN or lower the "
                   f"learning rate; or lower min_scale. on_min_scale='keep' continues silently."
                   + self._floor_culprits())
            if self._on_min_scale == "raise":
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _floor_culprits(self) -> str:
        """The floor message's last sentence: which parameters keep overflowing."""
        if not self._report_enabled:
            return (" Call scaler.register_model(model) before training to have the parameters "
                    "whose gradients overflow named here.")
        self._finish_report_records()
        last = self._last_report
        if last is None or last.iteration != self._iteration - 1 or not last.parameters:
            return ""
        names = dict.fromkeys(last.parameters)
        parts = [f"{n} (in {self._overflow_counts.get(n, 1)} skipped iterations)" for n in names]
        return " Gradients with inf/NaN in this iteration: " + ", ".join(parts) + "."

    def _may_have_overflowed(self) -> bool:
        """False only if every optimizer's flags were already read on the host and were clean."""
        for opt_id, state in self._per_optimizer_states.items():
            if not state["found_inf_per_device"]:
                continue
            found = self._host_found_inf.get(opt_id)
            if found is None or found != 0:
                return True
        return False

    # ------------------------------------------------------------------ skipped steps
    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` skipped ``optimizer.step()`` because a gradient held
        inf/NaN (False before any step and when disabled). Reading it after a fused step is a host
        read of a device flag; ``step()`` itself never waits for it."""
        skipped = self._last_skipped
        if isinstance(skipped, torch.Tensor):
            skipped = bool(skipped.item() != 0)
            self._last_skipped = skipped
        return skipped

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls skipped ``optimizer.step()`` (one per optimizer and iteration)
        since construction or ``load_state_dict``; a host read of a device counter when fused
        optimizers were used."""
        total = self._skipped_steps_host
        if self._skipped_steps_device is not None:
            total += int(self._skipped_steps_device.item())
        return total

    # ------------------------------------------------------------------ overflow attribution
    def register_model(self, model, *, prefix: str = "") -> "GradScaler":
        """Turn on overflow attribution and name parameters for ``overflow_report()``.

        ``model``: a ``torch.nn.Module`` (names from ``named_parameters()``), a mapping
        ``{name: parameter}`` or an iterable of ``(name, parameter)`` pairs; ``prefix`` is put in
        front of every name (for two models with the same layout). May be called several times.
        The per-gradient flags are written by the unscale pass itself (one float per gradient),
        not by a second pass. Returns the scaler."""
        if isinstance(model, torch.nn.Module):
            pairs = model.named_parameters()
        elif isinstance(model, abc.Mapping):
            pairs = model.items()
        elif isinstance(model, abc.Iterable) and not isinstance(model, torch.Tensor):
            pairs = model
        else:
            raise TypeError(f"GradScaler.register_model: model must be a torch.nn.Module, a mapping "
                            f"name -> parameter or an iterable of (name, parameter) pairs, got "
                            f"{type(model).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"GradScaler.register_model: prefix must be a str, got {type(prefix).__name__}")
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"GradScaler.register_model: expected (name, parameter) pairs, got "
                                f"{item!r:.80}")
            name, param = item
            self._param_names[id(param)] = (weakref.ref(param), prefix + name)
        self._report_enabled = True
        return self

    def _param_name(self, optimizer, param, gi: int, pi: int) -> str:
        entry = self._param_names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        shape = tuple(param.shape)
        return f"<{type(optimizer).__name__} param_groups[{gi}]['params'][{pi}], shape {shape}>"

    def _record_flags(self, optimizer, owners, flags: torch.Tensor) -> None:
        if self._report_records_iteration != self._iteration:
            self._finish_report_records()
            self._report_records = []
            self._report_records_iteration = self._iteration
        self._report_records.append((optimizer, owners, flags))

    def _finish_report_records(self) -> None:
        """If the recorded iteration overflowed, turn its flags into the last report (host reads;
        only with overflow attribution on)."""
        records = self._report_records
        if not records:
            return
        names = []
        for optimizer, owners, flags in records:
            hit = flags.tolist()
            names.extend(self._param_name(optimizer, *owner) for owner, h in zip(owners, hit) if h)
        for name in dict.fromkeys(names):
            self._overflow_counts[name] = self._overflow_counts.get(name, 0) + 1
        if names:
            last = self._last_report
            if last is not None and last.iteration == self._report_records_iteration:
                names = list(last.parameters) + names  # more steps of the same iteration
            self._last_report = OverflowReport(self._report_records_iteration, tuple(names))
        self._report_records = []

    def overflow_report(self) -> OverflowReport:
        """The parameters whose gradients held inf/NaN on the last skipped step (the current
        iteration's if it has one), from the flags written by the unscale pass. Needs
        ``register_model`` before the step. Reads the flags on the host."""
        if not self._report_enabled:
            raise RuntimeError("GradScaler.overflow_report: overflow attribution is off; call "
                               "scaler.register_model(model) once before training to turn it on")
        self._finish_report_records()
        if self._last_report is None:
            return OverflowReport(None, ())
        return self._last_report

    # ------------------------------------------------------------------ getters / setters
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync), or 1.0 if disabled."""
        if self._enabled:
            return self._init_scale if self._scale is None else float(self._scale.item())
        return 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return (self._init_growth_tracker if self._growth_tracker is None
                    else int(self._growth_tracker.item()))
        return 0

    def _get_hysteresis_tracker(self) -> int:
        return (self._init_hysteresis_tracker if self._hysteresis_tracker is None
                else int(self._hysteresis_tracker.item()))

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), which ``torch.amp.GradScaler.load_state_dict``
        reads, plus peak's (``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``,
        ``_skipped_steps``), which it ignores. Empty when disabled. Call it after ``update()``."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "_skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler`` (then the hysteresis
        tracker refills and peak's settings stay as constructed). No-op when disabled."""
        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise TypeError(f"GradScaler.load_state_dict: expected a dict from state_dict(), got "
                            f"{type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler.")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                               "_growth_tracker") if k not in state_dict]
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: the state dict lacks {missing}; pass a dict "
                           f"returned by GradScaler.state_dict() (peak's or torch's)")
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])
        if "hysteresis" in state_dict:
            self._hysteresis = int(state_dict["hysteresis"])
        if "min_scale" in state_dict:
            self._min_scale = state_dict["min_scale"]
        if "max_scale" in state_dict:
            self._max_scale = state_dict["max_scale"]
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
        self._skipped_steps_host = int(state_dict.get("_skipped_steps", 0))
        self._skipped_steps_device = None
        self._last_skipped = False
        self._inv_scale = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update().")
            # Tensors become Python numbers, re-created lazily after unpickling (as torch does).
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_skipped_steps_host"] = self.skipped_steps
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_hysteresis_tracker"] = None
        state["_skipped_steps_device"] = None
        # Parameter names are keyed by object identity, which does not survive pickling: call
        # register_model again after unpickling. The last report (plain strings) is kept.
        if state.get("_report_records"):
            self._finish_report_records()
            state["_last_report"] = self._last_report
        state["_param_names"] = {}
        state["_report_records"] = []
        for key in ("_inv_scale", "_host_found_inf", "_last_skipped", "_step_sig_cache"):
            state.pop(key, None)
        state["_last_skipped_value"] = self.last_step_skipped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        last = state.pop("_last_skipped_value", False)
        self.__dict__.update(state)
        self._reset_transient_state()
        self._last_skipped = last


def _has_torch_xla() -> bool:
    from importlib.util import find_spec
    return find_spec("torch_xla") is not None
