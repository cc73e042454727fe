"""Test-wide settings: never reach a model hub, keep output quiet, keep credentials to ourselves."""
import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Coordinators started by tests record their admin token for local clients (protocol.credentials);
# keep those entries in a directory of this test run, inherited by the processes it spawns.
# Under pytest-xdist (make test: -n 2) each worker process gets its own, not the controller's it inherits.
if "FEDMOE_CONFIG_DIR" not in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["FEDMOE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="fedmoe-test-config-")
    atexit.register(shutil.rmtree, os.environ["FEDMOE_CONFIG_DIR"], True)


TIERS_BY_DIRECTORY = {"e2e": pytest.mark.e2e, "bench": pytest.mark.bench}
"""tests/<directory>/ -> the marker every test in it gets (pytest.ini lists the tiers)."""
TESTS = Path(__file__).resolve().parent
PROCESS_FIXTURES = {"start_coordinator"}
"""Fixtures that start real processes: a test using one is e2e wherever it lives."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
        if parts and parts[0] in TIERS_BY_DIRECTORY:
            item.add_marker(TIERS_BY_DIRECTORY[parts[0]])
        elif PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)  # starts a real coordinator: not the unit tier, wherever it lives
