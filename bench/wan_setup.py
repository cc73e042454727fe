"""What every bench.wan engine shares: the run settings and presets, per-worker data shards, CPU groups.

Kept apart from ``bench.wan`` (the modes and the FedMoE runs) so that ``bench.wan_flower`` (Flower's deployment
engine over the same sites) and ``bench.wan_eval`` (held-out loss, targets, the summary over runs) use the same
settings without importing the CLI module.
"""
from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import sample_suite

log = logging.getLogger("bench.wan")
ROOT = Path(__file__).resolve().parents[1]
SPECIALTY = "sql_expert"


@dataclass(frozen=True)
class Settings:
    sites: int
    workers: int
    """Workers (FedMoE run_worker.py processes, or Flower SuperNodes) per site."""
    duration: float
    """Seconds each worker trains."""
    sync_interval: float
    """Seconds between a worker's syncs (a mode may set its own)."""
    base_model: str = "tiny-qwen2"
    batch_size: int = 4
    max_seq_len: int = 64
    lr: float | None = None
    """Learning rate of every worker and Flower client (None: run_worker.py's default for the model)."""
    threads: int | None = None
    """--threads of each worker (None: run_worker.py's default)."""
    overlap: bool = True
    """False: --no-overlap (training waits for each sync); a mode may set its own."""
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

    site_rates: tuple[float, ...] = ()
    """Mbit/s of each site's link (issue 35's heterogeneous fleet: fast, 20, 5); empty: ``rate_mbit`` for all."""
    site_rtts: tuple[float, ...] = ()
    """RTT of each site's link, ms; empty: ``rtt_ms`` for all."""
    worker_speeds: tuple[float, ...] = ()
    """Each worker's speed (1, 0.5, 0.25): its CPU cap is ``(worker_cpu or 1 core) * speed``, for FedMoE workers and
    Flower clients alike; empty: every worker at ``worker_cpu``."""

    @property
    def worker_count(self) -> int:
        return self.sites * self.workers

    def site_link(self, site: int) -> tuple[float, float]:
        """(Mbit/s, RTT ms) of ``site``'s link to the root."""
        rate = self.site_rates[site] if self.site_rates else self.rate_mbit
        return rate, self.site_rtts[site] if self.site_rtts else self.rtt_ms

    def worker_share(self, k: int) -> float | None:
        """Worker k's CPU cap in cores (None: uncapped)."""
        if not self.worker_speeds:
            return self.worker_cpu
        return (self.worker_cpu or 1.0) * self.worker_speeds[k]

    def link_capacity(self, seconds: float) -> float:
        """Bytes the sites' links could carry each way in ``seconds``."""
        return sum(self.site_link(i)[0] for i in range(self.sites)) * 1e6 / 8 * seconds


PRESETS: dict[str, Settings] = {
    # lr: run_worker.py's default for the random tiny-qwen2, given to Flower's clients too
    "quick": Settings(sites=2, workers=3, duration=40, sync_interval=8, lr=1e-2),
    "tiny-qwen2": Settings(sites=2, workers=3, duration=120, sync_interval=10, lr=1e-2),
    # link-bound: see bench.wan's docstring; held-out examples at 32 tokens cost ~0.15 CPU s each. lr 1e-3 as
    # bench.converge's smollm2 runs (the worker's own default is 2e-4), for FedMoE workers and Flower clients alike
    "smollm2-135m": Settings(sites=2, workers=3, duration=150, sync_interval=1, base_model="smollm2-135m",
                             batch_size=1, max_seq_len=32, lr=1e-3, threads=1, overlap=False, forward_interval=5,
                             heldout=36, max_eval_versions=14),
}


SCENARIOS: dict[str, dict[str, Any]] = {
    # issue 35 item 3: one worker per site, each its own speed and link (the slowest worker on the slowest link:
    # synchronous rounds wait for it), against the same three workers all at full speed on 20 Mbit/s links
    "hetero": {"sites": 3, "workers": 1, "site_rates": (1000.0, 20.0, 5.0), "site_rtts": (1.0, 50.0, 50.0),
               "worker_speeds": (1.0, 0.5, 0.25)},
    "homogeneous": {"sites": 3, "workers": 1},
}


def write_shards(directory: Path, count: int) -> list[Path]:
    """The expert's training examples dealt round-robin into ``count`` disjoint ``shard-<k>.jsonl`` files.

    Each worker (FedMoE ``--dataset``) or Flower client (partition k) trains on its own shard, as workers with data
    of their own would; both hold out a tenth of their shard for themselves (``worker.data.split_examples``), and the
    benchmark's held-out loss is on the expert's held-out split, which no shard holds."""
    domain = next(d for d in sample_suite().domains if d.name == SPECIALTY)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"shard-{k}.jsonl" for k in range(count)]
    for k, path in enumerate(paths):
        rows = [{"prompt": e.prompt, "reference_code": e.reference_code} for e in domain.train[k::count]]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's cpu controller (these machines); cgroup v2 hosts would need cpu.max instead."""
CFS_PERIOD_US = 100_000


class CpuCapUnavailable(RuntimeError):
    """No writable cgroup cpu controller here: --worker-cpu cannot be honoured."""


@dataclass(frozen=True)
class CpuGroup:
    """A cgroup its processes (and every process they start later, detached or not) stay in."""

    path: Path

    def __call__(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the group: Flower's SuperNodes start their apps in sessions of their own, which
        a kill of the process they were started from does not reach."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def cpu_capped(name: str, share: float | None) -> Iterator[CpuGroup]:
    """A cgroup capped at ``share`` of one core (None: no cap, only grouped); yields it (``group(pid)`` moves a
    process in). The group is removed on exit (its processes must be gone by then)."""
    group = CPU_CGROUP / f"fedmoe-wan-{os.getpid()}-{name}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        quota = -1 if share is None else max(1000, round(share * CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    except OSError as exc:
        raise CpuCapUnavailable(f"--worker-cpu needs a writable cgroup v1 cpu controller at {CPU_CGROUP} "
                                f"({exc.strerror}); run without it") from None
    try:
        yield CpuGroup(group)
    finally:
        try:
            group.rmdir()
        except OSError as exc:  # a process still in it: say so, leave the empty-quota group behind
            log.warning("could not remove cgroup %s: %s", group, exc.strerror)


def check_cpu_cap() -> None:
    with cpu_capped("probe", 1.0):
        pass


def link_seconds(nbytes: int, s: Settings) -> float:
    return nbytes / (s.rate_mbit * 1e6 / 8)
