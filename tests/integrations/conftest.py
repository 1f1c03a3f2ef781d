import warnings

import pytest
import torch

from peak.amp import _caster
from peak.amp._amp_state import _amp_state


@pytest.fixture(autouse=True)
def fresh_amp_state():
    """amp's state is process-wide (an O1 run leaves its casts on): every test starts and ends
    without it. One intra-op thread: bitwise comparisons need the same reduction order in both
    runs, and the models are tiny."""
    _caster.disable()
    _amp_state.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        # Lightning's advice for real training (DataLoader workers, logging) is noise here.
        warnings.filterwarnings("ignore", module="lightning")
        yield
    torch.set_num_threads(threads)
    _caster.disable()
    _amp_state.reset()
