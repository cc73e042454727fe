"""Fixtures for the model tests: torch single-threaded, as for the worker tests (tests/worker/conftest.py says why)."""
from tests.worker.conftest import single_torch_thread  # noqa: F401 - an autouse fixture, used by being here
