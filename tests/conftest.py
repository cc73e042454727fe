"""Test-wide settings: never reach a model hub, keep output quiet, keep credentials to ourselves."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import launcher

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Coordinators started by tests record their admin token for local clients (protocol.credentials);
# keep those entries in a directory of this test run, inherited by the processes it spawns.
# Under pytest-xdist (make test: -n 4) each worker process gets its own, not the controller's it inherits.
if "FEDMOE_CONFIG_DIR" not in os.environ or os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["FEDMOE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="fedmoe-test-config-")
    atexit.register(shutil.rmtree, os.environ["FEDMOE_CONFIG_DIR"], True)


# Under xdist several test processes share the cores: one torch thread each, and for the processes they start
# (a child's own --threads or OMP_NUM_THREADS still wins), since OpenMP threads spin-wait for a busy core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")  # module scope: before the module fixtures that start coordinators
def forked_coordinator_processes(request: pytest.FixtureRequest):
    """bench.common.CoordinatorProcess starts its coordinators from tests/launcher.py in the product tiers; a
    benchmark's smoke run (tests/bench/) keeps plain processes, since some of them time a coordinator's start."""
    common = sys.modules.get("bench.common")
    if common is None or Path(request.node.path).resolve().is_relative_to(TESTS / "bench"):
        yield
        return
    common.CoordinatorProcess.popen = launcher.popen
    try:
        yield
    finally:
        common.CoordinatorProcess.popen = subprocess.Popen


TIERS_BY_DIRECTORY = {"e2e": pytest.mark.e2e, "bench": pytest.mark.bench}
"""tests/<directory>/ -> the marker every test in it gets (pytest.ini lists the tiers)."""
TESTS = Path(__file__).resolve().parent
PROCESS_FIXTURES = {"start_coordinator"}
"""Fixtures that start real processes: a test using one is e2e wherever it lives."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks this adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        parts = path.relative_to(TESTS).parts if path.is_relative_to(TESTS) else ()
        if parts and parts[0] in TIERS_BY_DIRECTORY:
            item.add_marker(TIERS_BY_DIRECTORY[parts[0]])
        elif PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)  # starts a real coordinator: not the unit tier, wherever it lives
    if os.environ.get("PYTEST_XDIST_WORKER"):
        plan_parallel_run(items)


@pytest.hookimpl(trylast=True)  # after pytest-xdist has renamed the grouped items
def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop a parallel run whose groups would not hold: pytest-xdist 3.8 sends a group to one worker by
    appending "@group" to the item's node id, and a pytest that keys items otherwise (9.2 does) drops that
    silently, so each test of a group ran elsewhere and rebuilt its module fixture (requirements.txt)."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and session.config.getoption("loadgroup", False)):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup: {len(lost)} grouped tests lost their xdist group "
                                f"(pytest {pytest.__version__} with this pytest-xdist), e.g. {lost[0]}")


def plan_parallel_run(items: list[pytest.Item]) -> None:
    """Order and group the tests for `pytest -n N --dist loadgroup` (make test, make test-fast).

    A module whose tests share a module-scoped fixture it defines (a demo run, two torch ranks, a live server)
    goes to one xdist worker, which builds the fixture once. Real-process and benchmark tests come first: xdist
    hands out work in collection order, so the longest tests start early instead of ending the run alone.
    """
    for item in items:
        if shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(str(Path(item.path).relative_to(TESTS))))
    items.sort(key=lambda item: not any(item.get_closest_marker(tier) for tier in ("slow", "e2e", "bench")))


def shares_a_module_fixture(item: pytest.Item) -> bool:
    module_id = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" and d.baseid == module_id
                                    for defs in info.name2fixturedefs.values() for d in defs)


CPU_LOG = os.environ.get("FEDMOE_TEST_CPU_LOG")
"""Set to a path to append one JSON line per test: wall seconds and CPU seconds of the test process and of
the child processes it waited for (load-independent, unlike --durations). docs/testing.md ranks tests by it."""

if CPU_LOG:
    import json
    import resource
    import time

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
        def cpu(who: int) -> float:
            usage = resource.getrusage(who)
            return usage.ru_utime + usage.ru_stime

        wall, own, children = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
        launched = launcher.launched_cpu_seconds()  # processes forked from tests/launcher.py are not our children
        try:
            return (yield)
        finally:
            with open(CPU_LOG, "a") as log:
                log.write(json.dumps({"test": item.nodeid, "wall": round(time.monotonic() - wall, 3),
                                      "cpu": round(cpu(resource.RUSAGE_SELF) - own, 3),
                                      "children": round(cpu(resource.RUSAGE_CHILDREN) - children
                                                        + launcher.launched_cpu_seconds() - launched, 3)}) + "\n")
