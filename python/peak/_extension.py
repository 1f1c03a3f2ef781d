"""Loads peak._C, refusing clearly when it is missing or was built for another torch."""
import re

import torch

# The torch releases peak builds against and is tested with (inclusive, major.minor; what was run
# on which release: docs/build.md, "Supported torch releases").
SUPPORTED_TORCH = ((2, 10), (2, 15))
REBUILD = "pip install --no-build-isolation -e .  (or: make build)"


def major_minor(version: str):
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch_version(version: str = torch.__version__) -> None:
    lo, hi = SUPPORTED_TORCH
    if not lo <= major_minor(version) <= hi:
        raise ImportError(
            f"peak supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, but torch {version} is "
            f"installed. Install a supported torch (e.g. pip install torch=={hi[0]}.{hi[1]}.0), "
            f"then rebuild peak: {REBUILD}")


def load_extension():
    check_torch_version()
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            "peak's C++ extension (peak._C) is not built: this looks like a source tree that "
            f"was never installed. Build it with: {REBUILD}") from None
    if _build_info.torch_version != torch.__version__:
        raise ImportError(
            f"peak._C was built against torch {_build_info.torch_version}, but torch "
            f"{torch.__version__} is installed; a C++ extension only loads with the torch it was "
            f"built for. Rebuild it: {REBUILD}")
    try:
        from . import _C
    except ImportError as e:
        raise ImportError(
            f"peak._C failed to load ({e}). It was built against torch "
            f"{_build_info.torch_version}; torch {torch.__version__} is installed. "
            f"Rebuild it: {REBUILD}") from e
    try:
        # Chooses the CPU kernels' level now, so that an impossible PEAK_CPU_LEVEL stops the
        # import with its reason rather than the first op call.
        _C.cpu_levels()
    except RuntimeError as e:
        raise ImportError(str(e)) from None
    return _C
