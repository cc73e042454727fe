"""The steps of one sync: begin -> encode -> push -> pull -> apply, one ``SyncJob`` handed along.

worker.federation's module docstring tells the whole story (the outbox, overlap, error feedback, adaptive
compression, checkpoints); this is the part that does the work. ``begin_sync`` and ``finish_sync`` run on the
training thread, ``exchange`` (encode, checkpoint, push, pull) on the background thread while training goes on.
Where this worker stands with its expert is one ``ExpertState`` that only these steps change; the training
since the last sync point is one ``IntervalStats`` that the loop adds to and ``begin_sync`` takes.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compression.errors import CompressionError
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError, Unavailable
from protocol.tensors import StateDict, manifest_of
from protocol.uploads import UploadPolicy
from worker import resume
from worker.adaptive import Decision, SyncPacing, choose_push, upload_policy
from worker.checkpoint import CheckpointWriter
from worker.console import SyncConsole
from worker.distributed import SingleProcess
from worker.early_stopping import BestVersion
from worker.encoding import UpdateEncoder
from worker.placement import PlacementFollower
from worker.pulling import ExpertPuller
from worker.secure_push import SecurePush
from worker.sync_settings import SyncSettings
from worker.sync_state import ExpertState, Fetched, IntervalStats, Links, Outgoing, SyncJob, Trainer

log = logging.getLogger(__name__)


def privacy_claim(trainer: Trainer) -> dict[str, Any] | None:
    """A DP-SGD trainer's (epsilon, delta) spent so far (worker.dp_sgd), or None for a plain one."""
    spent = getattr(trainer, "privacy_spent", None)
    return spent() if spent is not None else None


@dataclass
class SyncPipeline:
    """One worker's sync steps and what they share; ``worker.federation.FederatedWorker`` builds it and runs them."""

    settings: SyncSettings
    client: CoordinatorClient
    trainer: Trainer
    expert_spec: dict[str, Any]
    """{"lora": ..., "base_model": {"id", "fingerprint"}} (part of a checkpoint's identity)."""
    encoder: UpdateEncoder
    puller: ExpertPuller
    state: ExpertState
    """Where we stand with the expert: version, pulled weights, reference, outbox (changed by these steps only)."""
    interval: IntervalStats
    """Training since the last sync point (the loop adds to it; begin_sync takes it)."""
    links: Links
    """Measured upload and download throughput (what --compression auto decides from)."""
    collective: SingleProcess
    """dist: the data-parallel ranks of this worker; only rank 0 talks to the coordinator."""
    dataset: dict[str, str] | None = None
    """{"path", "sha256"} of the training data: a checkpoint trained on other data is not resumed."""
    secure: SecurePush | None = None
    """With --secure-aggregation: this worker's cohorts (pushes go through them, masked)."""
    placement: PlacementFollower | None = None
    """--follow-placement: moves ``client`` where the root assigns, checked after each pull."""
    pacing: SyncPacing | None = None
    """--comm-share's interval policy, fed each sync's link time (None: a fixed --sync-interval)."""
    early_stopping: BestVersion | None = None
    """--early-stopping-patience: the best pulled version so far; the run stops when its patience runs out."""
    heldout_score: Callable[[StateDict], float] | None = None
    """Held-out loss of given expert weights on this worker's held-out split (needed with ``early_stopping``)."""
    console: SyncConsole | None = None
    on_result: Callable[[dict[str, Any]], None] | None = None
    """Also called with each sync's --results record (e.g. worker.tensorboard_log.TensorBoardLog.sync)."""
    blocked_seconds: float = 0.0
    """Training-thread seconds spent syncing (all syncs of this process)."""
    early_stopped: bool = False
    _writer: CheckpointWriter | None = field(default=None, repr=False)
    _upload_base: UploadPolicy | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._upload_base = self.client.updates.policy  # what upload_policy raises the resumable threshold from

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this worker."""
        identity = {"specialty": self.settings.specialty, "worker_id": self.settings.worker_id,
                    "base_model": self.expert_spec["base_model"],
                    **{k: v for k, v in self.expert_spec.items() if k in ("kind", "lora", "full")}}
        if self.dataset is not None:
            identity["dataset"] = {"sha256": self.dataset["sha256"]}
        return identity

    def checkpoints(self) -> CheckpointWriter:
        """The writer of the state dir's checkpoints (it remembers what the last save wrote)."""
        assert self.settings.state_dir is not None  # only called with a state dir
        if self._writer is None or self._writer.state_dir != self.settings.state_dir:
            self._writer = CheckpointWriter(self.settings.state_dir)
        return self._writer

    def begin_sync(self, final: bool = False) -> SyncJob:
        """Step 1 (training thread): snapshot the adapter and what a checkpoint needs; the next delta starts here."""
        started = time.perf_counter()
        stats = self.interval.take()
        snapshot = self.trainer.adapter_state()
        delta_from = None
        if stats.samples or (final and self.encoder.residual_norm() > 0):  # the final sync flushes the residual
            delta_from, self.state.reference = self.state.reference, snapshot
        record: dict[str, Any] = {"time": time.time(), "sync": self.state.syncs, "final": final, "worker_id": self.settings.worker_id,
                  "base_version": self.state.version, "global_step": self.trainer.global_step}
        self.state.syncs += 1
        checkpoint = (resume.capture(self.identity, self.state, self.trainer, self.encoder, snapshot, self.dataset,
                                     keep_pulled=self.puller.may_pull_diffs)
                      if self.settings.state_dir is not None else None)
        job = SyncJob(record["sync"], final, stats, snapshot, delta_from, checkpoint, record, started=started)
        job.blocked = time.perf_counter() - started
        return job

    def exchange(self, job: SyncJob) -> SyncJob:
        """Steps 2-4, the network part: encode the delta into the outbox, checkpoint, push, pull.

        Runs on the background thread when overlapping; the training thread does not touch the
        state, encoder or links until finish_sync.
        """
        started = time.perf_counter()
        if job.delta_from is not None:
            job.record |= self._encode(job)
        if job.checkpoint is not None:
            job.record["checkpoint_seconds"] = resume.save(self.checkpoints(), job.checkpoint, self.encoder,
                                                           self.state)
        pushing = time.perf_counter()
        job.delivered = job.record["delivered"] = self.push()
        pulling = time.perf_counter()
        job.fetched = self._pull(job) if job.delivered and not job.final else None
        if self.placement is not None and not job.final and self.placement.due():  # after the pull: the next sync
            followed = self.placement.follow()  # goes where the root now says (a move registers there first)
            if followed is not None:
                job.record["placement"] = {"relay_id": followed["relay_id"], "moved": followed["moved"]}
        job.record |= {"pulled": job.fetched is not None, "bytes_down": job.fetched.nbytes if job.fetched else 0,
                       "push_seconds": round(pulling - pushing, 4),
                       "pull_seconds": round(job.fetched.seconds, 4) if job.fetched else 0.0}
        job.background = time.perf_counter() - started
        return job

    def finish_sync(self, job: SyncJob, overlapped: bool) -> dict[str, Any]:
        """Step 5 (training thread): apply what the sync pulled, write its result line."""
        started = time.perf_counter()
        if job.fetched is not None and job.fetched.weights is not None:
            previous = self.state.version
            self.adopt(job.fetched, carry_from=None if job.dropped else job.snapshot)
            if self.state.version != previous:
                job.record |= self.score_version(job.fetched.weights)
        seconds = time.perf_counter() - job.started
        blocked = job.blocked + time.perf_counter() - started if overlapped else seconds
        if self.pacing is not None:  # --comm-share: the link time of this sync paces the next ones
            self.pacing.observe(job.record.get("push_seconds", 0.0) + job.record.get("pull_seconds", 0.0))
            job.record["next_interval"] = round(self.pacing.interval, 3)
        self.blocked_seconds += blocked
        record = job.record | {"version": self.state.version, "outbox": len(self.state.outbox),
                               "sync_seconds": round(seconds, 4), "blocked_seconds": round(blocked, 4),
                               "background_seconds": round(job.background if overlapped else 0.0, 4),
                               "steps_during_sync": self.interval.steps}
        self._write_result(record)
        if self.console is not None:
            self.console.on_sync(record)
        return record

    def _encode(self, job: SyncJob) -> dict[str, Any]:
        """Step 2: turn the job's interval into an outgoing update; returns its metrics."""
        stats, snapshot, delta_from = job.stats, job.snapshot, job.delta_from
        assert delta_from is not None  # exchange encodes only a job with a delta
        delta = {k: snapshot[k] - delta_from[k] for k in snapshot}
        manifest = manifest_of(delta)
        decision = self._choose_push(delta) if self.encoder.settings.adaptive and not job.final else None
        try:
            encoded = self.encoder.encode(delta, manifest, seed=job.number, flush=job.final,
                                          choice=decision.choice if decision else None)
        except CompressionError as exc:  # e.g. training diverged to NaN: skip it, resync from the expert
            log.error("cannot encode this interval's update (%s); dropping it and the carried residual", exc)
            self.encoder.reset()
            self.state.etag = None  # force a full pull, replacing the local weights
            job.dropped = True
            return {"dropped": True}
        meta = {"update_id": f"{self.settings.worker_id}-{uuid.uuid4().hex[:16]}",
                "base_version": job.record["base_version"], "num_samples": stats.samples,
                "train_loss": stats.loss, "worker_id": self.settings.worker_id, **encoded.codec_meta}
        privacy = privacy_claim(self.trainer)
        if privacy is not None:  # --dp-sgd: the epsilon spent so far travels with the update and into --results
            meta["privacy"] = privacy
        adaptive = {}
        if decision is not None:
            adaptive = {"push_choice": decision.record()}
            meta["codec_choice"] = {"by": "auto", "sync_budget": self.encoder.settings.sync_budget,
                                    "upload_bytes_per_second": round(decision.bytes_per_second, 1)}
            log.info("sync %d: --compression auto picked %s %s for ~%d bytes (upload %.0f B/s, budget %.3g s%s)",
                     job.number, encoded.codec_meta["codec"], json.dumps(encoded.codec_meta["codec_config"]),
                     len(encoded.body), decision.bytes_per_second, self.encoder.settings.sync_budget,
                     "" if decision.fits else ", cannot fit: smallest codec")
        self.state.outbox.append(Outgoing(encoded.body, meta))
        m = encoded.metrics
        log.debug("sync %d: %d steps, loss %.4f, %.0f tokens/s; update %d bytes (%.1fx smaller than fp32)",
                  job.number, stats.steps, stats.loss or float("nan"), stats.tokens_per_second,
                  m["bytes_sent"], m["ratio"])
        return {"steps": stats.steps, "samples": stats.samples, "tokens": stats.tokens, "train_loss": stats.loss,
                "train_seconds": round(stats.seconds, 4), "throttle_seconds": round(stats.throttled, 4),
                "tokens_per_second": round(stats.tokens_per_second, 2),
                "compute_tokens_per_second": round(stats.tokens / max(stats.seconds, 1e-9), 2),
                "update_id": meta["update_id"], "codec": meta["codec"], "codec_config": meta["codec_config"],
                **({"privacy": privacy} if privacy is not None else {}), **adaptive, **m}

    def _choose_push(self, delta: StateDict) -> Decision:
        numel = sum(t.numel() for t in delta.values())
        budget = self.encoder.settings.sync_budget
        assert budget is not None  # --compression auto (adaptive) requires --sync-budget
        # a per-worker seed: workers at the same sync number must not keep the same random-k entries
        return choose_push(numel, len(delta), budget, self.links.up,
                           seed=zlib.crc32(self.settings.worker_id.encode()))

    def push(self) -> bool:
        """Step 3: push queued updates in order; False if the coordinator is unreachable (kept for later)."""
        outbox = self.state.outbox
        if self.secure is not None:  # all of them as one masked input, when our cohort takes inputs
            return self.secure.push(outbox, self.manifest())
        while outbox:
            update = outbox[0]
            if self._upload_base is not None:  # one request where the measured link carries it within ~2 s
                self.client.updates.policy = upload_policy(self._upload_base, self.links.up)
            started = time.perf_counter()
            try:
                self.client.updates.push(self.settings.specialty, update.body, update.meta)
            except Unavailable as exc:
                log.warning("%s; keeping %d update(s) queued and training on", exc, len(outbox))
                return False
            except FedMoEError as exc:  # refused for good (e.g. NaN after divergence): drop, resync
                log.error("coordinator refused update %s: %s; dropping it", update.meta["update_id"], exc)
            else:
                self.links.up.observe(len(update.body), time.perf_counter() - started)
            outbox.popleft()
        return True

    def manifest(self) -> list[tuple[str, tuple[int, ...]]]:
        """The adapter's tensor names and shapes (what a masked push is laid out by)."""
        return manifest_of(self.state.reference or self.trainer.adapter_state())

    def _pull(self, job: SyncJob) -> Fetched | None:
        """Step 4: the expert's latest weights (unreachable coordinator: logged, None); sends a heartbeat."""
        try:
            fetched = self.fetch()
        except Unavailable as exc:
            log.warning("%s; training on from local weights", exc)
            return None
        if fetched.diff_codec is not None:
            job.record["pull_codec"] = fetched.diff_codec
        self._heartbeat()
        return fetched

    def fetch(self) -> Fetched:
        """The expert's latest weights, full or a diff (worker.pulling), timed into the download estimate."""
        fetched = self.puller.fetch(self.state, self.puller.next_diff(self.state, self.links.down))
        if fetched.nbytes and fetched.weights is not None:
            self.links.down.observe(fetched.nbytes, fetched.seconds)
        return fetched

    def share_weights(self) -> None:
        """dist: every data-parallel rank continues from the weights rank 0 holds (no-op in one process)."""
        if self.collective.world_size > 1:
            self.trainer.share_primary_weights()

    def adopt(self, fetched: Fetched, carry_from: StateDict | None = None) -> None:
        """Take the expert's weights W plus our undelivered residual r; with ``carry_from`` keep what was
        trained since: W + r + (local - carry_from). The next delta is measured from W + r."""
        weights = fetched.weights
        assert weights is not None  # callers adopt only a pull that brought weights
        residual = self.encoder.carried()
        ours = local = {k: weights[k] + residual[k] for k in weights} if residual else weights
        if carry_from is not None and self.interval.steps:
            now = self.trainer.adapter_state()
            carried = {k: ours[k] + (now[k] - carry_from[k]) for k in weights}
            if all(bool(torch.isfinite(v).all()) for v in carried.values()):
                local = carried
            else:  # diverged meanwhile: start over from the expert, forget that training
                log.error("local training diverged while syncing; continuing from the expert's weights")
                self.interval.reset()
        self.trainer.load_adapter_state(local)
        self.state.adopt(weights, ours, fetched.version, fetched.etag)

    def score_version(self, weights: StateDict) -> dict[str, Any]:
        """--early-stopping-patience: score a newly pulled version on our held-out split; its --results fields."""
        if self.early_stopping is None or self.heldout_score is None:
            return {}
        loss = self.heldout_score(weights)
        self.early_stopped = self.early_stopping.observe(self.state.version, loss)
        return {"heldout_loss": loss, **self.early_stopping.record()}

    def _heartbeat(self) -> None:
        try:
            self.client.workers.heartbeat(self.settings.worker_id)
        except FedMoEError as exc:  # liveness is best effort; the next sync tries again
            log.debug("heartbeat failed: %s", exc)

    def _write_result(self, record: dict[str, Any]) -> None:
        if self.on_result is not None:
            self.on_result(record)
        path = self.settings.results_path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
