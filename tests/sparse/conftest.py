import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These problems are tiny: one thread, so that a busy shared machine does not make every
    small op wait for a thread pool (the generation tests run about 100x slower oversubscribed)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
