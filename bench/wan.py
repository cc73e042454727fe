#!/usr/bin/env python3
"""WAN benchmark: flat federation against relay coordinators, over emulated WAN links.

``--sites`` emulated sites (``bench.wanemu``: a network namespace, a veth pair shaped with tbf, a
delay proxy) each hold ``--workers`` real ``run_worker.py`` processes training one expert on
tiny-qwen2; the root coordinator runs on this host's loopback, behind each site's 20 Mbit/s,
50 ms RTT link. Modes (``MODES``; the default runs flat, flat topk+int8, relays + topk+int8
upstream and relays+adaptive):

- ``flat``: every worker talks to the root over its site's link (uncompressed pushes); the root
  aggregates with FedBuff over K=3 (the group size), the fair baseline: flat fedasync applies each
  of 6 workers' deltas in full and oscillates (``flat fedasync``, kept for reference);
- ``flat topk+int8``: the same with the best fixed codec of the flat baseline (docs/wan.md);
- ``relays``: one relay per site runs *inside* the site (``run_coordinator.py --upstream``); the
  site's workers reach it on the namespace's loopback (fast), and only the relay crosses the WAN,
  forwarding one combined update per expert per ``--forward-interval`` (lossless);
- ``relays + topk+int8 upstream``: the same, the relay compressing the long link (error feedback);
- ``relays+adaptive``: that, with the workers on ``--compression auto --sync-budget 2``.

Reported per mode: root ingress and egress bytes (counted on the wire by the proxies, headers
included), syncs, and time to a target held-out loss. Held-out loss is measured after the run,
off the clock, on every version the root kept (weights pulled by version, evaluated on the
expert's held-out split); the target is the best loss ``flat`` reached (and, less noisy, 90% of flat's gain), and a mode's time
is from the expert's creation (version 0) to the first version at or below it (None: never in the run).

    python -m bench.wan --quick      # 2 sites x 3 workers, 40 s per mode (~10 min for 4 modes)
    python -m bench.wan              # 2 sites x 3 workers, 120 s per mode (~20 min)

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
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (RESULTS_DIR, SCRATCH_DIR, configure_logging, format_table, running_coordinator,
                          sample_suite, write_json_atomic)
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from protocol.client import CoordinatorClient
from protocol.credentials import TOKEN_ENV, local_token

log = logging.getLogger("bench.wan")
ROOT = Path(__file__).resolve().parents[1]
SPECIALTY = "sql_expert"
TOPK_INT8 = ["--compression", "topk+int8", "--compression-config", '{"ratio": 0.05}']


@dataclass(frozen=True)
class Mode:
    workers: list[str]
    """The workers' compression flags."""
    relays: list[str] | None = None
    """Flags of one relay per site (None: flat, workers talk to the root)."""
    needs: str | None = None
    """A run_worker.py --help text this mode needs (a flag built on another branch)."""
    root: dict[str, Any] = field(default_factory=dict)
    """The root's CoordinatorConfig settings (default: fedasync)."""


# Flat baselines aggregate with FedBuff over the group size (3): each root step is a sample-weighted
# mean of 3 workers' deltas, as a relay's forward is. Flat fedasync applies every delta in full and
# oscillated (an effective step ~6x with 6 workers: docs/wan.md), which would flatter the relays.
FLAT_FEDBUFF = {"aggregation": "fedbuff", "buffer_size": 3}
TOPK_UPSTREAM = ["--forward-compression", "topk+int8", "--forward-compression-config", '{"ratio": 0.05}']

MODES: dict[str, Mode] = {
    "flat": Mode(["--compression", "safetensors"], root=FLAT_FEDBUFF),
    "flat topk+int8": Mode(TOPK_INT8, root=FLAT_FEDBUFF),
    "flat fedasync": Mode(["--compression", "safetensors"]),
    "relays": Mode(["--compression", "safetensors"], relays=["--forward-compression", "safetensors"]),
    # lossless inside the site (a fast LAN), compressed with error feedback on the long link only
    "relays + topk+int8 upstream": Mode(["--compression", "safetensors"], relays=TOPK_UPSTREAM),
    # workers pick their codec per sync for --sync-budget (lossless on the site LAN, as it measures it);
    # the relays compress the long link
    "relays+adaptive": Mode(["--compression", "auto", "--sync-budget", "2"], relays=TOPK_UPSTREAM,
                            needs="--sync-budget"),
}
DEFAULT_MODES = ["flat", "flat topk+int8", "relays + topk+int8 upstream", "relays+adaptive"]


@dataclass(frozen=True)
class Settings:
    sites: int
    workers: int
    """run_worker.py processes per site."""
    duration: float
    """Seconds each worker trains."""
    sync_interval: float
    """Seconds between a worker's syncs (and a relay's forwards)."""
    rate_mbit: float = 20.0
    """Bandwidth of a site's link to the root, each way."""
    rtt_ms: float = 50.0
    """Round-trip time the delay proxy adds on that link."""
    heldout: int = 48
    """Held-out examples each kept version is evaluated on."""


@dataclass
class Run:
    procs: list[subprocess.Popen] = field(default_factory=list)
    relays: list[subprocess.Popen] = field(default_factory=list)


def worker_command(name: str, url: str, results: Path, flags: list[str], s: Settings) -> list[str]:
    return [sys.executable, str(ROOT / "run_worker.py"), "--specialty", SPECIALTY, "--base-model", "tiny-qwen2",
            "--device", "cpu", "--coordinator-url", url, "--worker-id", name, "--results", str(results),
            "--state-dir", str(results.with_suffix(".state")), "--duration", str(s.duration),
            "--sync-interval", str(s.sync_interval), "--batch-size", "4", "--max-seq-len", "64", *flags]


def start_relay(link: WanLink, index: int, flags: list[str], s: Settings, scratch: Path,
                env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A relay inside the site's namespace, upstream over the site's WAN link; its URL inside the site."""
    proc = link.site.popen([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                            "--data-dir", str(scratch / f"relay-{index}"), "--upstream", link.url,
                            "--relay-id", f"site-{index}", "--forward-interval", str(s.sync_interval),
                            "--rate-limit", "0", *flags],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].split()[0]
            threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()  # keep the pipe drained
            return proc, url
    raise RuntimeError(f"relay {index} exited before listening:\n{''.join(lines[-20:])}")


def run_mode(name: str, s: Settings, scratch: Path) -> dict[str, Any]:
    """One federation of ``s.sites`` x ``s.workers`` workers in mode ``name``; figures and the root's versions."""
    mode = MODES[name]
    paths = [scratch / f"{name}-{site}-{i}.jsonl".replace(" ", "_") for site in range(s.sites)
             for i in range(s.workers)]
    cpu_before = _cpu_seconds()
    with running_coordinator(keep_versions=1000, **mode.root) as url, ExitStack() as stack:
        port = int(url.rsplit(":", 1)[1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: local_token(url),  # the site cannot see this host's token file
               "FEDMOE_JOIN_TOKEN": local_token(url)}  # relays join with it (the admin may register relays)
        links = [stack.enter_context(WanLink(("127.0.0.1", port), s.rate_mbit, s.rtt_ms)) for _ in range(s.sites)]
        run = Run()
        started = time.monotonic()
        try:
            for site, link in enumerate(links):
                target = link.url
                if mode.relays is not None:
                    proc, target = start_relay(link, site, mode.relays, s, scratch / name.replace(" ", "_"), env)
                    run.relays.append(proc)
                for i in range(s.workers):
                    path = paths[site * s.workers + i]
                    run.procs.append(link.site.popen(worker_command(f"wan-{site}-{i}", target, path, mode.workers, s),
                                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                                     stderr=subprocess.PIPE, text=True))
            errors = [p.communicate(timeout=s.duration + 900)[1] for p in run.procs]  # start-up under load
            if run.relays:
                time.sleep(s.sync_interval + 2)  # the relays' last forward
        finally:
            for p in run.procs + run.relays:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall = time.monotonic() - started
        ingress = sum(link.proxy.bytes_to_target for link in links)
        egress = sum(link.proxy.bytes_to_client for link in links)
        versions = kept_versions(url)
    failed = [(p.returncode, e) for p, e in zip(run.procs, errors) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{name}: worker exited {failed[0][0]}:\n{failed[0][1][-3000:]}")
    records = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
    cpu = {k: round(v - cpu_before[k], 1) for k, v in _cpu_seconds().items()}
    return {"mode": name, "root": mode.root or {"aggregation": "fedasync"}, **figures(records),
            "root_ingress_bytes": ingress, "root_egress_bytes": egress, "wall_seconds": round(wall, 1),
            "cpu_seconds": cpu, "versions": versions}


def _cpu_seconds() -> dict[str, float]:
    """user+sys CPU seconds of this process (root coordinator, delay proxies) and of waited-for children."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"root_and_proxies": me.ru_utime + me.ru_stime, "workers_and_relays": kids.ru_utime + kids.ru_stime}


def kept_versions(url: str) -> list[dict[str, Any]]:
    """Every version the root kept: seconds since version 0 (the expert's creation: worker start-up on a
    loaded machine is not federation time), and its weights (held for evaluation)."""
    client = CoordinatorClient(url)
    out = []
    versions = client.expert(SPECIALTY)["versions"]
    for v in versions:
        if v["stored"]:
            weights = client.pull_weights(SPECIALTY, version=v["version"]).tensors
            out.append({"version": v["version"], "seconds": v["created_at"] - versions[0]["created_at"],
                        "weights": weights})
    return out


def figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    syncs = [r for r in records if "sync_seconds" in r]
    pushed = [r["bytes_sent"] for r in syncs if "bytes_sent" in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in syncs if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    choices: dict[str, int] = {}
    for r in syncs:
        if "codec" in r:
            choices[r["codec"]] = choices.get(r["codec"], 0) + 1
    return {"syncs": len(syncs), "push_seconds_median": median("push_seconds"),
            "pull_seconds_median": median("pull_seconds"), "train_seconds_median": median("train_seconds"),
            "blocked_seconds_median": median("blocked_seconds"),
            "steps_total": sum(r.get("steps", 0) for r in syncs), "codecs": choices,
            "sync_seconds_median": round(statistics.median(r["sync_seconds"] for r in syncs), 3) if syncs else None,
            "push_bytes_median": int(statistics.median(pushed)) if pushed else None,
            "pull_bytes_total": sum(r.get("bytes_down", 0) for r in syncs)}


def evaluate(rows: list[dict[str, Any]], s: Settings) -> None:
    """Held-out loss of every kept version (off the clock), then each mode's time to the target."""
    from worker.models import load_base_model
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    domain = next(d for d in sample_suite().domains if d.name == SPECIALTY)
    heldout = list(domain.heldout[:s.heldout])
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(), TrainSettings(batch_size=4, max_seq_len=64),
                          list(domain.train))
    for row in rows:
        for v in row["versions"]:
            trainer.load_adapter_state(v.pop("weights"))
            v["heldout_loss"] = round(trainer.eval_loss(heldout, batch_size=8), 4)
        losses = [v["heldout_loss"] for v in row["versions"]]
        row["heldout_start"], row["heldout_best"] = (losses[0], min(losses)) if losses else (None, None)
    flat = next(r for r in rows if r["mode"] == "flat")
    target = flat["heldout_best"]
    # the held-out curves are noisy (tiny model, 48 examples) and flat's best is often its last version, so
    # also the time to 90% of flat's gain from the start, a target every mode's curve crosses in the run
    target90 = round(flat["heldout_start"] - 0.9 * (flat["heldout_start"] - target), 4)
    for row in rows:
        hit = [v["seconds"] for v in row["versions"] if v["heldout_loss"] <= target]
        hit90 = [v["seconds"] for v in row["versions"] if v["heldout_loss"] <= target90]
        row["target_loss"], row["time_to_target_s"] = target, (round(hit[0], 1) if hit else None)
        row["target90_loss"], row["time_to_target90_s"] = target90, (round(hit90[0], 1) if hit90 else None)


def available(mode: Mode) -> bool:
    if mode.needs is None:
        return True
    help_text = subprocess.run([sys.executable, str(ROOT / "run_worker.py"), "--help"], capture_output=True,
                               text=True, cwd=ROOT).stdout
    return mode.needs in help_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 s of training per mode")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma list of modes of {list(MODES)} (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or "flat" not in names:
        print(f"error: --modes must include flat and name only {list(MODES)}, got {names}", file=sys.stderr)
        return 2
    s = Settings(sites=2, workers=3, duration=40, sync_interval=8) if args.quick else \
        Settings(sites=2, workers=3, duration=120, sync_interval=10)
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="fedmoe-wan-", dir=SCRATCH_DIR) as scratch:
        for name in names:
            if not available(MODES[name]):
                skipped[name] = f"run_worker.py has no --compression {MODES[name].needs} on this branch"
                log.warning("%s: skipped (%s)", name, skipped[name])
                continue
            log.info("%s: %d sites x %d workers over %.0f Mbit/s, %.0f ms RTT", name, s.sites, s.workers,
                     s.rate_mbit, s.rtt_ms)
            rows.append(run_mode(name, s, Path(scratch)))
    evaluate(rows, s)
    base = next(r for r in rows if r["mode"] == "flat")
    for r in rows:
        r["ingress_vs_flat"] = round(base["root_ingress_bytes"] / max(1, r["root_ingress_bytes"]), 2)
        for key in ("time_to_target_s", "time_to_target90_s"):
            hit, flat_hit = r[key], base[key]
            r[key.replace("time_to", "speedup")] = round(flat_hit / hit, 2) if hit and flat_hit else None
    keys = ["mode", "syncs", "root_ingress_bytes", "ingress_vs_flat", "root_egress_bytes", "heldout_best",
            "time_to_target_s", "speedup_target_s", "time_to_target90_s", "speedup_target90_s", "push_seconds_median",
            "blocked_seconds_median", "train_seconds_median"]
    print(format_table(keys, [[r[k] for k in keys] for r in rows]))
    write_json_atomic(RESULTS_DIR / "wan.json", {"settings": asdict(s), "quick": args.quick, "results": rows,
                                                 "skipped": skipped,
                                                 "note": "measured on a shared 2-core machine under heavy load"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
