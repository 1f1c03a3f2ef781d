import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from peak.amp import _caster  # noqa: E402
from peak.amp._amp_state import _amp_state  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_state():
    """No amp state in or out; one intra-op thread (bitwise comparisons depend on it)."""
    _caster.disable()
    _amp_state.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _caster.disable()
    _amp_state.reset()
