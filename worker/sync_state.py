"""The state the sync steps of worker.federation share.

- ``ExpertState``: where this worker stands with its expert between syncs (version, the weights
  last pulled, the reference the next delta is measured from, the outbox of undelivered updates).
- ``IntervalStats``: the training since the last sync point; one object, which the loop adds to and
  the begin step takes (``take``), so the loop and the sync steps can hold the same one.
- ``Links``: the measured throughput each way (--compression auto).
- ``SyncJob``: one sync in progress, handed from step to step: begin (snapshot) -> encode (queue
  the delta) -> push (flush the outbox) -> pull (fetch the expert) -> apply (adopt it, write the
  result line). Each step reads what the previous ones put in the job.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from protocol.tensors import StateDict
from worker.adaptive import LinkEstimate
from worker.checkpoint import WorkerCheckpoint
from worker.data import StreamPosition


class Trainer(Protocol):
    """What the loop needs from a trainer (``worker.trainer.LoraTrainer``)."""

    global_step: int

    def train_steps(self, n: int) -> Any: ...
    def adapter_state(self) -> StateDict: ...
    def load_adapter_state(self, state: StateDict) -> None: ...
    def share_primary_weights(self) -> None: ...
    @property
    def data_position(self) -> StreamPosition: ...
    def seek(self, position: StreamPosition) -> None: ...
    def optimizer_state(self) -> dict: ...
    def load_optimizer_state(self, state: dict) -> None: ...


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

    def take(self) -> IntervalStats:
        """These figures, handed to a sync; this interval starts again from zero."""
        taken = replace(self)
        self.reset()
        return taken

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None

    @property
    def tokens_per_second(self) -> float:
        """Effective throughput: the --speed-factor sleeps count, as they would on a slower machine."""
        return self.tokens / max(self.seconds + self.throttled, 1e-9)


@dataclass
class Links:
    """Measured throughput each way (--compression auto): every push and pull is timed into it."""

    up: LinkEstimate = field(default_factory=LinkEstimate)
    down: LinkEstimate = field(default_factory=LinkEstimate)


@dataclass
class Fetched:
    """A pull's result before it is adopted: weights is None when nothing changed."""

    weights: StateDict | None
    version: int
    etag: str | None
    nbytes: int
    seconds: float = 0.0
    """How long the request took (the download throughput estimate of --compression auto)."""
    diff_codec: str | None = None
    """The codec of a diff pull; None for a full pull."""


@dataclass
class ExpertState:
    """This worker's standing with its expert; the sync steps read and replace it, checkpoints save it."""

    version: int = -1
    """Expert version our weights came from."""
    etag: str | None = None
    pulled: StateDict = field(default_factory=dict)
    """Weights as of the last pull (exact after a full pull, approximate after a lossy diff pull)."""
    reference: StateDict = field(default_factory=dict)
    """Weights the next delta is measured from: the last pull, or the last sync's snapshot."""
    pulls: int = 0
    syncs: int = 0
    outbox: deque[Outgoing] = field(default_factory=deque)
    """Updates queued in order, each pushed (and retried) under its own update id."""

    def progress(self) -> dict[str, Any]:
        """The checkpoint's counters for this state (JSON scalars)."""
        return {"syncs": self.syncs, "base_version": self.version, "etag": self.etag, "pulls": self.pulls}

    def load(self, checkpoint: WorkerCheckpoint) -> None:
        """Take up where a checkpoint left off (in place: the loop and its sync steps hold this one object)."""
        progress = checkpoint.progress
        self.version, self.etag, self.pulls, self.syncs = (progress["base_version"], progress["etag"],
                                                           progress["pulls"], progress["syncs"])
        self.pulled, self.reference = checkpoint.pulled, checkpoint.reference
        self.outbox = deque(Outgoing(body, meta) for body, meta in checkpoint.outbox)

    def adopt(self, weights: StateDict, reference: StateDict, version: int, etag: str | None) -> None:
        """The expert's weights were taken at ``version``; the next delta is measured from ``reference``."""
        self.pulled, self.reference, self.version, self.etag = weights, reference, version, etag

    def forget_history(self, version: int) -> None:
        """Start over at ``version`` of an expert that lacks ours: drop queued updates and pulled weights."""
        self.outbox.clear()
        self.pulled, self.etag, self.version = {}, None, version


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
    """What the pull step found (None: no pull, e.g. the push failed or the final sync)."""
    delivered: bool = False
    """The push step emptied the outbox."""
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
