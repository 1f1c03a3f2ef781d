"""pytest plugin of `make gpu-check`: keeps only the tests that need a CUDA device.

Loaded with ``-p gpu_check_select`` (tools/ on PYTHONPATH). A test is a CUDA test when the
repository says so in one of the ways it does (tests/conftest.py, tests/peak_testing.py):
- the ``cuda`` marker, on the test, its class or module, or on one of its parameters
  (``pytest.param("cuda", marks=pytest.mark.cuda)``: peak_testing.DEVICES);
- a ``skipif`` whose reason names CUDA or a GPU (``reason="needs a CUDA GPU"``);
- a parameter that is a CUDA device (``"cuda"``, ``"cuda:0"``, a ``torch.device``, or an object
  whose ``device`` attribute is one).
Test names are not read: "emulated_cuda_grid" tests run on the CPU.
"""
import re

import pytest

_GPU_REASON = re.compile(r"\bcuda\b|\bgpu\b", re.IGNORECASE)


def _is_cuda_device(value) -> bool:
    for v in (value, getattr(value, "device", None)):
        if isinstance(v, str) and (v == "cuda" or v.startswith("cuda:")):
            return True
        if type(v).__name__ == "device" and getattr(v, "type", None) == "cuda":
            return True
    return False


def is_cuda_test(item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        if _GPU_REASON.search(str(mark.kwargs.get("reason", ""))):
            return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(_is_cuda_device(v) for v in callspec.params.values()):
        return True
    return False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (keep if is_cuda_test(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    return "gpu-check: only the CUDA tests are selected (tools/gpu_check_select.py)"
