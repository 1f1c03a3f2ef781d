import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the worker modules by name

from dist_helpers import reset_amp  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_amp_state():
    """amp's state is process-global: every test (and its single-process references) starts and
    ends without it, on one intra-op thread (bitwise results depend on the thread count)."""
    reset_amp()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    reset_amp()
