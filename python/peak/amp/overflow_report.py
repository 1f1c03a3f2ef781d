"""What GradScaler tells about overflows beyond torch: skipped-step counts (no host sync in
``step()``) and ``overflow_report()``. A mixin, its state on the scaler (pickled as one object)."""
from __future__ import annotations

import weakref
from collections import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverflowReport:
    """Which parameters' gradients held inf/NaN on the last skipped step.

    ``iteration``: the index of that iteration (the number of ``update()`` calls before it), or
    ``None`` if no skipped step was seen since overflow attribution was turned on.
    ``parameters``: their names, in optimizer order (``register_model`` names; parameters of no
    registered model are named ``"<optimizer N>.param_groups[g][i]"``)."""

    iteration: int | None
    parameters: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.parameters)

    def __str__(self) -> str:
        if self.iteration is None:
            return "no skipped step seen since overflow attribution was turned on"
        names = ", ".join(self.parameters) if self.parameters else "(none recorded)"
        return f"iteration {self.iteration} skipped: inf/NaN gradients in {names}"


class OverflowAttribution:
    """GradScaler's skipped-step counters and overflow attribution (see the module docstring)."""

    def _reset_overflow_state(self) -> None:
        self._skipped_steps_host = 0
        self._skipped_steps_device: torch.Tensor | None = None
        self._iteration = 0
        self._report_enabled = False  # off until register_model
        self._param_names: dict[int, tuple[torch.Tensor, str]] = {}  # given pairs (held)
        self._named_models: list = []  # (a weak reference to a module, prefix): named at reports
        self._report_records: list = []
        self._report_records_iteration = -1
        self._last_report: OverflowReport | None = None
        self._overflow_counts: dict[str, int] = {}  # name -> skipped iterations it overflowed in

    def _record_skip(self, skipped) -> None:
        """``skipped``: a host bool, or a device tensor (> 0 means skipped) read only on demand."""
        self._last_skipped = skipped
        if isinstance(skipped, bool):
            self._skipped_steps_host += skipped
            return
        if self._skipped_steps_device is None:
            self._skipped_steps_device = torch.zeros((), dtype=torch.int64, device=skipped.device)
        self._skipped_steps_device.add_(skipped != 0)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step()`` skipped ``optimizer.step()`` because a gradient held
        inf/NaN (False before any step and when disabled). Reading it after a fused step is a host
        read of a device flag; ``step()`` itself never waits for it."""
        if isinstance(self._last_skipped, torch.Tensor):
            self._last_skipped = bool(self._last_skipped.item() != 0)
        return self._last_skipped

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls skipped ``optimizer.step()`` (one per optimizer and iteration)
        since construction or ``load_state_dict``; a host read of a device counter when fused
        optimizers were used."""
        device = self._skipped_steps_device
        return self._skipped_steps_host + (0 if device is None else int(device.item()))

    def register_model(self, model, *, prefix: str = "") -> "GradScaler":
        """Turn on overflow attribution and name parameters for ``overflow_report()``.

        ``model``: a ``torch.nn.Module`` (names from ``named_parameters()``), a mapping
        ``{name: parameter}`` or an iterable of ``(name, parameter)`` pairs; ``prefix`` is put in
        front of every name (for two models with the same layout). May be called several times.
        Costs no second pass (docs/torch_dialect.md, "Overflow attribution"). Returns the scaler."""
        if not isinstance(prefix, str):
            raise TypeError(f"GradScaler.register_model: prefix must be a str, got "
                            f"{type(prefix).__name__}")
        if isinstance(model, torch.nn.Module):  # (no weak reference to a tensor: swap_tensors)
            self._named_models = getattr(self, "_named_models", []) + [(weakref.ref(model), prefix)]
            pairs = ()
        elif isinstance(model, abc.Mapping):
            pairs = model.items()
        elif isinstance(model, abc.Iterable) and not isinstance(model, torch.Tensor):
            pairs = model
        else:
            raise TypeError(f"GradScaler.register_model: model must be a torch.nn.Module, a "
                            f"mapping name -> parameter or an iterable of (name, parameter) "
                            f"pairs, got {type(model).__name__}")
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"GradScaler.register_model: expected (name, parameter) pairs, got "
                                f"{item!r:.80}")
            name, param = item
            self._param_names[id(param)] = (param, prefix + name)
        self._report_enabled = True
        return self

    def _param_name(self, named: dict, optimizer, param, gi: int, pi: int) -> str:
        entry = self._param_names.get(id(param)) or named.get(id(param))
        if entry is not None and entry[0] is param:
            return entry[1]
        return (f"<{type(optimizer).__name__} param_groups[{gi}]['params'][{pi}], shape "
                f"{tuple(param.shape)}>")

    def _record_flags(self, optimizer, owners, flags: torch.Tensor) -> None:
        if self._report_records_iteration != self._iteration:
            self._finish_report_records()  # (leaves no records)
            self._report_records_iteration = self._iteration
        self._report_records.append((optimizer, owners, flags))

    def _finish_report_records(self) -> None:
        """An overflowed recorded iteration's flags into the last report (host reads)."""
        records = self._report_records
        if not records:
            return
        named = {id(p): (p, prefix + n) for ref, prefix in getattr(self, "_named_models", ())
                 for n, p in (ref().named_parameters() if ref() is not None else ())}
        names = [self._param_name(named, optimizer, *owner) for optimizer, owners, flags in
                 records for owner, hit in zip(owners, flags.tolist()) if hit]
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
        return OverflowReport(None, ()) if self._last_report is None else self._last_report

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

