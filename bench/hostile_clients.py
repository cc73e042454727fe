"""What bench/hostile.py's attack classes on the serving path share (bench/hostile_serving.py, bench/hostile_front.py):
a tally of the answers, an honest client that keeps asking on a thread of its own while an attack runs, the attacked
process's peak RSS growth, raw requests and a self-signed certificate."""
from __future__ import annotations

import ssl
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.attacks import percentiles, rss_bytes


# results ------------------------------------------------------------------------------------------------

@dataclass
class Tally:
    """Answers in one attack: statuses by case, failures to get any answer, an honest client's latencies."""

    statuses: dict[str, int | None] = field(default_factory=dict)
    honest_s: list[float] = field(default_factory=list)

    def record(self, name: str, status: int | None) -> None:
        self.statuses[name] = status

    def summary(self) -> dict[str, Any]:
        got = [s for s in self.statuses.values() if s is not None]
        return {"requests": len(self.statuses), "status_5xx": sum(s >= 500 for s in got),
                "no_answer": len(self.statuses) - len(got), "honest": percentiles(self.honest_s),
                "statuses": self.statuses}


def peak_growth(pid: int, attack: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``attack``; (its result, the process's peak RSS growth in bytes meanwhile)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    before = rss_bytes(pid)
    result = attack()
    return result, max(0, rss_bytes(pid, "VmHWM") - before)


class Honest:
    """An honest client's calls (each returns the answer's status) in a loop on a thread of its own while an attack
    runs: the latencies of those answered below 500, and how many were not."""

    def __init__(self, calls: Sequence[Callable[[], int]]) -> None:
        self.calls = calls
        self.seconds: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="honest-client", daemon=True)

    def __enter__(self) -> Honest:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(300)

    def _run(self) -> None:
        while not self._stop.is_set():
            for call in self.calls:
                started = time.perf_counter()
                try:
                    ok = call() < 500
                except (requests.RequestException, OSError):
                    ok = False
                if ok:
                    self.seconds.append(time.perf_counter() - started)
                else:
                    self.failed += 1


def status_of(call: Callable[[], requests.Response]) -> Callable[[], int]:
    return lambda: call().status_code


def raw_status(host: str, port: int, head: bytes, context: ssl.SSLContext | None = None) -> int | None:
    """Send ``head`` on a new connection; the answer's status (None: closed without one)."""
    try:
        with socket.create_connection((host, port), timeout=30) as raw:
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            sock.sendall(head)
            answer = b""
            while b"\r\n" not in answer and (piece := sock.recv(4096)):
                answer += piece
    except (OSError, ssl.SSLError):
        return None
    first = answer.split(b"\r\n", 1)[0].split()
    return int(first[1]) if len(first) > 1 and first[0].startswith(b"HTTP/") else None


