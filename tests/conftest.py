"""pytest hooks for the whole suite. Shared test vocabulary lives in peak_testing.py (a module
name of its own: tests/amp has its own conftest, and `import conftest` would be ambiguous)."""
import pytest

from peak_testing import HAS_CUDA


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
