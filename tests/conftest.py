"""pytest hooks for the whole suite. Shared test vocabulary lives in peak_testing.py (a module
name of its own: tests/amp has its own conftest, and `import conftest` would be ambiguous)."""
import pytest

from peak_testing import HAS_CUDA


def pytest_configure(config):
    # The suite runs the ops through the emulated CUDA grid too; that needs the test-only twins,
    # which a release build leaves out. Stop with the fix rather than fail test by test.
    import peak
    if not peak._C.build_info().get("test_twins", False):
        pytest.exit("peak was built without its test-only twins (PEAK_TEST_TWINS=ON): build it "
                    "with `make build` (or `make test`), or pip install with "
                    "-C cmake.define.PEAK_TEST_TWINS=ON", returncode=4)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    # Which copy of the CPU kernels this run tests (PEAK_CPU_LEVEL can force one; docs/build.md).
    try:
        from peak import ops
        levels = ops.cpu_levels()
    except Exception as e:  # an impossible PEAK_CPU_LEVEL: the tests will say so
        return f"peak CPU level: unavailable ({e})"
    import os
    import peak
    how = "forced by PEAK_CPU_LEVEL" if levels["forced"] else "the default"
    return [f"peak CPU level: {levels['active']} ({how}; compiled: {','.join(levels['compiled'])})",
            f"peak from {os.path.dirname(os.path.dirname(peak.__file__))}"]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    # A launcher's WORLD_SIZE makes amp O2 start masters from the cast weights (NOTE: [Masters
    # under DDP]): the suite runs as one process wherever it is started; tests that want the
    # multi-rank rule set it themselves (the distributed tests spawn real ranks).
    monkeypatch.delenv("WORLD_SIZE", raising=False)
