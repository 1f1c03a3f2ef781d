"""peak: mixed-precision training for PyTorch.

``peak.amp`` speaks Apex amp's API (``initialize``, ``scale_loss``, O0-O3) and torch.amp's
(``autocast``, ``GradScaler``); ``peak.ops`` exposes the C++ multi-tensor kernels underneath.
"""
from ._extension import load_extension as _load_extension

_C = _load_extension()

from . import ops  # noqa: E402  (registers fake kernels; needs _C loaded first)

__version__ = _C.build_info()["peak_version"]

__all__ = ["ops", "__version__"]

_SUBPACKAGES = ("amp", "optimizers", "fp16_utils", "integrations", "compat")


def __getattr__(name):
    # `import peak; peak.amp.GradScaler(...)` works as `import torch; torch.amp...` does; the
    # subpackages load on first use, so `import peak` stays light.
    if name in _SUBPACKAGES:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'peak' has no attribute {name!r}")
