"""peak: mixed-precision training for PyTorch.

``peak.amp`` speaks Apex amp's API (``initialize``, ``scale_loss``, O0-O3) and torch.amp's
(``autocast``, ``GradScaler``); ``peak.ops`` exposes the C++ multi-tensor kernels underneath.
"""
from ._extension import load_extension as _load_extension

_C = _load_extension()

from . import ops  # noqa: E402  (registers fake kernels; needs _C loaded first)

__version__ = _C.build_info()["peak_version"]

__all__ = ["ops", "__version__"]
