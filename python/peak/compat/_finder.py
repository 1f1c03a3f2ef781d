"""The import hook behind peak's opt-in Apex alias (NOTE: [Apex alias]).

NOTE: [Apex alias]
``apex``, its submodules, ``amp_C`` and ``apex_C`` resolve to peak modules: a finder placed first on
``sys.meta_path`` hands out the peak module object itself under the Apex name (``apex.amp is
peak.amp``), so state and isinstance checks are shared. It never shadows a real Apex: before
answering for a name it looks the name up on ``sys.path`` the ordinary way and, if a real module
is there, warns once and lets that one load.

This file imports neither torch nor peak (a ``.pth`` file loads it at interpreter start-up by
path); peak is imported only when a script imports an aliased name.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

# Apex name -> the peak module that stands for it. Below a prefix marked "*", submodules map
# one to one (apex.amp._amp_state -> peak.amp._amp_state).
ALIASES = {
    "apex": "peak.compat._apex",
    "apex.amp": "peak.amp",
    "apex.amp.scaler": "peak.compat._apex.amp_scaler",  # (unpickles Apex's checkpoints)
    "apex.amp.*": "peak.amp",
    "apex.optimizers": "peak.compat._apex.optimizers",
    "apex.optimizers.*": "peak.compat._apex.optimizers",
    "apex.fp16_utils": "peak.fp16_utils",
    "apex.fp16_utils.*": "peak.fp16_utils",
    "apex.parallel": "peak.compat._apex.parallel",
    "apex.parallel.LARC": "peak.compat._apex.parallel.LARC",
    "apex.parallel.distributed": "peak.compat._apex.parallel",
    "apex.multi_tensor_apply": "peak.compat._apex.multi_tensor_apply",
    "apex.multi_tensor_apply.*": "peak.compat._apex.multi_tensor_apply",
    "amp_C": "peak.compat._apex.amp_C",
    "apex_C": "peak.compat._apex.apex_C",
}
# The top-level names the alias answers for (Apex installed its two C extensions beside apex).
TOP_NAMES = ("apex", "amp_C", "apex_C")

_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


def target_of(fullname: str) -> str | None:
    """The peak module for an aliased name; None if the name is not Apex's."""
    if fullname in ALIASES:
        return ALIASES[fullname]
    for pattern, target in ALIASES.items():  # "apex.amp.*": apex.amp.x -> peak.amp.x
        if pattern.endswith(".*") and fullname.startswith(pattern[:-1]):
            return target + fullname[len(pattern) - 2:]
    return None


def real_apex_location(name: str = "apex") -> str | None:
    """Where a real (non-peak) ``apex``, ``amp_C`` or ``apex_C`` would be imported from, or None."""
    spec = importlib.machinery.PathFinder.find_spec(name)
    if spec is None:
        return None
    origin = spec.origin or (list(spec.submodule_search_locations or []) or [None])[0]
    if origin and os.path.abspath(origin).startswith(_THIS_DIR):
        return None
    return origin or "a namespace package on sys.path"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self._saved_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._saved_spec = getattr(module, "__spec__", None)
        # Submodules of the target imported already get their Apex names too: `import
        # apex.amp._amp_state` then finds the module in sys.modules, and the import system does not
        # set peak.amp._amp_state (the AmpState object, as Apex's amp/__init__.py) to that module.
        prefix = self.target + "."
        for name in [n for n in sys.modules if n.startswith(prefix)]:
            sys.modules.setdefault(spec.name + name[len(self.target):], sys.modules[name])
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the Apex name's spec on the peak module; give it back its
        # own (reload and pickling go by it).
        if self._saved_spec is not None:
            module.__spec__ = self._saved_spec


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Answers for ``apex``, ``apex.*``, ``amp_C`` and ``apex_C`` (see NOTE: [Apex alias])."""

    _peak_apex_alias = True  # how another copy of this file recognises an installed finder

    def __init__(self) -> None:
        self._warned = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in TOP_NAMES:
            return None
        for top in TOP_NAMES:  # a real one of them: Apex is installed, the alias stands aside
            real = real_apex_location(top)
            if real is not None:
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"peak's Apex alias is installed, but a real {top!r} is importable "
                        f"({real}); importing the real Apex. Remove the alias (python -m "
                        "peak.compat uninstall) or the real Apex.", RuntimeWarning, stacklevel=2)
                return None
        aliased = target_of(fullname)
        if aliased is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: peak's Apex alias provides apex.amp, "
                "apex.optimizers, apex.fp16_utils, apex.parallel, "
                "apex.multi_tensor_apply, amp_C and apex_C (see docs/migrating.md); "
                f"{fullname} has no peak counterpart", name=fullname)
        target_spec = importlib.util.find_spec(aliased)
        if target_spec is None:  # e.g. apex.fp16_utils.loss_scaler: Apex has it, peak does not
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under peak's Apex alias {fullname} would be "
                f"{aliased}, which does not exist (see docs/migrating.md for what peak provides)",
                name=fullname)
        is_package = target_spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(aliased),
                                               is_package=is_package)


def installed_finder():
    return next((f for f in sys.meta_path if getattr(f, "_peak_apex_alias", False)), None)


def activate() -> bool:
    """Puts the finder first on ``sys.meta_path`` unless one is there already. False (and a
    warning) when a real Apex is importable: the alias then stays off."""
    if installed_finder() is not None:
        return True
    for name in TOP_NAMES:
        real = real_apex_location(name)
        if real is not None:
            warnings.warn(f"peak's Apex alias stays off: a real {name!r} is importable ({real}). "
                          "Remove the alias (python -m peak.compat uninstall) or the real Apex.",
                          RuntimeWarning, stacklevel=2)
            return False
    sys.meta_path.insert(0, ApexAliasFinder())
    return True


def deactivate() -> None:
    """Removes the finder and forgets the aliased modules (peak's own modules stay loaded)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_peak_apex_alias", False)]
    for name in list(sys.modules):
        if name in TOP_NAMES or name.startswith("apex."):
            if getattr(sys.modules[name], "__name__", "").startswith("peak"):
                del sys.modules[name]
