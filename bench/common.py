"""What the benchmarks share: data suites, a real coordinator on loopback (in this process or as
run_coordinator.py), tables and result files.

A *suite* is one federated job's data: three domains, each with its own train and held-out
examples (one worker and one expert per domain). ``sample`` is the project's own data/;
``ds1000`` is the numpy/pandas/sklearn part of DS-1000 the repository ships in data/ds1000/
(train/ and heldout/ per domain, whole problem families held out; CC BY-SA 4.0).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from werkzeug.serving import make_server

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from protocol.client import Pulled
from protocol.credentials import local_token, publish_local_token, withdraw_local_token
from protocol.files import write_atomically
from protocol.tensors import StateDict
from worker.data import Example, load_examples, sample_dataset_path, split_examples

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
DS1000_DIR = ROOT / "data" / "ds1000"
# The coordinator fsyncs every update; on a virtual disk that is ~40% of a compression job's time,
# and durability is not what the benchmarks measure. Their data dirs go to RAM when there is one.
SCRATCH_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
SAMPLE_DOMAINS = ("python_expert", "sql_expert", "docs_expert")
DS1000_DOMAINS = ("pandas_expert", "numpy_expert", "sklearn_expert")
LISTENING = re.compile(r"listening on (https?://[\d.]+:\d+)")
"""The line run_coordinator.py logs once it accepts connections (the same as tests/e2e/conftest.py's)."""


@dataclass(frozen=True)
class Domain:
    """One specialty: the examples its worker trains on and those its expert is judged on."""

    name: str
    """Expert name on the coordinator."""
    train: tuple[Example, ...]
    """Examples the worker trains on."""
    heldout: tuple[Example, ...]
    """Examples never trained on (``worker.data.split_examples``'s hash split, or DS-1000's shipped heldout/)."""


@dataclass(frozen=True)
class Suite:
    """The data of one federated job: one domain per worker."""

    name: str
    """``sample`` or ``ds1000``."""
    domains: tuple[Domain, ...]


def load_domain(name: str, path: Path) -> Domain:
    train, heldout = split_examples(load_examples(path))
    return Domain(name, tuple(train), tuple(heldout))


def sample_path(name: str) -> Path:
    """The shipped sample dataset data/<name>.jsonl; FileNotFoundError that says what to run if it is missing."""
    path = sample_dataset_path(name)
    if path is None:
        raise FileNotFoundError(f"sample dataset data/{name}.jsonl is missing; run `python data/make_samples.py`")
    return path


def sample_suite() -> Suite:
    """The project's sample data (python_expert, sql_expert, docs_expert)."""
    return Suite("sample", tuple(load_domain(name, sample_path(name)) for name in SAMPLE_DOMAINS))


def ds1000_suite(directory: Path = DS1000_DIR) -> Suite | None:
    """DS-1000's pandas, numpy and sklearn domains as shipped (train/ and heldout/), or None (logged) if absent."""
    paths = {name: (directory / "train" / f"{name}.jsonl", directory / "heldout" / f"{name}.jsonl")
             for name in DS1000_DOMAINS}
    missing = [str(p) for pair in paths.values() for p in pair if not p.is_file()]
    if missing:
        log.warning("DS-1000 not found (%s); skipping the ds1000 suite", ", ".join(missing))
        return None
    return Suite("ds1000", tuple(Domain(name, tuple(load_examples(train)), tuple(load_examples(heldout)))
                                 for name, (train, heldout) in paths.items()))


SUITES: dict[str, Callable[[], Suite | None]] = {"sample": sample_suite, "ds1000": ds1000_suite}


def load_suites(names: Sequence[str]) -> list[Suite]:
    """The named suites that are available, in the order given."""
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {sorted(SUITES)}")
    return [suite for suite in (SUITES[n]() for n in names) if suite is not None]


@contextmanager
def running_coordinator(**settings: Any) -> Iterator[str]:
    """A real coordinator (threaded werkzeug server) on a free loopback port, on a fresh data dir.

    Yields its base URL; ``settings`` go to ``CoordinatorConfig``. Authentication is on, as by default;
    ``CoordinatorClient(url)`` finds the admin token the way a client next to run_coordinator.py does. Everything is torn down on exit.
    The data dir is in ``SCRATCH_DIR`` (RAM) when there is one.
    """
    with tempfile.TemporaryDirectory(prefix="fedmoe-bench-", dir=SCRATCH_DIR) as data_dir:
        app = create_app(CoordinatorConfig(data_dir=Path(data_dir), **settings))
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, name="bench-coordinator", daemon=True)
        thread.start()
        auth = app.extensions.get("fedmoe_auth")
        if auth:  # clients here and in spawned processes find the admin token, as next to run_coordinator.py
            publish_local_token("127.0.0.1", server.server_port, auth.admin_token)
        try:
            yield f"http://127.0.0.1:{server.server_port}"
        finally:
            if auth:
                withdraw_local_token("127.0.0.1", server.server_port)
            server.shutdown()
            thread.join()
            server.server_close()
            app.extensions["fedmoe"].close()


def recorded_token(url: str) -> str:
    """The admin token a coordinator on this machine recorded for ``url`` (running_coordinator does, with auth on).

    For a child's environment, where a None would fail as an unreadable TypeError inside subprocess.
    """
    token = local_token(url)
    if token is None:
        raise RuntimeError(f"no admin token is recorded for {url}: is its coordinator running here, with auth on?")
    return token


def pulled_tensors(pulled: Pulled) -> StateDict:
    """A pull's tensors. They are None only for a 304, which a pull that sent no ETag does not get."""
    if pulled.tensors is None:
        raise RuntimeError(f"the coordinator answered 'unchanged' (version {pulled.version}) to a pull without an ETag")
    return pulled.tensors


class CoordinatorProcess:
    """run_coordinator.py as users start it (a separate OS process), on a free loopback port.

    ``flags`` are added to ``--host 127.0.0.1 --port 0 --data-dir DATA_DIR``. With ``new_session``
    the coordinator gets its own process group, so that ``kill()`` takes it and anything it started
    down together (a real crash). ``start()`` may be called again after
    ``kill()`` or ``stop()``: it restarts on the same data dir, as an operator would. Its output
    (all starts) collects in ``log``; the pipe is drained on a thread, since a full pipe would block it.
    """

    popen: Callable[..., Any] = subprocess.Popen
    """How the process starts: ``subprocess.Popen``; the test suite puts its launcher here (tests/launcher.py)."""

    def __init__(self, data_dir: Path, *flags: str, new_session: bool = False) -> None:
        self.data_dir = data_dir
        self.flags = flags
        self.new_session = new_session
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log: list[str] = []

    @property
    def pid(self) -> int:
        """The coordinator's pid (one process serves everything)."""
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def headers(self) -> dict[str, str]:
        """The admin token's Authorization header, for raw ``requests``; ``CoordinatorClient(url)`` finds it itself.

        The coordinator keeps the token in its data dir, so it stays the same across restarts.
        """
        return {"Authorization": f"Bearer {(self.data_dir / 'admin_token').read_text().strip()}"}

    def start(self, timeout: float = 180.0) -> float:
        """Spawn, wait until /health answers and return the seconds that took; stopped again if it fails."""
        started = time.monotonic()
        # FEDMOE_BENCH_SERVER_ROOT: another checkout's coordinator, for an A/B ratio in one run (docs/history/scale.md)
        root = Path(os.environ.get("FEDMOE_BENCH_SERVER_ROOT") or ROOT)
        env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = type(self).popen(
            [sys.executable, str(root / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
             "--data-dir", str(self.data_dir), *self.flags],
            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=self.new_session)
        try:
            self._wait_until_up(started, timeout)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - started

    def _wait_until_up(self, started: float, timeout: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if m := LISTENING.search(line):
                self.url = m.group(1)
                break
        else:
            raise RuntimeError("coordinator exited before listening:\n" + "".join(self.log[-40:]))
        threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True).start()
        while time.monotonic() - started < timeout:  # the line comes just before the loop serves
            try:
                # verify=False: our own process on loopback, possibly with a self-signed --tls-cert
                if requests.get(self.url + "/api/v1/health", timeout=2, verify=False).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.01)
        raise RuntimeError(f"coordinator not answering after {timeout} s")

    def lines(self, match: Callable[[str], bool], timeout: float = 60.0) -> list[str]:
        """The output lines ``match`` accepts, once there is at least one (or ``timeout`` s passed): the output
        is read by a thread, so a line logged while answering a request may arrive after the answer."""
        deadline = time.monotonic() + timeout
        while not (found := [line for line in list(self.log) if match(line)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def _signal(self, signum: int) -> None:
        assert self.proc is not None
        if self.new_session:
            os.killpg(self.proc.pid, signum)  # the whole group we started
        else:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits until it is gone."""
        self._signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a clean shutdown), then ``kill()`` if it has not exited within ``timeout`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def coordinator_process(data_dir: Path, *flags: str, new_session: bool = False) -> Iterator[CoordinatorProcess]:
    """A started ``CoordinatorProcess``, stopped on exit; its last output goes to stderr if the body fails."""
    server = CoordinatorProcess(data_dir, *flags, new_session=new_session)
    server.start()
    try:
        yield server
    except BaseException:
        sys.stderr.write("coordinator output:\n" + "".join(server.log[-30:]))
        raise
    finally:
        server.stop()


Task = tuple[Callable[..., Any], tuple[Any, ...]]


def run_parallel(tasks: Sequence[Task], jobs: int, on_result: Callable[[int, Any], None],
                 initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> list[Any]:
    """``[fn(*args) for fn, args in tasks]``, ``jobs`` at a time in fresh processes (here if jobs == 1).

    Processes are spawned, not forked: torch's thread pools do not survive a fork. ``on_result``
    sees (number finished so far, result) as each task ends; results come back in task order.
    """
    results: list[Any] = []
    if jobs == 1:
        for fn, args in tasks:
            results.append(fn(*args))
            on_result(len(results), results[-1])
        return results
    results = [None] * len(tasks)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=initializer,
                             initargs=initargs) as pool:
        futures: dict[Future, int] = {pool.submit(fn, *args): i for i, (fn, args) in enumerate(tasks)}
        for done, future in enumerate(as_completed(futures), start=1):
            results[futures[future]] = future.result()
            on_result(done, results[futures[future]])
    return results


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain aligned table. ``align`` has one 'l' or 'r' per column; by default numbers go right."""
    if align is None:
        align = "".join("r" if all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) else "l"
                        for i in range(len(headers)))
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one 'l' or 'r' per column ({len(headers)}), got {align!r}")
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, (json.dumps(data, indent=2) + "\n").encode())


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """parser.error for any of these optional count flags given below 1 (None = not given, its default stands)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def configure_logging(verbose: bool = False) -> None:
    """Progress on stderr; the libraries' own INFO chatter (per-sync, per-request) stays quiet."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not verbose:
        for noisy in ("coordinator", "worker", "protocol", "werkzeug", "httpx", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)

