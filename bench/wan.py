#!/usr/bin/env python3
"""WAN benchmark: flat federation against relay coordinators, over emulated WAN links.

Two emulated sites (``bench.wanemu``: a network namespace, a veth pair shaped with tbf, a delay
proxy) each hold three real ``run_worker.py`` processes training one expert; the root coordinator
runs on this host's loopback, behind each site's 20 Mbit/s, 50 ms RTT link. The link is the site's:
its three workers (or its relay) share the one veth pair and its tbf, as they would share a site's
uplink. Modes (``MODES``; the defaults are per base model, ``DEFAULT_MODES``):

- ``flat``: every worker talks to the root over its site's link (uncompressed pushes); the root
  aggregates with FedBuff over K=3 (the group size), the fair baseline: flat fedasync applies each
  of 6 workers' deltas in full and oscillates (``flat fedasync``, kept for reference);
- ``flat topk+int8``: the same with the best fixed codec of the flat baseline (docs/wan.md);
- ``relays``: one relay per site runs *inside* the site (``run_coordinator.py --upstream``); the
  site's workers reach it on the namespace's loopback (fast), and only the relay crosses the WAN,
  forwarding one combined update per expert per ``--forward-interval`` (lossless);
- ``relays + topk+int8 upstream``: the same, the relay compressing the long link (error feedback);
- ``relays+adaptive``: that, with the workers on ``--compression auto --sync-budget 2``;
- on smollm2-135m: ``flat randomk+terngrad`` (the best fixed codec measured on that model: random-k
  10% + TernGrad, unbiased, no error feedback, each worker its own selection seed), and
  ``relays+adaptive (int8 upstream)`` (the relays' long link in int8 with error feedback, +0.00% on
  smollm2-135m in docs/history/benchmarks.md, where top-k + int8 kept ~10% of the gain);
- ``relays+adaptive (int8 both ways; site model)``: the relays also fetch root versions as int8 diffs and serve
  their site's model (``--site-model``: the root's version plus the site's updates not yet in it; a batch is the
  site's summed progress), and the root averages the two sites' batches (FedBuff K=2), hierarchical FL's
  edge/cloud rounds: the smollm2 default for relays + adaptive (docs/wan.md).

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
(``--quick``: bench/results/quick/wan.json).
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import SCRATCH_DIR, format_table, pulled_tensors, recorded_token, running_coordinator, sample_suite
from bench.harness import Bench, Run
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from protocol.cli import comma_list, option
from protocol.client import CoordinatorClient
from protocol.credentials import TOKEN_ENV

log = logging.getLogger("bench.wan")
ROOT = Path(__file__).resolve().parents[1]
SPECIALTY = "sql_expert"
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
    needs: str | None = None
    """A run_worker.py --help text this mode needs (a flag built on another branch)."""
    root: dict[str, Any] = field(default_factory=dict)
    """The root's CoordinatorConfig settings (default: fedasync)."""


# Flat baselines aggregate with FedBuff over the group size (3): each root step is a sample-weighted
# mean of 3 workers' deltas, as a relay's forward is. Flat fedasync applies every delta in full and
# oscillated (an effective step ~6x with 6 workers: docs/wan.md), which would flatter the relays.
FLAT_FEDBUFF = {"aggregation": "fedbuff", "buffer_size": 3}
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
    # of the gain (docs/history/benchmarks.md), so that is its best fixed codec, and the relays' lossy codec is int8
    "flat randomk+terngrad": Mode(RANDOMK_TERNGRAD, root=FLAT_FEDBUFF),
    "relays+adaptive (int8 upstream)": Mode(AUTO, relays=["--forward-compression", "int8"], needs="--sync-budget"),
    # the relays also fetch new root versions as int8 diffs (a full fetch every 10th): ~1 s of the site's downlink
    # per version instead of ~4 s, so the weights its workers train on are fresher (docs/wan.md)
    "relays+adaptive (int8 both ways)": Mode(AUTO, relays=INT8_BOTH_WAYS, needs="--sync-budget"),
    # both ways, FedBuff K=2 at the root with server lr 2: each root step both sites' batches added (FedAsync's
    # step size), one version per pair of batches instead of one per batch (docs/wan.md, "What bounds")
    "relays+adaptive (int8 both ways; fedbuff root x2)": Mode(
        AUTO, relays=INT8_BOTH_WAYS, needs="--sync-budget",
        root={"aggregation": "fedbuff", "buffer_size": 2, "server_lr": 2.0}),
    # each relay serves its site's model (the root's version plus the site's updates not yet in it) and forwards the
    # sum of its workers' weighted deltas, the site's progress (coordinator/relay/site.py); the root averages the two
    # sites' batches (FedBuff K=2), hierarchical FL's cloud round (docs/wan.md)
    "relays+adaptive (int8 both ways; site model)": Mode(
        AUTO, relays=[*INT8_BOTH_WAYS, "--site-model"], needs="--sync-budget",
        root={"aggregation": "fedbuff", "buffer_size": 2}),
    "relays+adaptive (int8 both ways; site model; fedasync root)": Mode(
        AUTO, relays=[*INT8_BOTH_WAYS, "--site-model"], needs="--sync-budget"),
    # the same with FedBuff at the root over the two relays' batches (each root step the mean of both), against
    # the FedAsync root's oscillation when the relays forward often (docs/wan.md, tenth run)
    "relays+adaptive (int8 upstream; fedbuff root)": Mode(AUTO, relays=["--forward-compression", "int8"],
                                                          needs="--sync-budget",
                                                          root={"aggregation": "fedbuff", "buffer_size": 2}),
}
DEFAULT_MODES = {"tiny-qwen2": ["flat", "flat topk+int8", "relays + topk+int8 upstream", "relays+adaptive"],
                 "smollm2-135m": ["flat", "flat randomk+terngrad", "relays",
                                  "relays+adaptive (int8 both ways; site model)"]}


@dataclass(frozen=True)
class Settings:
    sites: int
    workers: int
    """run_worker.py processes per site."""
    duration: float
    """Seconds each worker trains."""
    sync_interval: float
    """Seconds between a worker's syncs."""
    base_model: str = "tiny-qwen2"
    batch_size: int = 4
    max_seq_len: int = 64
    threads: int | None = None
    """--threads of each worker (None: run_worker.py's default)."""
    overlap: bool = True
    """False: --no-overlap (training waits for each sync)."""
    forward_interval: float | None = None
    """Seconds between a relay's forwards (None: sync_interval)."""
    max_eval_versions: int = 0
    """Evaluate at most this many of a mode's kept versions, evenly spaced, then every version between the
    last one above a target and the first at or below it (0: every version)."""
    rate_mbit: float = 20.0
    """Bandwidth of a site's link to the root, each way."""
    rtt_ms: float = 50.0
    """Round-trip time the delay proxy adds on that link."""
    heldout: int = 48
    """Held-out examples each kept version is evaluated on."""
    worker_cpu: float | None = None
    """Cap each worker at this fraction of one core (a cgroup cpu quota), the same in every mode, as if each
    ran on a slow machine of its own (None: the workers share the host's cores as they come)."""


@dataclass
class Processes:
    """What one mode started: the workers and the relays."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    relays: list[subprocess.Popen] = field(default_factory=list)


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's cpu controller (these machines); cgroup v2 hosts would need cpu.max instead."""
CFS_PERIOD_US = 100_000


class CpuCapUnavailable(RuntimeError):
    """No writable cgroup cpu controller here: --worker-cpu cannot be honoured."""


@contextmanager
def cpu_capped(name: str, share: float) -> Iterator[Callable[[int], None]]:
    """A cgroup capped at ``share`` of one core; yields ``add(pid)``, which moves a process (all its threads,
    and those it starts later) into it. The group is removed on exit (its processes must be gone by then)."""
    group = CPU_CGROUP / f"fedmoe-wan-{os.getpid()}-{name}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(share * CFS_PERIOD_US))))
    except OSError as exc:
        raise CpuCapUnavailable(f"--worker-cpu needs a writable cgroup v1 cpu controller at {CPU_CGROUP} "
                                f"({exc.strerror}); run without it") from None
    def add(pid: int) -> None:
        (group / "cgroup.procs").write_text(str(pid))

    try:
        yield add
    finally:
        try:
            group.rmdir()
        except OSError as exc:  # a process still in it: say so, leave the empty-quota group behind
            log.warning("could not remove cgroup %s: %s", group, exc.strerror)


def check_cpu_cap() -> None:
    with cpu_capped("probe", 1.0):
        pass


PRESETS: dict[str, Settings] = {
    "quick": Settings(sites=2, workers=3, duration=40, sync_interval=8),
    "tiny-qwen2": Settings(sites=2, workers=3, duration=120, sync_interval=10),
    # link-bound: see the module docstring; held-out examples at 32 tokens cost ~0.15 CPU s each
    "smollm2-135m": Settings(sites=2, workers=3, duration=150, sync_interval=1, base_model="smollm2-135m",
                             batch_size=1, max_seq_len=32, threads=1, overlap=False, forward_interval=5,
                             heldout=36, max_eval_versions=14),
}


def worker_command(name: str, url: str, results: Path, flags: list[str], s: Settings) -> list[str]:
    seed = str(zlib.crc32(name.encode()) or 1)  # a codec seed of 0 means "unseeded"
    extra = ([] if s.threads is None else ["--threads", str(s.threads)]) + ([] if s.overlap else ["--no-overlap"])
    # --seed: each worker its own order over the examples, as workers with data of their own would see; with
    # one seed for all, the six workers took the same example at each step (their mean was one example's step)
    return [sys.executable, str(ROOT / "run_worker.py"), "--specialty", SPECIALTY, "--base-model", s.base_model,
            "--device", "cpu", "--coordinator-url", url, "--worker-id", name, "--seed", seed, "--results", str(results),
            "--state-dir", str(results.with_suffix(".state")), "--duration", str(s.duration),
            "--sync-interval", str(s.sync_interval), "--batch-size", str(s.batch_size),
            "--max-seq-len", str(s.max_seq_len), "--no-heldout-eval", *extra,
            *[flag.replace(SEED, seed) for flag in flags]]


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


def run_mode(name: str, s: Settings, scratch: Path) -> dict[str, Any]:
    """One federation of ``s.sites`` x ``s.workers`` workers in mode ``name``; figures and the root's versions."""
    mode = MODES[name]
    paths = [scratch / f"{name}-{site}-{i}.jsonl".replace(" ", "_") for site in range(s.sites)
             for i in range(s.workers)]
    cpu_before = _cpu_seconds()
    with running_coordinator(keep_versions=1000, **mode.root) as url, ExitStack() as stack:
        # (exits in reverse: the workers' cgroups are removed after the finally below has reaped them)
        port = int(url.rsplit(":", 1)[1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: recorded_token(url),  # the site cannot see this host's token file
               "FEDMOE_JOIN_TOKEN": recorded_token(url)}  # relays join with it (the admin may register relays)
        links = [stack.enter_context(WanLink(("127.0.0.1", port), s.rate_mbit, s.rtt_ms)) for _ in range(s.sites)]
        run = Processes()
        started = time.monotonic()
        try:
            for site, link in enumerate(links):
                target = link.url
                if mode.relays is not None:
                    proc, target = start_relay(link, site, mode.relays, s, scratch / name.replace(" ", "_"), env)
                    run.relays.append(proc)
                for i in range(s.workers):
                    path = paths[site * s.workers + i]
                    with path.with_suffix(".log").open("w") as log_file:  # a file: 6 pipes read in turn could fill
                        run.procs.append(link.site.popen(
                            worker_command(f"wan-{site}-{i}", target, path, mode.workers, s), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log_file))
                    if s.worker_cpu is not None:  # before it loads torch: every thread it starts stays capped
                        stack.enter_context(cpu_capped(f"{site}-{i}", s.worker_cpu))(run.procs[-1].pid)
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
        versions = kept_versions(url)
        relay_reports = relay_counters(url) if run.relays else []
    failed = [(p.returncode, path) for p, path in zip(run.procs, paths) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{name}: worker exited {failed[0][0]}:\n"
                           f"{failed[0][1].with_suffix('.log').read_text()[-3000:]}")
    records = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
    cpu = {k: round(v - cpu_before[k], 1) for k, v in _cpu_seconds().items()}
    capacity = s.sites * s.rate_mbit * 1e6 / 8 * wall  # bytes the site links could carry each way in the run
    return {"mode": name, "root": mode.root or {"aggregation": "fedasync"}, **figures(records),
            "root_ingress_bytes": ingress, "root_egress_bytes": egress, "wall_seconds": round(wall, 1),
            "link_busy_up": round(ingress / capacity, 3), "link_busy_down": round(egress / capacity, 3),
            "cpu_seconds": cpu, "relays": relay_reports, "versions": versions}


def relay_counters(url: str) -> list[dict[str, Any]]:
    """Each relay's last report at the root (bytes received, forwarded, served, of which diffs, fetched; batches)."""
    client = CoordinatorClient(url)
    try:
        return [{k: r.get(k) for k in ("relay_id", "stats", "bytes_saved")} for r in client.relays()]
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
        return sum(t.numel() * t.element_size() for t in pulled_tensors(client.pull_weights(SPECIALTY)).values())
    except Exception:  # noqa: BLE001 - only sizes a wait
        return 0
    finally:
        client.close()


def link_seconds(nbytes: int, s: Settings) -> float:
    return nbytes / (s.rate_mbit * 1e6 / 8)


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
            "sync_seconds_median": round(statistics.median(r["sync_seconds"] for r in syncs), 3) if syncs else None,
            "push_bytes_median": int(statistics.median(pushed)) if pushed else None,
            "pull_bytes_total": sum(r.get("bytes_down", 0) for r in syncs)}


def evaluate(rows: list[dict[str, Any]], s: Settings) -> None:
    """Held-out loss of the kept versions (off the clock), then each mode's time to the target.

    With ``s.max_eval_versions`` only that many versions per mode are evaluated at first (evenly spaced, the
    first and last included), except flat's, which are all evaluated (its best is the target). Then, for each
    target, every version of a mode before its first evaluated one at or below it is evaluated in order until
    one reaches it (all of them if none evaluated did), so the time to target is exact: the first version
    that reaches it. (Before, only the versions since the last evaluated one above the target were: a
    noisy curve that dipped under the target between two samples, rose and came down again was timed at
    its second crossing.)
    """
    import torch

    from worker.models import load_base_model
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    torch.set_num_threads(1)
    domain = next(d for d in sample_suite().domains if d.name == SPECIALTY)
    heldout = list(domain.heldout[:s.heldout])
    trainer = LoraTrainer(load_base_model(s.base_model), LoraSettings(),
                          TrainSettings(batch_size=s.batch_size, max_seq_len=s.max_seq_len), list(domain.train))

    def loss(v: dict[str, Any]) -> float:
        if "heldout_loss" not in v:
            trainer.load_adapter_state(v["weights"])
            v["heldout_loss"] = round(trainer.eval_loss(heldout, batch_size=8), 4)
        return v["heldout_loss"]

    for row in rows:
        versions = row["versions"]
        n, k = len(versions), 0 if row["mode"] == "flat" else s.max_eval_versions
        picks = range(n) if not k or n <= k else sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
        for i in picks:
            loss(versions[i])
    flat = next(r for r in rows if r["mode"] == "flat")
    flat_losses = [v["heldout_loss"] for v in flat["versions"]]
    start, target = flat_losses[0], min(flat_losses)
    # the held-out curves are noisy and flat's best is often its last version, so also the time to 90%
    # of flat's gain from the start, a target every mode's curve crosses in the run
    target90 = round(start - 0.9 * (start - target), 4)
    for row in rows:
        versions = row["versions"]
        for key, goal in (("time_to_target_s", target), ("time_to_target90_s", target90)):
            first = first_reaching(versions, goal, loss)
            row[key] = round(versions[first]["seconds"], 1) if first is not None else None
        row["target_loss"], row["target90_loss"] = target, target90
        evaluated = [v["heldout_loss"] for v in versions if "heldout_loss" in v]
        row["heldout_start"], row["heldout_best"] = (evaluated[0], min(evaluated)) if evaluated else (None, None)
        row["versions_kept"], row["versions_evaluated"] = len(versions), len(evaluated)
        for v in versions:
            v.pop("weights", None)


def first_reaching(versions: list[dict[str, Any]], goal: float, loss: Callable[[dict[str, Any]], float]) -> int | None:
    """Index of the first version whose held-out loss is at or below ``goal`` (None: none is), evaluating with
    ``loss`` only what that needs: the versions before the first already evaluated one that reaches it (all of
    them if none does), in order, until one does."""
    sampled = next((i for i, v in enumerate(versions) if v.get("heldout_loss", math.inf) <= goal), len(versions))
    return next((i for i in range(sampled) if loss(versions[i]) <= goal), None if sampled == len(versions) else sampled)


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
        if [m for m in names if m not in MODES] or "flat" not in names:
            raise ValueError(f"--modes must include flat and name only {list(MODES)}, got {names}")

    def mode_names(self) -> tuple[str, ...]:
        return self.modes or tuple(DEFAULT_MODES[self.base_model])

    def job(self) -> Settings:
        s = PRESETS[self.preset or self.base_model]
        changes: dict[str, Any] = {"duration": self.duration, "forward_interval": self.forward_interval, "worker_cpu": self.worker_cpu}
        return replace(s, **{k: v for k, v in changes.items() if v is not None})


def run(o: Options, ctx: Run) -> int:
    s = o.job()
    try:
        check_available()
        if s.worker_cpu is not None:
            check_cpu_cap()
    except (NamespaceUnavailable, CpuCapUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="fedmoe-wan-", dir=SCRATCH_DIR) as scratch:
        for name in o.mode_names():
            if not available(MODES[name]):
                skipped[name] = f"run_worker.py has no --compression {MODES[name].needs} on this branch"
                log.warning("%s: skipped (%s)", name, skipped[name])
                continue
            log.info("%s: %d sites x %d %s workers over %.0f Mbit/s, %.0f ms RTT", name, s.sites, s.workers,
                     s.base_model, s.rate_mbit, s.rtt_ms)
            try:
                rows.append(run_mode(name, s, Path(scratch)))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # keep the other modes' figures
                if name == "flat":
                    raise
                skipped[name] = f"failed: {str(exc)[-2000:]}"
                log.error("%s: failed, going on without it: %s", name, exc)
                continue
            log.info("%s: done, %d versions kept, root ingress %d bytes", name, len(rows[-1]["versions"]),
                     rows[-1]["root_ingress_bytes"])
    evaluate(rows, s)
    base = next(r for r in rows if r["mode"] == "flat")
    for r in rows:
        r["relay_pulls"] = relay_pulls(r)
        r["ingress_vs_flat"] = round(base["root_ingress_bytes"] / max(1, r["root_ingress_bytes"]), 2)
        for key in ("time_to_target_s", "time_to_target90_s"):
            hit, flat_hit = r[key], base[key]
            r[key.replace("time_to", "speedup")] = round(flat_hit / hit, 2) if hit and flat_hit else None
    keys = ["mode", "syncs", "steps_total", "root_ingress_bytes", "ingress_vs_flat", "root_egress_bytes",
            "link_busy_up", "link_busy_down", "heldout_best", "time_to_target_s", "speedup_target_s",
            "time_to_target90_s", "speedup_target90_s", "sync_seconds_median", "push_seconds_median",
            "pull_seconds_median", "checkpoint_seconds_median", "train_seconds_median"]
    print(format_table(keys, [[r[k] for k in keys] for r in rows]))
    ctx.write({"settings": asdict(s), "quick": ctx.quick, "results": rows, "skipped": skipped,
               "seconds": ctx.seconds(), "note": "measured on a shared 2-core machine under load"})
    return 0


BENCH = Bench("wan", tags=("network",), settings=Options, run=run, quick={"preset": "quick"})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
