"""The attack classes of bench.hostile, by name, and what they share.

An attack class is a function that starts what it needs on loopback (a coordinator, a relay), attacks it, bounded
in count and time, and returns its part of the report. It registers itself where it is written::

    @attack("compressed_pushes", rows=summary_row)
    def compressed_pushes(directory: Path, s: Settings) -> dict[str, Any]: ...

``rows`` gives its lines of bench.hostile's common table, ``table`` a table of its own, ``tallies`` the parts whose
requests and 5xx answers count in the run's totals. bench.hostile imports the modules that hold attacks, then runs
``--only``'s names (or every class that runs ``by_default``) through ``ATTACKS``: no list of names to keep by hand.

Also here: the tally of one attack's answers, percentiles, the attacked process's peak RSS, a self-signed
certificate.
"""
from __future__ import annotations

import json
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from protocol.cli import option

MiB = 1 << 20
P99_TARGET_S = 1.0
"""A normal client's worst p99 under attack, target."""


@dataclass(frozen=True)
class Settings:
    """bench.hostile's flags: what every attack class may read."""

    connections: int = option(1000, "slow connections per transport")
    slow_readers: int = option(100, "more connections that fetch 5 MB of weights and never read them")
    model_mb: int = option(240, "model size for the compressed pushes")
    prompt_mb: float = option(8.0, "size of the huge /route prompt")
    only: tuple[str, ...] | None = option(None, "attacks to run (default: all but those that start other servers, "
                                          "e.g. backend_faults: PostgreSQL and moto)", nargs="+", metavar="ATTACK")
    health: int = option(60, "the normal client's /health requests per phase")
    pushes: int = option(12, "the normal client's 5 MB pushes per phase")
    client_timeout: float = option(60.0, "the normal client's timeout per request, seconds")
    server_root: Path | None = option(None, "run another checkout's run_coordinator.py (e.g. before this change, for "
                                      "comparison)", type=Path)
    serve_baseline: Path | None = option(None, "another checkout whose serve.py also runs the serve_slow_clients "
                                         "attack (A/B, same run)", type=Path)
    honest_pushes: int = 10
    """reservation_exhaustion: the honest worker's 9 MiB pushes (--quick: 3)."""
    relay_rounds: int = 6
    """relay_poisoning: rounds of pushes behind the relay (--quick: 3)."""
    lock_seconds: float = 15.0
    """backend_faults: how long the table lock is held (--quick: 5)."""

    def __post_init__(self) -> None:
        for name in ("connections", "slow_readers", "model_mb", "health", "pushes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (self.prompt_mb > 0 and self.client_timeout > 0):
            raise ValueError("--prompt-mb and --client-timeout must be positive")
        if self.server_root is not None and not (self.server_root / "run_coordinator.py").is_file():
            raise ValueError(f"--server-root {self.server_root}: no run_coordinator.py there")
        self.attacks()  # --only names registered attacks

    def attacks(self) -> list[AttackClass]:
        """The classes to run, in the order named (default: registration order)."""
        if self.only is None:
            return [a for a in ATTACKS.values() if a.by_default]
        unknown = [name for name in self.only if name not in ATTACKS]
        if unknown:
            raise ValueError(f"--only: unknown attacks {unknown}; choose from {list(ATTACKS)}")
        return [ATTACKS[name] for name in dict.fromkeys(self.only)]


Part = dict[str, Any]


def _none(part: Part) -> list[Any]:
    return []


@dataclass(frozen=True)
class AttackClass:
    """One registered attack class."""

    name: str
    run: Callable[[Path, Settings], Part]
    """(a fresh directory for its servers, the settings) -> its part of the report."""
    rows: Callable[[Part], list[list[Any]]] = _none
    """Its rows of the common table: attack, requests, 5xx, no answer, peak RSS +MiB, health p99 s, push p99 s."""
    table: Callable[[Part], str] | None = None
    """A table of its own, printed after the common one."""
    tallies: Callable[[Part], list[Part]] = _none
    """Its summaries (each with ``requests`` and ``status_5xx``) counted in the run's totals."""
    by_default: bool = True
    """Runs unless --only names others (False: it starts other servers, asked for by name)."""


ATTACKS: dict[str, AttackClass] = {}


def attack(name: str, *, rows: Callable[[Part], list[list[Any]]] = _none, table: Callable[[Part], str] | None = None,
           tallies: Callable[[Part], list[Part]] = _none, by_default: bool = True
           ) -> Callable[[Callable[[Path, Settings], Part]], Callable[[Path, Settings], Part]]:
    """Register the decorated function as the attack class ``name``."""
    def register(run: Callable[[Path, Settings], Part]) -> Callable[[Path, Settings], Part]:
        if name in ATTACKS:
            raise ValueError(f"attack {name!r} is registered twice")
        ATTACKS[name] = AttackClass(name, run, rows, table, tallies, by_default)
        return run
    return register


# what the attacks share ---------------------------------------------------------------------------------

@dataclass
class Tally:
    """Every answer the bench got in one attack."""

    statuses: list[int] = field(default_factory=list)
    failures: int = 0
    """Requests that got no HTTP answer at all (refused, reset, timed out)."""
    cases: dict[str, Any] = field(default_factory=dict)

    def send(self, name: str, call: Callable[[], Any], expected: int | None = None) -> int | None:
        try:
            answer = call()
        except requests.RequestException as exc:
            self.failures += 1
            self.cases[name] = {"status": None, "error": type(exc).__name__}
            return None
        status, body = (answer.status_code, answer.content) if isinstance(answer, requests.Response) else answer
        self.statuses.append(status)
        self.cases[name] = {"status": status, "json_error": is_json_error(body) if status >= 400 else None}
        if expected is not None:
            self.cases[name]["expected"] = expected
        return status

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.statuses) + self.failures, "status_5xx": sum(s >= 500 for s in self.statuses),
                "no_answer": self.failures,
                "unexpected": sorted(n for n, c in self.cases.items()
                                     if c["status"] is None or c["status"] >= 500
                                     or ("expected" in c and c["status"] != c["expected"]))}


def is_json_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
        return isinstance(error["code"], str) and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        return False


def percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_s": round(statistics.median(ordered), 4), "p99_s": round(p99, 4), "max_s": round(ordered[-1], 4)}


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} for process {pid}")


def serving_pid(pid: int) -> int:
    """The process that serves: ``pid`` itself, or its forked worker (an older checkout's, with --server-root)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else pid


def measured(pid: int, run: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``run``; (its result, the coordinator's peak RSS growth in bytes during it)."""
    pid = serving_pid(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    before = rss_bytes(pid)
    result = run()
    return result, max(0, rss_bytes(pid, "VmHWM") - before)


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key
