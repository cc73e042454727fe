"""What one sync carries between its parts (worker.federation): the interval's training, the
snapshot, the checkpoint being written, the pull's result; and the outbox entries."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from protocol.tensors import StateDict
from worker.checkpoint import WorkerCheckpoint


@dataclass
class Outgoing:
    """An update waiting in the outbox: its bytes and metadata never change once queued."""

    body: bytes
    meta: dict[str, Any]


@dataclass
class IntervalStats:
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    """Seconds spent computing the steps."""
    throttled: float = 0.0
    """Seconds slept after them to simulate a slower machine (--speed-factor)."""

    def add(self, s: Any) -> None:
        self.steps += s.steps
        self.samples += s.samples
        self.tokens += s.tokens
        self.loss_sum += s.loss * s.steps
        self.seconds += s.seconds

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None

    @property
    def tokens_per_second(self) -> float:
        """Effective throughput: the --speed-factor sleeps count, as they would on a slower machine."""
        return self.tokens / max(self.seconds + self.throttled, 1e-9)


@dataclass
class Fetched:
    """A pull's result before it is adopted: weights is None when nothing changed."""

    weights: StateDict | None
    version: int
    etag: str | None
    nbytes: int


@dataclass
class SyncJob:
    """One sync in progress: what begin_sync captured, then what exchange found."""

    number: int
    final: bool
    stats: IntervalStats
    """The training this sync sends."""
    snapshot: StateDict
    """Local adapter at the sync point."""
    delta_from: StateDict | None
    """Weights the delta is measured from; None when there is nothing to send."""
    checkpoint: WorkerCheckpoint | None
    record: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    blocked: float = 0.0
    """Seconds the training thread spent on this sync."""
    background: float = 0.0
    """Seconds exchange ran on the background thread."""
    fetched: Fetched | None = None
    dropped: bool = False
    """The delta could not be encoded (e.g. NaN): local weights get replaced, not carried."""


@dataclass(frozen=True)
class RunSummary:
    """What run() did before the final sync: the figures bench/overhead.py compares."""

    seconds: float
    cpu_seconds: float
    """CPU time of the whole process (training and background threads), blind to other processes' load."""
    steps: int
    tokens: int
    blocked_seconds: float
    syncs: int
