#!/usr/bin/env python3
"""Hostile-client benchmark: bad inputs, overflow, nesting, huge prompts, slow clients, big compressed pushes.

Every attack runs against a real run_coordinator.py on loopback (bench.common.CoordinatorProcess),
bounded in count and time. Reported per attack: requests tried, 5xx answers (target 0: a 5xx is a
bug), the coordinator's peak RSS growth (VmHWM reset before each attack), and, for slow clients,
a normal client's /health and 5 MB push latencies (p50/p99) while 1,000 slow or idle connections
are open, plain and TLS, against the same client's figures with no attack (same run).

- ``bad_inputs``: bench/bad_inputs.py's matrix, the one tests/e2e/test_bad_inputs.py checks (--max-body-mb 1,
  --norm-check reject).
- ``hostile``: pushes of 3e38 (finite, the sum is not), 3,000-level nested JSON on every JSON
  route, query and X-FedMoE-* header, and one huge /route prompt.
- ``slow_clients``: bench/slow_clients.py's kinds: ``--connections`` split between dripped heads,
  slow bodies and idle keep-alive (no token needed), plus ``--slow-readers`` that never read a pull.
- ``compressed_pushes``: 8 concurrent maximum-size fp16 pushes to an expert of ``--model-mb``;
  target: peak RSS growth <= 2x the model size + 64 MiB (issue 13, defect 6).
- ``serve_slow_clients``, ``serve_sampling``, ``header_bytes``, ``tls_relay`` (bench/hostile_front.py): serve.py
  under slow clients (``--serve-baseline``: another checkout's serve.py too, A/B), its sampling edge values, CR/LF/NUL
  in request heads, and a relay started with --tls-cert; an honest client's p99 during each.
- ``backend_faults`` (only when named: it starts PostgreSQL and moto's S3 server): replicas started on a mistyped
  or empty store, the bucket lost while running, a table lock, with an honest worker pushing (bench/hostile_backends.py).
- ``new_surface``: the routes added since (upload probe, resumable uploads, ``?since=``, Range, the relay's
  API) and HTTP framing lies, against a root and a relay; slow probes and upload chunks while a normal worker
  syncs through the relay; 64 concurrent 4 MiB probes (bench/hostile_surface.py).
- ``reservation_exhaustion``: resumable uploads opened by every identity the workers' join token gives and never
  sent, declaring 1.25x the free disk; then an honest worker's 9 MiB pushes (bench/hostile_reservations.py).
- ``relay_poisoning``: a worker pushing finite deltas of 3e38 behind a real relay, plain and ``--site-model``;
  honest acknowledged updates lost or doubled at the root, pulls holding Inf (bench/hostile_relay.py).

Each attack class registers itself (bench/attacks.py) in the module that holds it: bench/hostile_requests.py (the
first four), hostile_surface.py, hostile_reservations.py, hostile_relay.py, hostile_front.py,
hostile_backends.py.

    python -m bench.hostile            # 1,000 slow connections, 240 MiB model; a few minutes
    python -m bench.hostile --quick    # 100 connections, 16 MiB model (tests/bench)

Table on stdout, progress on stderr, results in bench/results/hostile.json.
"""
from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import urllib3

# The modules that hold attack classes: importing one registers its classes in bench.attacks.ATTACKS, in this
# order (the order they run in by default).
import bench.hostile_requests  # noqa: F401
import bench.hostile_surface  # noqa: F401
import bench.hostile_reservations  # noqa: F401
import bench.hostile_relay  # noqa: F401
import bench.hostile_front  # noqa: F401
import bench.hostile_backends  # noqa: F401
import bench.common
from bench.attacks import P99_TARGET_S, Settings
from bench.common import SCRATCH_DIR, format_table
from bench.harness import Bench, Run

log = logging.getLogger("bench.hostile")
urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # our own self-signed loopback cert
HEADERS = ["attack", "requests", "5xx", "no answer", "peak RSS +MiB", "health p99 s", "5MB push p99 s"]


def attack_all(s: Settings) -> dict[str, Any]:
    """Every attack class chosen, each on fresh servers of its own; the report with the totals."""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fedmoe-hostile-", dir=SCRATCH_DIR) as scratch:
        for attack in s.attacks():
            report[attack.name] = attack.run(Path(scratch) / attack.name, s)
    tallies = [t for attack in s.attacks() for t in attack.tallies(report[attack.name])]
    slow = report.get("slow_clients", {}).values()
    return report | {
        "requests_tried": sum(t["requests"] for t in tallies), "status_5xx": sum(t["status_5xx"] for t in tallies),
        "normal_client_p99_s": max(((p["under_attack"][k]["p99_s"] or float("inf"))
                                    for p in slow for k in ("health", "push_5mb")), default=None),
        "targets": {"status_5xx": 0, "normal_client_p99_s": P99_TARGET_S,
                    "compressed_push_growth": "<= 2x model size + 64 MiB"},
        "server": (f"run_coordinator.py of {s.server_root.resolve()}" if s.server_root
                   else "this checkout's run_coordinator.py")}


def table(report: dict[str, Any], s: Settings) -> str:
    """The common table (a row per attack that has one), then each attack's own table."""
    chosen = [a for a in s.attacks() if a.name in report]
    rows = [row for a in chosen for row in a.rows(report[a.name])]
    texts = [format_table(HEADERS, rows)] if rows else []
    return "\n\n".join(texts + [a.table(report[a.name]) for a in chosen if a.table is not None])


def run(s: Settings, ctx: Run) -> int:
    if s.server_root is not None:  # CoordinatorProcess starts ROOT/run_coordinator.py
        bench.common.ROOT = s.server_root.resolve()
    report = attack_all(s) | {"quick": ctx.quick, "seconds": ctx.seconds()}
    ctx.write(report)
    print(table(report, s))
    print(f"requests tried {report['requests_tried']}, 5xx {report['status_5xx']} (target 0), normal client's "
          f"worst p99 under attack {report['normal_client_p99_s']} s (target < {P99_TARGET_S} s); {ctx.out}")
    return 0


BENCH = Bench("hostile", tags=("robustness",), settings=Settings, run=run, torch_threads=None,
              quick={"connections": 100, "slow_readers": 20, "model_mb": 16, "prompt_mb": 1.0, "health": 10,
                     "pushes": 3, "honest_pushes": 3, "relay_rounds": 3, "lock_seconds": 5.0})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
