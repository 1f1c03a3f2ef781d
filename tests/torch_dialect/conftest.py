import pytest
import torch


@pytest.fixture(autouse=True)
def _small_and_clean():
    """Tiny tensors: one intra-op thread (a 2-core CI machine may run other suites). Every test
    must leave autocast off, as it found it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
    assert not torch.is_autocast_enabled("cpu"), "a test left CPU autocast on"
