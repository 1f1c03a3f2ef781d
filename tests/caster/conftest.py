import pytest
import torch

from peak.amp import _caster, lists


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def low(request):
    return request.param


@pytest.fixture
def o1(low):
    """O1 casting on in this thread with the low dtype; off and default lists afterwards."""
    _caster.enable(low)
    try:
        yield low
    finally:
        _caster.disable()
        lists.reset()


@pytest.fixture(autouse=True)
def _clean():
    yield
    from peak.amp._amp_state import _amp_state
    _caster.disable()
    lists.reset()
    lists.set_allow_banned(False)
    _amp_state.reset()
