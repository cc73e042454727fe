"""The worker's federated loop: train for an interval, push the delta, pull, repeat.

Exactly-once delivery without losing work: every interval's delta (local
weights minus the weights it was computed from) goes into an *outbox* with a
fresh ``update_id``. The outbox is flushed in order at each sync; a push that
fails for lack of a coordinator stays queued (same id, same bytes) and training
goes on, so when the coordinator is back every delta arrives once, however
many retries it took. Only after the outbox is empty do we pull the latest
expert weights and continue from them.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from protocol.client import CoordinatorClient
from compression.errors import CompressionError
from compression.wire import decode_update
from protocol.errors import FedMoEError, NotFound, Unavailable
from protocol.tensors import StateDict, manifest_of
from worker.console import SyncConsole
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What the loop needs from a trainer (``worker.trainer.LoraTrainer``)."""

    def train_steps(self, n: int) -> Any: ...
    def adapter_state(self) -> StateDict: ...
    def load_adapter_state(self, state: StateDict) -> None: ...


@dataclass(frozen=True)
class SyncSettings:
    specialty: str
    """Expert this worker trains."""
    worker_id: str
    duration: float = 3600.0
    """Seconds to run before the final push."""
    sync_interval: float = 10.0
    """Seconds of training between syncs."""
    speed_factor: float = 1.0
    """Relative speed in (0, 1]: 0.5 sleeps as long as each step took, simulating a slower machine."""
    steps_per_check: int = 1
    """Training steps between clock checks."""
    results_path: Path | None = None
    """Append one JSON line per sync here."""

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if not self.sync_interval > 0:
            raise ValueError(f"--sync-interval must be > 0 seconds, got {self.sync_interval}")
        if not 0 < self.speed_factor <= 1:
            raise ValueError(f"--speed-factor must be in (0, 1] (1 = full speed), got {self.speed_factor}")


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

    def add(self, s: Any) -> None:
        self.steps += s.steps
        self.samples += s.samples
        self.tokens += s.tokens
        self.loss_sum += s.loss * s.steps
        self.seconds += s.seconds

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None


@dataclass
class FederatedWorker:
    settings: SyncSettings
    client: CoordinatorClient
    trainer: Trainer
    expert_spec: dict[str, Any]
    """{"lora": ..., "base_model": {"id", "fingerprint"}} sent when creating the expert."""
    encoder: UpdateEncoder = field(default_factory=lambda: UpdateEncoder(CompressionSettings()))
    pull: PullSettings = field(default_factory=PullSettings)
    base_version: int = -1
    """Expert version our weights came from."""
    etag: str | None = None
    pulled: StateDict = field(default_factory=dict)
    """Weights as of the last pull (exact after a full pull, approximate after a lossy diff pull)."""
    reference: StateDict = field(default_factory=dict)
    """Weights the next delta is measured from: the last pull, or the last queued snapshot."""
    pulls: int = 0
    profile: dict[str, Any] | None = None
    """Routing summary of our training prompts (gateway.router), sent when joining."""
    outbox: deque[Outgoing] = field(default_factory=deque)
    interval: IntervalStats = field(default_factory=IntervalStats)
    syncs: int = 0
    console: SyncConsole | None = None
    """Progress bar and the one log line per sync (worker.console); None: no console output."""

    # joining ------------------------------------------------------------------

    def join(self) -> dict[str, Any]:
        """Register, create the expert if this is its first worker, and start from its weights."""
        s = self.settings
        self.client.register_worker(s.worker_id, s.specialty, self.expert_spec["base_model"], s.sync_interval)
        info = self.client.create_expert(s.specialty, self.trainer.adapter_state(), self.expert_spec)
        if self.profile is not None:
            self.client.put_profile(s.specialty, s.worker_id, self.profile)
        self._pull()
        log.info("joined expert %s at version %d as %s", s.specialty, self.base_version, s.worker_id)
        return info

    # the loop -----------------------------------------------------------------

    def run(self) -> None:
        """Train and sync until ``duration`` is over or Ctrl-C; always ends with a final push."""
        s = self.settings
        end = time.monotonic() + s.duration
        try:
            while time.monotonic() < end:
                self._train_until(min(end, time.monotonic() + s.sync_interval))
                self.sync()
        except KeyboardInterrupt:
            log.info("interrupted: pushing what was trained before exiting")
        finally:
            self.sync(final=True)
            if self.outbox:
                log.error("%d update(s) could not be delivered before exit (coordinator unreachable); "
                          "their training is lost", len(self.outbox))

    def _train_until(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            stats = self.trainer.train_steps(self.settings.steps_per_check)
            self.interval.add(stats)
            if self.console is not None:
                self.console.on_train_chunk(self.interval)
            if self.settings.speed_factor < 1:
                time.sleep(stats.seconds * (1 / self.settings.speed_factor - 1))

    def sync(self, final: bool = False) -> dict[str, Any]:
        started = time.perf_counter()
        record: dict[str, Any] = {"time": time.time(), "sync": self.syncs, "final": final,
                                  "worker_id": self.settings.worker_id, "base_version": self.base_version}
        record |= self._queue_interval()
        record["delivered"] = self._flush_outbox()
        received = self._pull_quietly() if record["delivered"] and not final else None
        if received is not None:
            self._heartbeat()
        record |= {"pulled": received is not None, "bytes_down": received or 0}
        record |= {"version": self.base_version, "outbox": len(self.outbox),
                   "sync_seconds": round(time.perf_counter() - started, 4)}
        self.syncs += 1
        self._write_result(record)
        if self.console is not None:
            self.console.on_sync(record)
        return record

    def _queue_interval(self) -> dict[str, Any]:
        """Turn the interval's training into an outgoing update; returns its metrics."""
        stats = self.interval
        if stats.samples == 0:
            return {}
        snapshot = self.trainer.adapter_state()
        delta = {k: snapshot[k] - self.reference[k] for k in snapshot}
        try:
            encoded = self.encoder.encode(delta, manifest_of(delta), seed=self.syncs)
        except CompressionError as exc:  # e.g. training diverged to NaN: skip it, resync from the expert
            log.error("cannot encode this interval's update (%s); dropping it and the carried residual", exc)
            self.encoder.reset()
            self.reference, self.interval = snapshot, IntervalStats()
            self.etag = None  # force a full pull, replacing the local weights
            return {"dropped": True}
        meta = {"update_id": f"{self.settings.worker_id}-{uuid.uuid4().hex[:16]}",
                "base_version": self.base_version, "num_samples": stats.samples, "train_loss": stats.loss,
                "worker_id": self.settings.worker_id, **self.encoder.codec_meta}
        self.outbox.append(Outgoing(encoded.body, meta))
        self.reference = snapshot
        self.interval = IntervalStats()
        m = encoded.metrics
        log.debug("sync %d: %d steps, loss %.4f, %.0f tokens/s; update %d bytes (%.1fx smaller than fp32)",
                  self.syncs, stats.steps, stats.loss or float("nan"), stats.tokens / max(stats.seconds, 1e-9),
                  m["bytes_sent"], m["ratio"])
        return {"steps": stats.steps, "samples": stats.samples, "tokens": stats.tokens, "train_loss": stats.loss,
                "train_seconds": round(stats.seconds, 4), **m}

    def _flush_outbox(self) -> bool:
        """Push queued updates in order; False if the coordinator is unreachable (kept for later)."""
        while self.outbox:
            update = self.outbox[0]
            try:
                self.client.push_update(self.settings.specialty, update.body, update.meta)
            except Unavailable as exc:
                log.warning("%s; keeping %d update(s) queued and training on", exc, len(self.outbox))
                return False
            except FedMoEError as exc:  # refused for good (e.g. NaN after divergence): drop, resync
                log.error("coordinator refused update %s: %s; dropping it", update.meta["update_id"], exc)
            self.outbox.popleft()
        return True

    def _pull(self) -> int:
        """Bring the local adapter to the expert's latest version; returns the bytes received."""
        name, worker_id = self.settings.specialty, self.settings.worker_id
        decoder = self.pull.decoder()
        self.pulls += 1
        if decoder is not None and self.pulled and self.pulls % self.pull.full_every != 0:
            try:
                payload, version = self.client.pull_diff(name, self.base_version, self.pull.codec,
                                                         self.pull.config, worker_id)
            except NotFound:  # our version was pruned on the coordinator: fall back to full weights
                log.info("version %d is no longer kept; pulling full weights", self.base_version)
            else:
                if payload:
                    diff = decode_update(payload, manifest_of(self.pulled), decoder)
                    self._adopt({k: self.pulled[k] + diff[k] for k in self.pulled}, version, etag=None)
                return len(payload)
        pulled = self.client.pull_weights(name, etag=self.etag, worker_id=worker_id)
        if pulled.tensors is not None:
            self._adopt(pulled.tensors, pulled.version, pulled.etag)
        return pulled.nbytes

    def _adopt(self, weights: StateDict, version: int, etag: str | None) -> None:
        self.trainer.load_adapter_state(weights)
        self.pulled = weights
        self.reference = {k: v.clone() for k, v in weights.items()}
        self.base_version, self.etag = version, etag

    def _pull_quietly(self) -> int | None:
        """Like _pull, but an unreachable coordinator is logged and gives None."""
        try:
            return self._pull()
        except Unavailable as exc:
            log.warning("%s; training on from local weights", exc)
            return None

    def _heartbeat(self) -> None:
        try:
            self.client.heartbeat(self.settings.worker_id)
        except FedMoEError as exc:  # liveness is best effort; the next sync tries again
            log.debug("heartbeat failed: %s", exc)

    def _write_result(self, record: dict[str, Any]) -> None:
        path = self.settings.results_path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

