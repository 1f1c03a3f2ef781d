"""What ``import apex`` gives under peak's Apex alias: Apex's subpackages, loaded on first use
under their Apex names (NOTE: [Apex alias] in peak/compat/_finder.py)."""
import importlib

_SUBMODULES = ("amp", "optimizers", "fp16_utils", "parallel", "multi_tensor_apply")


def __getattr__(name):
    # Apex's __init__ imported these eagerly; here they load when first touched (apex.amp...).
    if name in _SUBMODULES:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' has no attribute {name!r} under peak's Apex alias "
                         f"(it provides {', '.join(_SUBMODULES)}; see docs/migrating.md)")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
