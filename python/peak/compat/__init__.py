"""Opt-in Apex alias: unmodified scripts that ``import apex`` / ``from apex import amp`` /
``import amp_C`` / ``import apex_C`` run on peak (see NOTE: [Apex alias] in ``_finder.py`` and
docs/migrating.md).

Switch it on for every interpreter of this environment (a ``.pth`` file in site-packages)::

    python -m peak.compat install       # python -m peak.compat uninstall / status

or for the current process only, before the first ``import apex``::

    import peak.compat
    peak.compat.install_apex_alias()

Both refuse when a real Apex is importable: peak never shadows it.
"""
from __future__ import annotations

import os
import sysconfig

from . import _finder

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_active", "install_pth",
           "uninstall_pth", "pth_paths"]

PTH_NAME = "peak_apex_alias.pth"
LOADER_NAME = "_peak_apex_alias.py"


class RealApexError(RuntimeError):
    """A real Apex is importable: the alias would hide it (or be hidden by it)."""


def _refuse_if_real_apex() -> None:
    for name in _finder.TOP_NAMES:
        real = _finder.real_apex_location(name)
        if real is not None:
            raise RealApexError(
                f"peak's Apex alias refuses to switch on: a real {name!r} is importable from "
                f"{real}. Use it, or uninstall it (pip uninstall apex) and run this again; "
                "peak's own API needs no alias (from peak import amp).")


def install_apex_alias() -> None:
    """Makes ``import apex`` (and ``amp_C``, ``apex_C``) resolve to peak in this process. Raises
    :class:`RealApexError` when a real Apex is importable."""
    _refuse_if_real_apex()
    _finder.activate()


def uninstall_apex_alias() -> None:
    """Undoes :func:`install_apex_alias` (and a ``.pth``'s activation) in this process."""
    _finder.deactivate()


def apex_alias_active() -> bool:
    return _finder.installed_finder() is not None


def pth_paths(site_dir: str | None = None) -> tuple[str, str]:
    """The ``.pth`` file and the start-up module it imports, in ``site_dir`` (default: this
    environment's site-packages)."""
    site_dir = site_dir or sysconfig.get_paths()["purelib"]
    return os.path.join(site_dir, PTH_NAME), os.path.join(site_dir, LOADER_NAME)


def install_pth(site_dir: str | None = None) -> str:
    """Writes the ``.pth`` file (and the small module it imports) that switch the alias on at
    every interpreter start in this environment; returns the ``.pth`` path. Refuses when a real
    Apex is importable."""
    _refuse_if_real_apex()
    pth, loader = pth_paths(site_dir)
    finder_path = os.path.abspath(_finder.__file__)
    with open(loader, "w", encoding="utf-8") as f:
        f.write(
            "# Written by `python -m peak.compat install` (peak's Apex alias); removed by\n"
            "# `python -m peak.compat uninstall`. Loads peak's import hook by path, without\n"
            "# importing torch or peak at start-up.\n"
            "import importlib.util as _util\nimport os as _os\n\n"
            f"_FINDER = {finder_path!r}\n"
            "if _os.path.exists(_FINDER):\n"
            "    _spec = _util.spec_from_file_location('_peak_apex_alias_finder', _FINDER)\n"
            "    _module = _util.module_from_spec(_spec)\n"
            "    _spec.loader.exec_module(_module)\n"
            "    _module.activate()\n")
    with open(pth, "w", encoding="utf-8") as f:
        f.write("import _peak_apex_alias\n")
    return pth


def uninstall_pth(site_dir: str | None = None) -> list[str]:
    """Removes what :func:`install_pth` wrote; returns the paths removed."""
    removed = []
    for path in pth_paths(site_dir):
        if os.path.exists(path):
            os.remove(path)
            removed.append(path)
    return removed
