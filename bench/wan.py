#!/usr/bin/env python3
"""WAN benchmark: flat federation and Flower against relay coordinators, over emulated WAN links (docs/wan.md).

Emulated sites (``bench.wanemu``: a network namespace, a veth pair shaped with tbf, a delay proxy; two by
default, ``--sites``) each hold real ``run_worker.py`` processes (three, ``--workers``) training one expert; the
root coordinator runs on this host's loopback, behind each site's 20 Mbit/s, 50 ms RTT link. The link is the site's:
its workers (or its relay) share the one veth pair and its tbf, as they would share a site's uplink.

Issue 35's baselines, the smollm2-135m defaults: ``flat defaults sync N s`` (a user's defaults, overlap on, the
coordinator's default aggregation, N swept over 3/10/30), ``flat randomk+terngrad defaults sync N s`` (the best fixed
codec), ``flower fedavg N steps/round`` (Flower's deployment engine, bench/wan_flower.py), against ``relays+adaptive
(int8 both ways; site model)`` and its self-formed twin (no relay placed by hand: issue 35 item 2); the ``hetero``
modes are item 3's mixed fleet. Older modes, kept to rerun the history's figures (docs/history/wan.md):

- ``flat``: every worker talks to the root over its site's link (uncompressed pushes); the root
  aggregates with FedBuff over K=3 (the group size), the fair baseline: flat fedasync applies each
  of 6 workers' deltas in full and oscillates (``flat fedasync``, kept for reference);
- ``flat topk+int8``: the same with the best fixed codec of the flat baseline (docs/history/wan.md);
- ``relays``: one relay per site runs *inside* the site (``run_coordinator.py --upstream``); the
  site's workers reach it on the namespace's loopback (fast), and only the relay crosses the WAN,
  forwarding one combined update per expert per ``--forward-interval`` (lossless);
- ``relays + topk+int8 upstream``: the same, the relay compressing the long link (error feedback);
- ``relays+adaptive``: that, with the workers on ``--compression auto --sync-budget 2``;
- on smollm2-135m: ``flat randomk+terngrad`` (the best fixed codec measured on that model: random-k
  10% + TernGrad, unbiased, no error feedback, each worker its own selection seed), and
  ``relays+adaptive (int8 upstream)`` (the relays' long link in int8 with error feedback, +0.00% on
  smollm2-135m in docs/benchmarks.md, where top-k + int8 kept ~10% of the gain);
- ``relays+adaptive (int8 both ways; site model)``: the relays also fetch root versions as int8 diffs and serve
  their site's model (``--site-model``: the root's version plus the site's updates not yet in it; a batch is the
  site's summed progress), and the root averages the two sites' batches (FedBuff K=2), hierarchical FL's
  edge/cloud rounds: the smollm2 default for relays + adaptive (docs/history/wan.md).

Two regimes. tiny-qwen2 (``--quick``, and the default) is compute-bound: a 150 KB update is ~8% of
a sync. ``--base-model smollm2-135m`` is built to be link-bound: a 9.8 MB LoRA update (rank 8, all
seven projections), batch 1 of 32 tokens, one torch thread per worker, a sync after every step
(``--sync-interval 1``) and ``--no-overlap`` (training waits for its sync, so a slow link costs
training time instead of being hidden behind it; with overlap on 2 shared cores the workers keep the
CPU busy in every mode and the link only changes how stale the updates are). One step is ~0.5 CPU s,
while three workers' pushes and pulls of 9.8 MB each over a 2.5 MB/s site link take ~24 s.
Reported per mode: root ingress and egress bytes (counted on the wire by the proxies, headers
included), syncs, and time to a target held-out loss. Held-out loss is measured after the run,
off the clock, on every version the root kept (weights pulled by version, evaluated on the
expert's held-out split); the target is the best loss ``flat`` reached (and, less noisy, 90% of flat's gain), and a mode's time
is from the expert's creation (version 0) to the first version at or below it (None: never in the run).

    python -m bench.wan --quick      # 2 sites x 3 workers, 40 s per mode (~10 min for 4 modes)
    python -m bench.wan              # 2 sites x 3 workers, 120 s per mode (~20 min)
    python -m bench.wan --base-model smollm2-135m   # link-bound, 150 s per mode (~30 min for 4 modes)

Needs root (network namespaces). Table on stdout, progress on stderr, results in bench/results/wan.json
(``--quick``: wan_quick.json).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import (SCRATCH_DIR, format_table, pulled_tensors, recorded_token, running_coordinator,
                          write_json_atomic)
from bench.harness import Bench
from bench.harness import Run as BenchRun
from bench.wan_eval import evaluate, first_reaching, summarise
from bench.wan_flower import FlowerRun, FlowerUnavailable, check_flower, run_flower
from bench.wan_setup import (PRESETS, ROOT, SCENARIOS, SPECIALTY, CpuCapUnavailable, Settings, check_cpu_cap,
                             cpu_capped, link_seconds, write_shards)
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from coordinator.aggregation.base import staleness_weight
from protocol.cli import comma_list, option
from protocol.client import CoordinatorClient
from protocol.credentials import TOKEN_ENV

log = logging.getLogger("bench.wan")
__all__ = ["CpuCapUnavailable", "PRESETS", "cpu_capped", "first_reaching"]  # bench.wan's names, as before the split
FULL_PULLS = ["--pull-compression", "full"]
"""Full-weight pulls, as every fixed-codec mode measured them (int8 diff pulls became the default on 2026-11-29)."""
TOPK_INT8 = ["--compression", "topk+int8", "--compression-config", '{"ratio": 0.05}', *FULL_PULLS]
SEED = "@SEED@"
"""Replaced in a mode's worker flags by a seed of the worker's own (a hash of its id)."""
RANDOMK_TERNGRAD = ["--compression", "randomk+terngrad", "--no-error-feedback", "--compression-config",
                    '{"randomk": {"ratio": 0.1, "rescale": true, "seed": @SEED@}, "terngrad": {"seed": @SEED@}}',
                    *FULL_PULLS]
LOSSLESS = ["--compression", "safetensors", *FULL_PULLS]
"""fp32 both ways (the workers' defaults until 2026-11-29)."""


@dataclass(frozen=True)
class Mode:
    workers: list[str]
    """The workers' compression flags."""
    relays: list[str] | None = None
    """Flags of one relay per site (None: flat, workers talk to the root)."""
    self_formed: list[str] | None = None
    """No relay placed by hand: every worker follows the root's placement, each site's first worker is started with
    --can-relay and these flags for its relay (issue 35 item 2); None: not this kind of mode."""
    needs: str | None = None
    """A run_worker.py --help text this mode needs (a flag built on another branch)."""
    root: dict[str, Any] = field(default_factory=dict)
    """The root's CoordinatorConfig settings (empty: the coordinator's defaults)."""
    sync_interval: float | None = None
    """The workers' --sync-interval (None: the preset's)."""
    overlap: bool | None = None
    """True: the worker's default, sync overlapped with training (None: the preset's)."""
    scenario: str | None = None
    """A fleet of bench.wan_setup.SCENARIOS (its sites, links and worker speeds) instead of the preset's."""
    flower_steps: int | None = None
    """Flower's FedAvg through its deployment engine at this many local steps per round (bench.wan_flower)
    instead of FedMoE workers."""

    @property
    def baseline(self) -> bool:
        """A baseline the relays are measured against: every mode without relays."""
        return self.relays is None and self.self_formed is None


# Flat baselines aggregate with FedBuff over the group size (3): each root step is a sample-weighted
# mean of 3 workers' deltas, as a relay's forward is. Flat fedasync applies every delta in full and
# oscillated (an effective step ~6x with 6 workers: docs/history/wan.md), which would flatter the relays.
FLAT_FEDBUFF = {"aggregation": "fedbuff", "buffer_size": 3}
PER_SITE = "sites"
"""A relay mode's root ``buffer_size``: one batch from each site (the run's ``--sites``) per root step."""
SITES_FEDBUFF = {"aggregation": "fedbuff", "buffer_size": PER_SITE}
TOPK_UPSTREAM = ["--forward-compression", "topk+int8", "--forward-compression-config", '{"ratio": 0.05}']
AUTO = ["--compression", "auto", "--sync-budget", "2"]
INT8_BOTH_WAYS = ["--forward-compression", "int8", "--upstream-pull-compression", "int8"]
"""Relay flags: int8 with error feedback on the long link, and new root versions fetched as int8 diffs."""

MODES: dict[str, Mode] = {
    "flat": Mode(LOSSLESS, root=FLAT_FEDBUFF),
    "flat topk+int8": Mode(TOPK_INT8, root=FLAT_FEDBUFF),
    "flat fedasync": Mode(LOSSLESS),
    "relays": Mode(LOSSLESS, relays=["--forward-compression", "safetensors"]),
    # lossless inside the site (a fast LAN), compressed with error feedback on the long link only
    "relays + topk+int8 upstream": Mode(LOSSLESS, relays=TOPK_UPSTREAM),
    # workers pick their codec per sync for --sync-budget (lossless on the site LAN, as it measures it);
    # the relays compress the long link
    "relays+adaptive": Mode(AUTO, relays=TOPK_UPSTREAM, needs="--sync-budget"),
    # smollm2-135m: random-k 10% + TernGrad matched fp32 within 0.15% at 143x there, top-k + int8 kept ~10%
    # of the gain (docs/benchmarks.md), so that is its best fixed codec, and the relays' lossy codec is int8
    "flat randomk+terngrad": Mode(RANDOMK_TERNGRAD, root=FLAT_FEDBUFF),
    "relays+adaptive (int8 upstream)": Mode(AUTO, relays=["--forward-compression", "int8"], needs="--sync-budget"),
    # the relays also fetch new root versions as int8 diffs (a full fetch every 10th): ~1 s of the site's downlink
    # per version instead of ~4 s, so the weights its workers train on are fresher (docs/history/wan.md)
    "relays+adaptive (int8 both ways)": Mode(AUTO, relays=INT8_BOTH_WAYS, needs="--sync-budget"),
    # both ways, FedBuff K=2 at the root with server lr 2: each root step both sites' batches added (FedAsync's
    # step size), one version per pair of batches instead of one per batch (docs/history/wan.md, "What bounds")
    "relays+adaptive (int8 both ways; fedbuff root x2)": Mode(
        AUTO, relays=INT8_BOTH_WAYS, needs="--sync-budget",
        root={**SITES_FEDBUFF, "server_lr": 2.0}),
    # each relay serves its site's model (the root's version plus the site's updates not yet in it) and forwards the
    # sum of its workers' weighted deltas, the site's progress (coordinator/relay/site.py); the root averages the two
    # sites' batches (FedBuff K=2), hierarchical FL's cloud round (docs/history/wan.md)
    "relays+adaptive (int8 both ways; site model)": Mode(
        AUTO, relays=[*INT8_BOTH_WAYS, "--site-model"], needs="--sync-budget",
        root=SITES_FEDBUFF),
    "relays+adaptive (int8 both ways; site model; fedasync root)": Mode(
        AUTO, relays=[*INT8_BOTH_WAYS, "--site-model"], needs="--sync-budget"),
    # the same with FedBuff at the root over the two relays' batches (each root step the mean of both), against
    # the FedAsync root's oscillation when the relays forward often (docs/history/wan.md, tenth run)
    "relays+adaptive (int8 upstream; fedbuff root)": Mode(AUTO, relays=["--forward-compression", "int8"],
                                                          needs="--sync-budget",
                                                          root=SITES_FEDBUFF),
}

# Issue 35's baselines, as a user would run them: the worker's defaults (sync overlapped with training, i.e. no
# --no-overlap) and the coordinator's (no root settings: FedAsync mixing each update in at 1 / the workers alive on
# the expert, with its staleness weight), at three sync intervals around the worker's default of 10 s; the best
# fixed codec of this model at each; Flower's FedAvg through its deployment engine at three round lengths (local
# optimiser steps per round; FlowerTune's LLM recipes train a fixed number of local steps a round)
SWEEP_INTERVALS = (3, 10, 30)
FLOWER_STEPS = (3, 10, 30)
for _interval in SWEEP_INTERVALS:
    # the worker's own defaults: int8 pushes with error feedback, int8 diff pulls (since 2026-11-29), overlap on
    MODES[f"flat defaults sync {_interval}s"] = Mode([], sync_interval=_interval, overlap=True)
    # fp32 both ways: the worker's defaults before 2026-11-29 (bench/results/history: the first baseline runs)
    MODES[f"flat fp32 sync {_interval}s"] = Mode(LOSSLESS, sync_interval=_interval, overlap=True)
    MODES[f"flat randomk+terngrad defaults sync {_interval}s"] = Mode(RANDOMK_TERNGRAD, sync_interval=_interval,
                                                                       overlap=True)
for _steps in FLOWER_STEPS:
    MODES[f"flower fedavg {_steps} steps/round"] = Mode([], flower_steps=_steps)

# issue 35 item 3: three workers of speeds 1, 0.5, 0.25 on fast, 20 and 5 Mbit/s links (bench.wan_setup.SCENARIOS),
# each pacing itself (--compression auto sizes each push to --sync-budget, --comm-share stretches its interval so its
# link takes at most a quarter of its time), FedAsync at the root weighing staleness; against the same three at full
# speed on equal links, and against Flower's FedAvg on the same mix (each round waits for the slowest)
PACED = [*AUTO, "--comm-share", "0.25"]
MODES["hetero fedmoe paced"] = Mode(PACED, scenario="hetero", sync_interval=2, overlap=True, needs="--comm-share")
MODES["homogeneous fedmoe paced"] = Mode(PACED, scenario="homogeneous", sync_interval=2, overlap=True,
                                         needs="--comm-share")
MODES["hetero flower fedavg 10 steps/round"] = Mode([], scenario="hetero", flower_steps=10)
# issue 35 item 2: the hand-placed site-model relays' settings, with no relay placed by hand
MODES["relays+adaptive self-formed (int8 both ways; site model)"] = Mode(
    AUTO, self_formed=[*INT8_BOTH_WAYS, "--site-model"], needs="--follow-placement",
    root=SITES_FEDBUFF)
# the site-model relays as a user would run them: sync overlapped with training (the worker's default; the preset's
# --no-overlap was tuned when the link, not the CPU, bounded a step) every 3 s on the site's fast LAN
MODES["relays+adaptive (int8 both ways; site model; overlap)"] = Mode(
    AUTO, relays=[*INT8_BOTH_WAYS, "--site-model"], needs="--sync-budget", root=SITES_FEDBUFF, sync_interval=3,
    overlap=True)
HETERO_MODES = ["homogeneous fedmoe paced", "hetero fedmoe paced", "hetero flower fedavg 10 steps/round"]

DEFAULT_MODES = {"tiny-qwen2": ["flat", "flat topk+int8", "relays + topk+int8 upstream", "relays+adaptive"],
                 "smollm2-135m": [*(f"flat defaults sync {i}s" for i in SWEEP_INTERVALS),
                                  "flat randomk+terngrad defaults sync 10s",
                                  *(f"flower fedavg {n} steps/round" for n in FLOWER_STEPS),
                                  "relays+adaptive (int8 both ways; site model; overlap)"]}


@dataclass
class Run:
    procs: list[subprocess.Popen] = field(default_factory=list)
    relays: list[subprocess.Popen] = field(default_factory=list)


def mode_settings(mode: Mode, s: Settings) -> Settings:
    """The preset with the mode's own sync interval, overlap and fleet."""
    s = replace(s, **SCENARIOS[mode.scenario]) if mode.scenario else s
    return replace(s, sync_interval=s.sync_interval if mode.sync_interval is None else mode.sync_interval,
                   overlap=s.overlap if mode.overlap is None else mode.overlap)


def root_settings(mode: Mode, s: Settings) -> dict[str, Any]:
    """The mode's root settings for this run: a per-site buffer is as large as the run has sites."""
    return {k: s.sites if v == PER_SITE else v for k, v in mode.root.items()}


def worker_command(name: str, url: str, results: Path, flags: list[str], s: Settings,
                   dataset: Path | None = None) -> list[str]:
    """A run_worker.py command line; ``dataset`` its own shard (None: the expert's sample data, all of it)."""
    seed = str(zlib.crc32(name.encode()) or 1)  # a codec seed of 0 means "unseeded"
    extra = ([] if s.threads is None else ["--threads", str(s.threads)]) + ([] if s.overlap else ["--no-overlap"])
    extra += ([] if s.lr is None else ["--lr", str(s.lr)]) + ([] if dataset is None else ["--dataset", str(dataset)])
    # --seed: each worker its own order over the examples, as workers with data of their own would see; with
    # one seed for all, the six workers took the same example at each step (their mean was one example's step)
    return [sys.executable, str(ROOT / "run_worker.py"), "--specialty", SPECIALTY, "--base-model", s.base_model,
            "--device", "cpu", "--coordinator-url", url, "--worker-id", name, "--seed", seed, "--results", str(results),
            "--state-dir", str(results.with_suffix(".state")), "--duration", str(s.duration),
            "--sync-interval", str(s.sync_interval), "--batch-size", str(s.batch_size),
            "--max-seq-len", str(s.max_seq_len), "--no-heldout-eval", *extra,
            *[flag.replace(SEED, seed) for flag in flags]]


def self_formed_flags(mode: Mode, index: int, s: Settings) -> list[str]:
    """A self-formed mode's placement flags for worker ``index`` of its site: all follow the root's placement (every
    5 s, to form fast in a short run), the site's first also runs a relay (the only hint: which machines may)."""
    if mode.self_formed is None:
        return []
    flags = ["--follow-placement", "--placement-interval", "5"]
    if index == 0:
        relay = [*mode.self_formed, "--forward-interval", str(forward_interval(s)), "--rate-limit", "0"]
        flags += ["--can-relay", "--relay-flags", " ".join(relay)]
    return flags


def start_relay(link: WanLink, index: int, flags: list[str], s: Settings, scratch: Path,
                env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A relay inside the site's namespace, upstream over the site's WAN link; its URL inside the site."""
    proc = link.site.popen([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                            "--data-dir", str(scratch / f"relay-{index}"), "--upstream", link.url,
                            "--relay-id", f"site-{index}", "--forward-interval", str(forward_interval(s)),
                            "--rate-limit", "0", *flags],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].split()[0]
            threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()  # keep the pipe drained
            return proc, url
    raise RuntimeError(f"relay {index} exited before listening:\n{''.join(lines[-20:])}")


def forward_interval(s: Settings) -> float:
    return s.sync_interval if s.forward_interval is None else s.forward_interval


def run_mode(name: str, s: Settings, scratch: Path, keep: Path, shards: list[Path] | None = None) -> dict[str, Any]:
    """One run of mode ``name`` (``s.sites`` x ``s.workers`` workers, worker k on ``shards[k]`` if given): figures,
    and the versions the root kept (Flower: its rounds), their weights saved in ``keep``."""
    mode = MODES[name]
    scratch.mkdir(parents=True, exist_ok=True)
    s = mode_settings(mode, s)
    shards = shards and shards[:s.worker_count]
    if mode.flower_steps is not None:
        if not shards:
            raise ValueError("Flower's clients train on shards: pass them")
        return {**run_flower(name, FlowerRun(mode.flower_steps), s, scratch, shards, keep), "baseline": True}
    paths = [scratch / f"{name}-{site}-{i}.jsonl".replace(" ", "_").replace(",", "") for site in range(s.sites)
             for i in range(s.workers)]
    cpu_before = _cpu_seconds()
    root = root_settings(mode, s)
    with running_coordinator(keep_versions=1000, **root) as url, ExitStack() as stack:
        # (exits in reverse: the workers' cgroups are removed after the finally below has reaped them)
        port = int(url.rsplit(":", 1)[1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: recorded_token(url),  # the site cannot see this host's token file
               "FEDMOE_JOIN_TOKEN": recorded_token(url),  # relays join with it (the admin may register relays)
               "FEDMOE_RELAY_JOIN_TOKEN": recorded_token(url)}  # --can-relay workers' relays register with it
        links = [stack.enter_context(WanLink(("127.0.0.1", port), *s.site_link(i))) for i in range(s.sites)]
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
                    flags = mode.workers + self_formed_flags(mode, i, s)
                    with path.with_suffix(".log").open("w") as log_file:  # a file: 6 pipes read in turn could fill
                        run.procs.append(link.site.popen(
                            worker_command(f"wan-{site}-{i}", target, path, flags, s,
                                           shards[site * s.workers + i] if shards else None), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log_file))
                    share = s.worker_share(site * s.workers + i)
                    if share is not None:  # before it loads torch: every thread it starts stays capped
                        stack.enter_context(cpu_capped(f"{site}-{i}", share))(run.procs[-1].pid)
            deadline = time.monotonic() + s.duration + 900  # start-up under load
            for p in run.procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if run.relays:  # the relays' last forward, and its transfer
                time.sleep(forward_interval(s) + 2 + 3 * link_seconds(versions_bytes(url), s))
        finally:
            for p in run.procs + run.relays:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        wall = time.monotonic() - started
        ingress = sum(link.proxy.bytes_to_target for link in links)
        egress = sum(link.proxy.bytes_to_client for link in links)
        versions = kept_versions(url, keep)
        relay_reports = relay_counters(url) if run.relays else []
        shares = contributions(url, mode.root.get("staleness_decay", 0.1)) if mode.relays is None else None
    failed = [(p.returncode, path) for p, path in zip(run.procs, paths) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{name}: worker exited {failed[0][0]}:\n"
                           f"{failed[0][1].with_suffix('.log').read_text()[-3000:]}")
    records = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
    t0 = versions[0]["created_at"] if versions else min((r["time"] for r in records), default=0.0)
    cpu = {k: round(v - cpu_before[k], 1) for k, v in _cpu_seconds().items()}
    capacity = s.link_capacity(wall)  # bytes the site links could carry each way in the run
    return {"mode": name, "engine": "fedmoe", "baseline": mode.baseline, "sync_interval": s.sync_interval,
            "overlap": s.overlap, "root": root or {"aggregation": "the coordinator's default"},
            **figures(records, s.worker_count),
            "root_ingress_bytes": ingress, "root_egress_bytes": egress, "wall_seconds": round(wall, 1),
            "link_busy_up": round(ingress / capacity, 3), "link_busy_down": round(egress / capacity, 3),
            "cpu_seconds": cpu, "relays": relay_reports, "contributions": shares,
            "step_clock": step_clock(records, t0, s.worker_count), "versions": versions}


def step_clock(records: list[dict[str, Any]], t0: float, workers: int) -> list[list[float]]:
    """[seconds since the expert's creation, optimiser steps per worker so far] at each sync: a target reached at
    time t took the steps trained by then (bench.wan_eval.steps_at)."""
    total, out = 0, []
    for r in sorted((r for r in records if r.get("steps")), key=lambda r: r["time"]):
        total += r["steps"]
        out.append([round(r["time"] - t0, 1), round(total / workers, 1)])
    return out


def contributions(url: str, staleness_decay: float) -> dict[str, dict[str, Any]]:
    """Per worker, from the root's audit log: updates applied, their staleness (versions behind when applied), and
    its share of the expert's steps, each update weighted as FedAsync weighed it: the alpha and staleness grace its
    version's event records (coordinator/aggregation/fedasync.py; an event without them: alpha 1, no grace) times
    ``staleness_weight``. A flat mode's update ids start with the worker id (worker/federation.py)."""
    client = CoordinatorClient(url)
    try:
        events = client.events("version_applied", limit=500)
    finally:
        client.close()
    per: dict[str, dict[str, Any]] = {}
    for event in events:
        alpha, grace = event["detail"].get("alpha", 1.0), event["detail"].get("staleness_grace", 0)
        for update_id, tau in zip(event["detail"]["update_ids"], event["detail"]["staleness"]):
            worker = update_id.rsplit("-", 1)[0]
            row = per.setdefault(worker, {"updates": 0, "staleness": [], "weight": 0.0})
            row["updates"] += 1
            row["staleness"].append(tau)
            row["weight"] += alpha * staleness_weight(tau, staleness_decay, grace)
    total = sum(r["weight"] for r in per.values()) or 1.0
    return {w: {"updates": r["updates"], "staleness_median": statistics.median(r["staleness"]),
                "staleness_max": max(r["staleness"]), "share": round(r["weight"] / total, 3)}
            for w, r in sorted(per.items())}


def relay_counters(url: str) -> list[dict[str, Any]]:
    """Each relay's last report at the root (bytes received, forwarded, served, of which diffs, fetched; batches)."""
    client = CoordinatorClient(url)
    try:
        return [{k: r.get(k) for k in ("relay_id", "stats", "bytes_saved")} for r in client.placement.relays()]
    finally:
        client.close()


def relay_pulls(row: dict[str, Any]) -> dict[str, int] | None:
    """Where the workers' pulled bytes came from in a relay mode: the relays' caches (full weights, diffs built
    there) or passed through to the root (what the workers pulled beyond what the relays served; diff pulls were
    passed through before the relays built them). None in a flat mode."""
    if not row["relays"]:
        return None
    stats = [r["stats"] or {} for r in row["relays"]]
    served = sum(s.get("bytes_served", 0) for s in stats)
    diffs = sum(s.get("diff_bytes_served", 0) for s in stats)
    return {"served_full": served - diffs, "served_diffs": diffs, "passed_through": max(0, row["pull_bytes_total"] - served),
            "diffs_unavailable": sum(s.get("diffs_unavailable", 0) for s in stats)}


def versions_bytes(url: str) -> int:
    """Size of the expert's full weights at the root (0 before it exists)."""
    client = CoordinatorClient(url)
    try:
        return sum(t.numel() * t.element_size() for t in pulled_tensors(client.experts.pull(SPECIALTY)).values())
    except Exception:  # noqa: BLE001 - only sizes a wait
        return 0
    finally:
        client.close()


def _cpu_seconds() -> dict[str, float]:
    """user+sys CPU seconds of this process (root coordinator, delay proxies) and of waited-for children."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"root_and_proxies": me.ru_utime + me.ru_stime, "workers_and_relays": kids.ru_utime + kids.ru_stime}


def kept_versions(url: str, directory: Path) -> list[dict[str, Any]]:
    """Every version the root kept: seconds since version 0 (the expert's creation: worker start-up on a
    loaded machine is not federation time), and the file its weights were saved to in ``directory`` (on disk:
    three runs of eight modes keep ~10 GB of a 9.8 MB adapter's versions until they are scored)."""
    from safetensors.torch import save_file

    client = CoordinatorClient(url)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    versions = client.experts.get(SPECIALTY)["versions"]
    for v in versions:
        if v["stored"]:
            path = directory / f"version-{v['version']:05d}.safetensors"
            save_file(pulled_tensors(client.experts.pull(SPECIALTY, version=v["version"])), str(path))
            out.append({"version": v["version"], "seconds": v["created_at"] - versions[0]["created_at"],
                        "created_at": v["created_at"], "file": str(path)})
    return out


def figures(records: list[dict[str, Any]], workers: int = 1) -> dict[str, Any]:
    syncs = [r for r in records if "sync_seconds" in r]
    pushed = [r["bytes_sent"] for r in syncs if "bytes_sent" in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in syncs if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    choices: dict[str, int] = {}
    pulls: dict[str, int] = {}  # each pull's codec: a diff's, "full", or "none" (nothing new: a 304)
    for r in syncs:
        if "codec" in r:
            choices[r["codec"]] = choices.get(r["codec"], 0) + 1
        if "pull_seconds" in r:
            kind = r.get("pull_codec") or ("full" if r.get("bytes_down") else "none")
            pulls[kind] = pulls.get(kind, 0) + 1
    return {"syncs": len(syncs), "push_seconds_median": median("push_seconds"),
            "pull_seconds_median": median("pull_seconds"), "train_seconds_median": median("train_seconds"),
            "blocked_seconds_median": median("blocked_seconds"),
            "checkpoint_seconds_median": median("checkpoint_seconds"),
            "steps_total": sum(r.get("steps", 0) for r in syncs), "codecs": choices, "pull_codecs": pulls,
            "steps_per_worker": round(sum(r.get("steps", 0) for r in syncs) / workers, 1),
            "sync_seconds_median": round(statistics.median(r["sync_seconds"] for r in syncs), 3) if syncs else None,
            "push_bytes_median": int(statistics.median(pushed)) if pushed else None,
            "pull_bytes_total": sum(r.get("bytes_down", 0) for r in syncs)}


def available(mode: Mode) -> bool:
    if mode.needs is None:
        return True
    help_text = subprocess.run([sys.executable, str(ROOT / "run_worker.py"), "--help"], capture_output=True,
                               text=True, cwd=ROOT).stdout
    return mode.needs in help_text


@dataclass(frozen=True)
class Options:
    """The command line: a preset (--quick, or --base-model's) and what is changed of it."""

    base_model: str = option("tiny-qwen2", "the workers' model and its preset (smollm2-135m: the link-bound regime)",
                             choices=["tiny-qwen2", "smollm2-135m"])
    modes: tuple[str, ...] | None = option(None, f"comma list of modes of {list(MODES)} (default: the model's, "
                                           f"{DEFAULT_MODES})", parse=comma_list)
    duration: float | None = option(None, "seconds each worker trains (default: the preset's)", type=float)
    worker_cpu: float | None = option(None, "cap each worker at this fraction of one core in every mode (a cgroup cpu "
                                      "quota), as if each ran on a machine of its own; e.g. 0.25 (default: no cap)",
                                      type=float, metavar="CORES")
    forward_interval: float | None = option(None, "seconds between a relay's forwards upstream (default: the "
                                            "preset's)", type=float, metavar="SECONDS")
    sites: int | None = option(None, "emulated sites (default: the preset's, 2)", type=int)
    workers: int | None = option(None, "workers per site (default: the preset's, 3; a smollm2 worker takes ~1-2 GB "
                                 "here)", type=int)
    runs: int = option(1, "runs of every mode (issue 35 measures 3: median, range)", type=int)
    preset: str | None = None
    """The preset's name (None: --base-model's; --quick: "quick", tiny-qwen2 with 40 s of training per mode)."""

    def __post_init__(self) -> None:
        if self.preset == "quick" and self.base_model != "tiny-qwen2":
            raise ValueError("--quick is the tiny-qwen2 preset; drop --quick or --base-model")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be positive, got {self.duration}")
        if self.forward_interval is not None and not 0.05 <= self.forward_interval <= 3600:
            raise ValueError(f"--forward-interval must be 0.05-3600 seconds, got {self.forward_interval}")
        if self.worker_cpu is not None and not 0.01 <= self.worker_cpu <= (os.cpu_count() or 1):
            raise ValueError(f"--worker-cpu must be between 0.01 and {os.cpu_count()} cores, got {self.worker_cpu}")
        names = list(self.mode_names())
        if [m for m in names if m not in MODES] or not any(MODES[m].baseline for m in names):
            raise ValueError(f"--modes must include a baseline (a mode without relays) and name only {list(MODES)}, "
                             f"got {names}")
        for flag, value in (("--sites", self.sites), ("--workers", self.workers)):
            if value is not None and not 1 <= value <= 8:
                raise ValueError(f"{flag} must be 1-8, got {value}")
        if not 1 <= self.runs <= 20:
            raise ValueError(f"--runs must be 1-20, got {self.runs}")

    def mode_names(self) -> tuple[str, ...]:
        return self.modes or tuple(DEFAULT_MODES[self.base_model])

    def job(self) -> Settings:
        s = PRESETS[self.preset or self.base_model]
        changes: dict[str, Any] = {"duration": self.duration, "forward_interval": self.forward_interval,
                                   "worker_cpu": self.worker_cpu, "sites": self.sites, "workers": self.workers}
        return replace(s, **{k: v for k, v in changes.items() if v is not None})


def run(o: Options, ctx: BenchRun) -> int:
    s, names = o.job(), list(o.mode_names())
    try:
        check_available()
        if s.worker_cpu is not None or any(MODES[m].flower_steps is not None for m in names):
            check_cpu_cap()  # Flower's processes are tracked in cgroups, capped or not
        if any(MODES[m].flower_steps is not None for m in names):
            check_flower()
    except (NamespaceUnavailable, CpuCapUnavailable, FlowerUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedmoe-wan-", dir=SCRATCH_DIR) as scratch, \
            tempfile.TemporaryDirectory(prefix="fedmoe-wan-versions-") as kept:  # on disk: see kept_versions
        rows, skipped = run_all(names, o.runs, s, Path(scratch), Path(kept), ctx.out)
        goals = evaluate(rows, s)
    summary = summarise(rows, goals)
    for r in rows:
        r["relay_pulls"] = relay_pulls(r)
    print(summary_table(summary, goals))
    ctx.out.with_suffix(".partial.json").unlink(missing_ok=True)
    ctx.write({"settings": asdict(s), "quick": ctx.quick, "runs": o.runs, "targets": goals, "summary": summary,
               "results": rows, "skipped": skipped, "load_before": [round(x, 2) for x in load_before],
               "seconds": ctx.seconds(),
               "note": "measured on a shared 2-core machine; see load_before, the stamp's load and each row's "
                       "load_after"})
    return 0


def run_all(modes: list[str], runs: int, s: Settings, scratch: Path, kept: Path,
            out: Path) -> tuple[list[dict], dict[str, str]]:
    """``runs`` rounds over the modes (run 1 of every mode, then run 2, ...: a load that changes over the hours
    falls on every mode alike); the rows, and the modes skipped or failed."""
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    shards = write_shards(scratch / "shards", s.worker_count)
    for run in range(runs):
        for name in modes:
            if name in skipped:
                continue
            if not available(MODES[name]):
                skipped[name] = f"run_worker.py has no {MODES[name].needs} on this branch"
                log.warning("%s: skipped (%s)", name, skipped[name])
                continue
            log.info("%s, run %d/%d: %d sites x %d %s workers over %.0f Mbit/s, %.0f ms RTT", name, run + 1, runs,
                     s.sites, s.workers, s.base_model, s.rate_mbit, s.rtt_ms)
            slug = f"{len(rows):03d}"
            try:
                row = run_mode(name, s, scratch / slug, kept / slug, shards)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # keep the other modes' figures
                skipped[name] = f"failed: {str(exc)[-2000:]}"
                log.error("%s: failed, going on without it: %s", name, exc)
                continue
            rows.append({**row, "run": run, "load_after": [round(x, 2) for x in os.getloadavg()]})
            # before scoring (at the end, off the clock): a long run stopped early keeps its steps and bytes
            write_json_atomic(out.with_suffix(".partial.json"), {"settings": asdict(s), "results": rows,
                                                                "skipped": skipped})
            log.info("%s: done, %d versions kept, root ingress %d bytes", name, len(row["versions"]),
                     row["root_ingress_bytes"])
    return rows, skipped


def summary_table(summary: list[dict[str, Any]], goals: dict[str, Any]) -> str:
    def cell(x: dict[str, Any], scale: float = 1.0) -> str:
        if x["median"] is None:
            return f"never ({x['never']}/{x['runs']})"
        low, high = x["min"], x["max"]
        span = f" [{low / scale:.4g}-{high / scale:.4g}]" if x["runs"] > 1 and low is not None and high is not None else ""
        return f"{x['median'] / scale:.4g}{span}"

    keys = ["mode", "to target s", "x", "steps to it", "to 90% s", "x90", "steps to 90%", "final loss", "steps/worker",
            "root in MB", "root out MB"]
    rows = [[line["mode"], cell(line["time_to_target_s"]), line["speedup_target_s"], cell(line["steps_to_target"]),
             cell(line["time_to_target90_s"]), line["speedup_target90_s"], cell(line["steps_to_target90"]),
             cell(line["heldout_final"]), cell(line["steps_per_worker"]),
             cell(line["root_ingress_bytes"], 1e6), cell(line["root_egress_bytes"], 1e6)] for line in summary]
    return (f"targets: {goals['target_loss']} (best baseline's final loss: {goals['best_baseline']}) and "
            f"{goals['target90_loss']} (90% of its gain from {goals['start_loss']}); medians [ranges] over runs\n"
            + format_table(keys, rows))


BENCH = Bench("wan", tags=("network",), settings=Options, run=run, quick={"preset": "quick"})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
