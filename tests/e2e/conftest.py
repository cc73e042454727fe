"""Real processes on loopback: the coordinator as users start it, on a port it picks."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from protocol.credentials import local_token
from tests import launcher

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (https?://[\d.]+:\d+)")


def admin_headers(url: str) -> dict[str, str]:
    """Headers for raw ``requests`` calls: the admin token the coordinator recorded for local clients."""
    token = local_token(url)
    assert token, f"no local token recorded for {url}"
    return {"Authorization": f"Bearer {token}"}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Process:
    proc: subprocess.Popen | launcher.LaunchedProcess
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None, "spawn() pipes stdout"
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: re.Pattern, timeout: float = 60.0) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern.pattern!r}; output:\n{''.join(self.log)}")
            if m := pattern.search(line):
                return m

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def ctrl_c_enabled() -> None:
    """In the child before exec: SIGINT back to its default, so Python turns Ctrl-C into KeyboardInterrupt even
    when pytest runs as a background job of a non-interactive shell (which starts children with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, cwd: Path = ROOT) -> Process:
    """``python *args`` as a process of its own, forked from a launcher that imported torch & co. once
    (tests/launcher.py)."""
    proc = launcher.popen([sys.executable, *args], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_enabled)
    return Process(proc)


def module_coordinator(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[str]:
    """For a module-scoped fixture of a test module (tests/conftest.py then runs its tests on one xdist process):
    one coordinator, started with ``flags``, for tests that only read its answers or use resources of their own;
    yields its URL and stops it after the module. A start costs ~2 CPU s of imports."""
    data_dir = tmp_path_factory.mktemp("coordinator")
    process = spawn(str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0", "--data-dir",
                    str(data_dir), *flags)
    try:
        yield process.wait_for(LISTENING).group(1)
    finally:
        process.stop()


@pytest.fixture
def start_coordinator(tmp_path) -> Iterator:
    started: list[Process] = []

    def start(*extra: str, data_dir: Path | None = None) -> tuple[Process, str]:
        p = spawn(str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                  "--data-dir", str(data_dir or tmp_path / "coordinator"), *extra)
        started.append(p)
        return p, p.wait_for(LISTENING).group(1)

    yield start
    for p in started:
        p.stop()
