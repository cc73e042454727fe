"""Fixtures for the model tests."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_torch_thread():
    """Run torch single-threaded here, restoring the setting afterwards.

    On a shared 2-core machine torch's OpenMP threads spin-wait when another process takes a core,
    and a 0.04 s training step was measured taking 3.5 s; one thread costs ~0.07 s and stays put.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
