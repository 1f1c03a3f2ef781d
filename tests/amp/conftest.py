import pytest
import torch

from peak.amp import _caster
from peak.amp._amp_state import _amp_state


@pytest.fixture(autouse=True)
def fresh_amp_state():
    """Every test starts and ends with no amp state (amp's state is process-global, like Apex's).
    The tensors here are tiny: one intra-op thread avoids thread contention on small CI machines."""
    _reset()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _reset()


def _reset():
    _caster.disable()
    _amp_state.reset()
    _amp_state.hard_override = False
    _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.verbosity = 1
