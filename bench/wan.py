#!/usr/bin/env python3
"""WAN benchmark (baseline): a flat federation whose workers reach the root over an emulated WAN.

One emulated site (``bench.wanemu``: a network namespace, a veth pair shaped with tbf, a delay
proxy) holds ``--workers`` real ``run_worker.py`` processes training one expert on tiny-qwen2; the
root coordinator runs on this host's loopback, behind the site's 20 Mbit/s, 50 ms RTT link. For
each configuration in ``CODECS`` (uncompressed pushes; topk+int8 pushes with error feedback; the
same with fp16 diff pulls) it reports the median time of a sync, the bytes that crossed the link
into the root (ingress: pushes, requests) and out of it (egress: pulls), counted by the proxy on
the wire, headers included.

This is the flat baseline that relay coordinators (issue 16) are to be compared against; the
per-sync figures come from the workers' own ``--results`` records.

    python -m bench.wan --quick      # 2 workers, ~40 s per codec
    python -m bench.wan              # 3 workers, 90 s per codec

Needs root (network namespaces). Table on stdout, progress on stderr, results in bench/results/wan.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, SCRATCH_DIR, configure_logging, format_table, running_coordinator, write_json_atomic
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from protocol.credentials import TOKEN_ENV, local_token

log = logging.getLogger("bench.wan")
ROOT = Path(__file__).resolve().parents[1]
SPECIALTY = "sql_expert"
TOPK_INT8 = ["--compression", "topk+int8", "--compression-config", '{"ratio": 0.05}']
CODECS = {"uncompressed": ["--compression", "safetensors"],
          "topk+int8": TOPK_INT8,
          "topk+int8, fp16 diff pulls": [*TOPK_INT8, "--pull-compression", "fp16"]}
"""name -> the workers' compression flags (push codec, and optionally compressed diff pulls)."""


@dataclass(frozen=True)
class Settings:
    workers: int
    """run_worker.py processes in the site."""
    duration: float
    """Seconds each worker trains."""
    sync_interval: float
    """Seconds between a worker's syncs."""
    rate_mbit: float = 20.0
    """Bandwidth of the site's link to the root, each way."""
    rtt_ms: float = 50.0
    """Round-trip time the delay proxy adds on that link."""


def worker_command(index: int, url: str, results: Path, codec: list[str], s: Settings) -> list[str]:
    return [sys.executable, str(ROOT / "run_worker.py"), "--specialty", SPECIALTY, "--base-model", "tiny-qwen2",
            "--device", "cpu", "--coordinator-url", url, "--worker-id", f"wan-{index}", "--results", str(results),
            "--state-dir", str(results.with_suffix(".state")), "--duration", str(s.duration),
            "--sync-interval", str(s.sync_interval), "--batch-size", "4", "--max-seq-len", "64",
            *codec]


def run_codec(name: str, s: Settings, scratch: Path) -> dict[str, Any]:
    """One flat federation over the emulated link with the workers pushing with codec ``name``."""
    paths = [scratch / f"{name}-{i}.jsonl" for i in range(s.workers)]
    with running_coordinator() as url:
        port = int(url.rsplit(":", 1)[1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: local_token(url)}  # the site cannot see this host's token file by URL
        with WanLink(("127.0.0.1", port), s.rate_mbit, s.rtt_ms) as link:
            started = time.monotonic()
            procs = [link.site.popen(worker_command(i, link.url, p, CODECS[name], s), cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for i, p in enumerate(paths)]
            try:
                errors = [p.communicate(timeout=s.duration + 300)[1] for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            wall = time.monotonic() - started
            ingress, egress = link.proxy.bytes_to_target, link.proxy.bytes_to_client
    failed = [(p.returncode, e) for p, e in zip(procs, errors) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{name}: worker exited {failed[0][0]}:\n{failed[0][1][-3000:]}")
    records = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
    return {"codec": name, **figures(records), "root_ingress_bytes": ingress, "root_egress_bytes": egress,
            "wall_seconds": round(wall, 1)}


def figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    syncs = [r for r in records if "sync_seconds" in r]
    pushed = [r["bytes_sent"] for r in syncs if "bytes_sent" in r]
    return {"syncs": len(syncs),
            "sync_seconds_median": round(statistics.median(r["sync_seconds"] for r in syncs), 3) if syncs else None,
            "push_bytes_median": int(statistics.median(pushed)) if pushed else None,
            "pull_bytes_total": sum(r.get("bytes_down", 0) for r in syncs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 workers, 30 s of training per codec")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = Settings(workers=2, duration=30, sync_interval=8) if args.quick else Settings(workers=3, duration=90, sync_interval=10)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedmoe-wan-", dir=SCRATCH_DIR) as scratch:
        for name in CODECS:
            log.info("%s: %d workers over %.0f Mbit/s, %.0f ms RTT", name, s.workers, s.rate_mbit, s.rtt_ms)
            rows.append(run_codec(name, s, Path(scratch)))
    keys = ["codec", "syncs", "sync_seconds_median", "push_bytes_median", "root_ingress_bytes", "root_egress_bytes"]
    print(format_table(keys, [[r[k] for k in keys] for r in rows]))
    write_json_atomic(RESULTS_DIR / "wan.json", {"settings": asdict(s), "quick": args.quick, "results": rows,
                                                 "note": "measured on a shared 2-core machine under heavy load"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
