import pytest
import torch

from peak.amp import _caster
from peak.amp._amp_state import _amp_state


@pytest.fixture(autouse=True)
def fresh_amp_state():
    """Every test starts and ends with no amp state (amp's state is process-global, like Apex's)."""
    _reset()
    torch.manual_seed(0)
    yield
    _reset()


def _reset():
    _caster.disable()
    _amp_state.reset()
    _amp_state.hard_override = False
    _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.verbosity = 1
