"""The worker's federated loop: train, and every interval push the delta and pull the expert.

Exactly-once delivery without losing work: every interval's delta (local
weights minus the weights it was computed from) goes into an *outbox* with a
fresh ``update_id``. The outbox is flushed in order at each sync; a push that
fails for lack of a coordinator stays queued (same id, same bytes) and training
goes on, so when the coordinator is back every delta arrives once, however
many retries it took. Only after the outbox is empty do we pull the latest
expert weights and continue from them.

Overlapped sync. A sync is a ``SyncJob`` (worker.sync_state) handed through five steps, begin ->
encode -> push -> pull -> apply, in three parts so that training need not wait for the network:

- ``begin_sync`` (training thread, at a step boundary): snapshot the adapter; the next delta is
  measured from that snapshot; capture what a checkpoint needs (optimiser moments, data position).
- ``exchange`` (a background thread while training goes on): encode the delta into the outbox,
  save the checkpoint, push the outbox, pull the expert (``worker.pulling``). This is *the*
  network part of a sync. Where this worker stands with its expert (version, pulled weights,
  reference, outbox) is one ``ExpertState``, which only these steps change.
- ``finish_sync`` (training thread, at the first step boundary after ``exchange`` ended): adopt
  the pulled weights W as ``W + r + (local_now - snapshot)``, so steps taken meanwhile are kept, and
  measure the next delta from ``W + r``, so they are sent once (in the next update).

Error feedback. ``r`` is the residual a lossy codec has not delivered yet (worker.encoding). It is
training the coordinator lacks, so the local weights keep it (``W + r``): with one worker and
FedAsync at server_lr 1 the local weights follow exactly the path of local training, and the
coordinator's weights trail them by r. (Adopting bare W instead threw r out of the local model,
so training learned it again while the encoder still owed it: the residual grew every sync.)
The final sync is a *flush*: delta + r sent losslessly (worker.encoding), so the coordinator ends
with the weights local training reached.

Adaptive compression (``--compression auto --sync-budget S``): the encode step picks the codec of
each update from the measured upload throughput and the pull step chooses full weights or a
compressed diff from the download throughput (worker.adaptive); every push and pull is timed.

One sync is in flight at a time: a sync that falls due meanwhile starts when the previous one
ends. ``sync()`` runs the three parts in a row; the final sync (duration over, or Ctrl-C) does.

Checkpoint and resume. With a state dir, ``exchange`` saves a checkpoint (worker.checkpoint)
*before* it pushes: adapter, reference, pulled weights, error-feedback residual, optimiser state,
data position, counters and the outbox with its update ids. A worker killed at any moment and
started again resumes from its last checkpoint: updates it had queued are pushed again under the
same ids (the coordinator applies an id once), and the training after the checkpoint was never
pushed, so it is redone rather than counted twice. A checkpoint is written at every sync, so it
writes only what a resume needs and nothing twice (worker.checkpoint's ``CheckpointWriter``: the
reference is an alias of the snapshot, the pulled weights are kept only by a worker that pulls diffs).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from compression.errors import CompressionError
from protocol.client import CoordinatorClient
from protocol.errors import BadRequest, FedMoEError, NotFound, Unavailable
from protocol.tensors import StateDict, manifest_of
from protocol.uploads import UploadPolicy
from worker import resume
from worker.adaptive import Decision, LinkEstimate, SyncPacing, choose_push, probe_upload, upload_policy
from worker.checkpoint import CheckpointError, CheckpointWriter, discard_checkpoint, load_checkpoint
from worker.console import SyncConsole
from worker.data import StreamPosition
from worker.distributed import SingleProcess
from worker.early_stopping import BestVersion
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder, default_pull
from worker.placement import PlacementFollower
from worker.pulling import ExpertPuller
from worker.secure_push import SecurePush
from worker.stopping import STOP
from worker.sync_state import ExpertState, Fetched, IntervalStats, Outgoing, RunSummary, SyncJob

log = logging.getLogger(__name__)


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


def privacy_claim(trainer: Trainer) -> dict[str, Any] | None:
    """A DP-SGD trainer's (epsilon, delta) spent so far (worker.dp_sgd), or None for a plain one."""
    spent = getattr(trainer, "privacy_spent", None)
    return spent() if spent is not None else None


@dataclass(frozen=True)
class SyncSettings:
    specialty: str
    """Expert this worker trains."""
    worker_id: str
    duration: float = 3600.0
    """Seconds to run before the final push."""
    max_steps: int | None = None
    """Optimiser steps to train before the final push (Hugging Face Trainer's ``max_steps``), counted over the
    whole run, a resumed checkpoint's steps included; the run ends at ``max_steps`` or ``duration``, whichever
    comes first. None: ``duration`` alone decides."""
    sync_interval: float = 10.0
    """Seconds of training between syncs."""
    speed_factor: float = 1.0
    """Relative speed in (0, 1]: 0.5 sleeps as long as each step took, simulating a slower machine."""
    steps_per_check: int = 1
    """Training steps between clock checks."""
    results_path: Path | None = None
    """Append one JSON line per sync here."""
    state_dir: Path | None = None
    """Checkpoint here at every sync and resume from here (None: no checkpoints)."""
    resume: bool = True
    """Resume from the checkpoint in state_dir if there is one; False discards it (--fresh)."""
    overlap: bool = True
    """Push and pull on a background thread while training goes on (False: training waits)."""
    comm_share: float | None = None
    """Stretch the sync interval so that pushing and pulling take at most this share of the worker's time
    (worker.adaptive.SyncPacing; None: sync every ``sync_interval``)."""
    secure_aggregation: bool = False
    """Push through secure-aggregation cohorts, masked (worker.secure_push); the coordinator sees only sums."""

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        if not self.sync_interval > 0:
            raise ValueError(f"--sync-interval must be > 0 seconds, got {self.sync_interval}")
        if not 0 < self.speed_factor <= 1:
            raise ValueError(f"--speed-factor must be in (0, 1] (1 = full speed), got {self.speed_factor}")
        if self.comm_share is not None and not 0 < self.comm_share < 1:
            raise ValueError(f"--comm-share must be in (0, 1), got {self.comm_share}")


@dataclass
class Links:
    """Measured throughput each way (--compression auto): every push and pull is timed into it."""

    up: LinkEstimate = field(default_factory=LinkEstimate)
    down: LinkEstimate = field(default_factory=LinkEstimate)


@dataclass
class FederatedWorker:
    settings: SyncSettings
    client: CoordinatorClient
    trainer: Trainer
    expert_spec: dict[str, Any]
    """{"lora": ..., "base_model": {"id", "fingerprint"}} sent when creating the expert."""
    encoder: UpdateEncoder = field(default_factory=lambda: UpdateEncoder(CompressionSettings()))
    pull: PullSettings | None = None
    """How to pull (full weights or compressed diffs); None: what goes with the encoder's codec
    (worker.encoding.default_pull: int8 diffs, or picked at each sync under --compression auto)."""
    state: ExpertState = field(default_factory=ExpertState)
    """Where we stand with the expert: version, pulled weights, reference, outbox (changed by the sync steps)."""
    profile: dict[str, Any] | None = None
    """Routing summary of our training prompts (protocol.profiles), sent when joining."""
    interval: IntervalStats = field(default_factory=IntervalStats)
    """Training since the last sync point (what the next update will carry)."""
    console: SyncConsole | None = None
    """Progress bar and the one log line per sync (worker.console); None: no console output."""
    on_result: Callable[[dict[str, Any]], None] | None = None
    """Also called with each sync's --results record (e.g. worker.tensorboard_log.TensorBoardLog.sync)."""
    totals: IntervalStats = field(default_factory=IntervalStats)
    """All training steps of this process."""
    blocked_seconds: float = 0.0
    """Training-thread seconds spent syncing (all syncs of this process)."""
    links: Links = field(default_factory=Links)
    """Measured upload and download throughput (what --compression auto decides from)."""
    _inflight: tuple[SyncJob, Future] | None = field(default=None, repr=False)
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    collective: SingleProcess = field(default_factory=SingleProcess)
    """dist: the data-parallel ranks of this worker; only rank 0 talks to the coordinator."""
    dataset: dict[str, str] | None = None
    """{"path", "sha256"} of the training data: a checkpoint trained on other data is not resumed."""
    _writer: CheckpointWriter | None = field(default=None, repr=False)
    _upload_base: UploadPolicy | None = field(default=None, repr=False)
    placement: PlacementFollower | None = None
    """--follow-placement: reports this worker's links to the root and moves ``client`` where the root assigns."""
    pacing: SyncPacing | None = field(default=None, repr=False)
    """--comm-share's interval policy (set from the settings; None: a fixed --sync-interval)."""
    early_stopping: BestVersion | None = None
    """--early-stopping-patience: the best pulled version so far; the run stops when its patience runs out."""
    heldout_score: Callable[[StateDict], float] | None = None
    """Held-out loss of given expert weights on this worker's held-out split (needed with ``early_stopping``)."""
    early_stopped: bool = False
    secure: SecurePush | None = field(default=None, repr=False)
    """With --secure-aggregation: this worker's cohorts (pushes go through them, masked)."""

    def __post_init__(self) -> None:
        self._upload_base = self.client.upload  # what upload_policy raises the resumable threshold from
        s = self.settings
        self.pacing = SyncPacing(s.sync_interval, s.comm_share) if s.comm_share is not None else None
        if self.settings.secure_aggregation and self.secure is None:
            self.secure = SecurePush(self.client, self.settings.specialty, self.settings.worker_id)
        pull = self.pull if self.pull is not None else default_pull(self.encoder.settings)
        self.puller = ExpertPuller(self.client, self.settings.specialty, self.settings.worker_id, pull,
                                   self.encoder.settings.sync_budget)

    @property
    def base_version(self) -> int:
        """Expert version our weights came from."""
        return self.state.version

    @property
    def outbox(self):
        return self.state.outbox

    @property
    def syncs(self) -> int:
        return self.state.syncs

    # joining ------------------------------------------------------------------

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this worker."""
        identity = {"specialty": self.settings.specialty, "worker_id": self.settings.worker_id,
                    "base_model": self.expert_spec["base_model"],
                    **{k: v for k, v in self.expert_spec.items() if k in ("kind", "lora", "full")}}
        if self.dataset is not None:
            identity["dataset"] = {"sha256": self.dataset["sha256"]}
        return identity

    def join(self) -> dict[str, Any]:
        """Resume a checkpoint if any, register, create the expert if we are its first worker, pull it."""
        s = self.settings
        if not self.collective.is_primary:  # dist: rank 0 joins; we start from the weights it pulled
            self._share_weights()
            return {}
        resumed = self._resume()
        self.client.register_worker(s.worker_id, s.specialty, self.expert_spec["base_model"], s.sync_interval)
        if self.placement is not None:  # its reports go to the root under this worker's own token there
            self.placement.root.register_worker(s.worker_id, s.specialty, self.expert_spec["base_model"],
                                                s.sync_interval)
            self.placement.follow()  # before the first pull: the worker starts at the coordinator the root assigns
        info = self._join_expert()
        if resumed and info["version"] < self.state.version:
            self._forget_history(info["version"])
        if self.profile is not None:
            self.client.put_profile(s.specialty, s.worker_id, self.profile)
        if self.secure is not None:
            self.secure.start()  # joins a cohort now: keys and shares are exchanged while we train
        elif self.state.outbox and not self._push():
            raise Unavailable("cannot deliver the updates saved in the checkpoint; is the coordinator up?")
        if self.encoder.settings.adaptive and not self.links.up.observed:
            self._probe_upload()
        fetched = self._fetch()
        if fetched.weights is not None:
            self._adopt(fetched)
            self._score_version(fetched.weights)
        self._share_weights()
        log.info("joined expert %s at version %d as %s", s.specialty, self.state.version, s.worker_id)
        return info

    def _join_expert(self) -> dict[str, Any]:
        """Create the expert from our adapter if it does not exist; else only check our setup against it.

        An existing expert is pulled, not uploaded to: the PUT carries an empty adapter, which the
        coordinator ignores once it has checked that rank, base model etc. match (409 if not).
        """
        name = self.settings.specialty
        try:
            self.client.expert(name)
        except NotFound:
            return self.client.create_expert(name, self.trainer.adapter_state(), self.expert_spec)
        try:
            return self.client.create_expert(name, {}, self.expert_spec)
        except BadRequest:  # a coordinator that checks the body before looking the expert up
            return self.client.create_expert(name, self.trainer.adapter_state(), self.expert_spec)

    def _probe_upload(self) -> None:
        """--compression auto: time an upload probe or two, so the first push is sized from the link."""
        s, budget = self.settings, self.encoder.settings.sync_budget
        assert budget is not None  # --compression auto requires --sync-budget
        try:
            update_bytes = 4 * sum(t.numel() for t in self.trainer.adapter_state().values())
            self.links.up = probe_upload(lambda n: self.client.probe_upload(n, s.worker_id, s.specialty), budget,
                                         update_bytes)
        except FedMoEError as exc:  # e.g. a coordinator from before POST /probe: the first pushes start small
            log.info("no upload probe (%s); --compression auto starts from %.0f B/s", exc,
                     self.links.up.bytes_per_second)
            return
        if self.links.up.observed:
            log.info("upload link: %.2f MB/s measured with a %d-byte probe", self.links.up.bytes_per_second / 1e6,
                     self.links.up.largest)
        else:
            log.info("upload link: too slow for a probe within half the budget; pushes start from %.0f B/s",
                     self.links.up.bytes_per_second)

    def _resume(self) -> bool:
        """Load the checkpoint in the state dir into trainer, encoder and loop; False if there is none."""
        s = self.settings
        if s.state_dir is None:
            return False
        if s.state_dir.exists() and not s.state_dir.is_dir():
            raise CheckpointError(f"--state-dir {s.state_dir} is a file; give a directory for the worker's checkpoints")
        if not s.resume:
            if dropped := discard_checkpoint(s.state_dir):
                log.warning("--fresh: discarded the checkpoint in %s and its %d undelivered update(s)",
                            s.state_dir, dropped)
            return False
        checkpoint = load_checkpoint(s.state_dir, self.identity)
        if checkpoint is None:
            return False
        self.state = resume.restore(checkpoint, self.trainer, self.encoder, s.state_dir)
        self._checkpoints().remember(checkpoint)  # what is on disk need not be written again
        log.warning("resuming the checkpoint in %s (sync %d, step %d, expert version %d, %d queued update(s)%s); "
                    "pass --fresh to start over", s.state_dir, self.state.syncs, self.trainer.global_step,
                    self.state.version, len(self.state.outbox),
                    resume.codec_change(checkpoint.progress.get("codec"), self.encoder))
        return True

    def _checkpoints(self) -> CheckpointWriter:
        """The writer of the state dir's checkpoints (it remembers what the last save wrote)."""
        assert self.settings.state_dir is not None  # only called with a state dir
        if self._writer is None or self._writer.state_dir != self.settings.state_dir:
            self._writer = CheckpointWriter(self.settings.state_dir)
        return self._writer

    def _forget_history(self, version: int) -> None:
        """The coordinator lacks the versions our checkpoint builds on (a new data dir?): start from it.

        Our queued updates and error-feedback residual are deltas on versions it never had, so they
        are dropped (if the expert was just created, it was created from our adapter, which already
        contains them).
        """
        log.warning("the coordinator has expert %s at version %d, behind this worker's checkpoint (version %d): "
                    "dropping %d queued update(s) and starting from the coordinator's weights",
                    self.settings.specialty, version, self.state.version, len(self.state.outbox))
        self.state.forget_history(version)
        self.encoder.reset()

    # the loop -----------------------------------------------------------------

    def run(self) -> RunSummary:
        """Train and sync until ``duration`` is over, ``max_steps`` are taken or Ctrl-C; always ends with a final push."""
        s = self.settings
        started, cpu_started = time.monotonic(), time.process_time()
        end, due = started + s.duration, started + self.sync_interval
        steps_before, tokens_before, blocked_before = self.totals.steps, self.totals.tokens, self.blocked_seconds
        STOP.arm()  # a signal now stops at the next step boundary (worker.stopping)
        at_once = False
        try:
            while not self.collective.agree(time.monotonic() >= end or STOP.requested or self.steps_left() == 0
                                            or self.early_stopped):
                self.train_step()  # dist: rank 0 decides when to stop (the ranks' step counts are the same)
                if self.totals.steps - steps_before == self.settings.steps_per_check:  # a sign of life (and a test's cue)
                    log.info("training: the first %d step(s) of this run are done", self.settings.steps_per_check)
                self.poll_sync()
                if self.collective.agree(time.monotonic() >= due) and self._inflight is None:
                    self.start_sync() if s.overlap else self.sync()
                    due = time.monotonic() + self.sync_interval
        except KeyboardInterrupt:
            # A second signal ("send it again to stop at once") lands wherever Python is, maybe inside an optimiser
            # step: pushing now would send a half-applied step under the previous step's accounting (audit,
            # tests/e2e/test_audit_stopping.py). Stop without the final push; the last sync's checkpoint resumes.
            at_once = STOP.requested
            if at_once:
                log.warning("stopped at once by a second signal: training since the last sync is not pushed; "
                            "a restart resumes from the last checkpoint")
                raise
            log.info("interrupted: pushing what was trained before exiting")
        finally:  # a first signal from here on is a no-op: the final push is what it asks for
            summary = RunSummary(time.monotonic() - started, time.process_time() - cpu_started,
                                 self.totals.steps - steps_before, self.totals.tokens - tokens_before,
                                 self.blocked_seconds - blocked_before, self.state.syncs)
            try:
                if not at_once:
                    self.wait_sync()
                    self.sync(final=True)
                    if self.secure is not None:  # stay for the cohort: leaving after masking costs it a recovery
                        self.secure.finish(self.state.outbox, self._manifest())
                        self.secure.close()
                    self._report_undelivered()
            finally:
                STOP.disarm()
        return summary

    @property
    def sync_interval(self) -> float:
        """Seconds from this sync's start to the next's: --sync-interval, stretched by --comm-share's pacing."""
        return self.pacing.interval if self.pacing is not None else self.settings.sync_interval

    def steps_left(self) -> int | None:
        """Optimiser steps still to take under ``max_steps`` (None: no step limit)."""
        if self.settings.max_steps is None:
            return None
        return max(0, self.settings.max_steps - self.trainer.global_step)

    def train_step(self) -> None:
        """Train ``steps_per_check`` steps, fewer if ``max_steps`` is that close (the loop's per-step point)."""
        left = self.steps_left()
        stats = self.trainer.train_steps(self.settings.steps_per_check if left is None
                                         else min(left, self.settings.steps_per_check))
        self.interval.add(stats)
        self.totals.add(stats)
        if self.console is not None:
            self.console.on_train_chunk(self.interval)
        if self.settings.speed_factor < 1:  # a slower machine: the sleep counts in tokens/s (IntervalStats)
            pause = stats.seconds * (1 / self.settings.speed_factor - 1)
            time.sleep(pause)
            self.interval.throttled += pause
            self.totals.throttled += pause

    def _report_undelivered(self) -> None:
        if not self.state.outbox:
            return
        if self.settings.state_dir is not None:
            log.warning("%d update(s) could not be delivered before exit (coordinator unreachable); they are saved "
                        "in %s and will be pushed when this worker starts again", len(self.state.outbox),
                        self.settings.state_dir)
        else:
            log.error("%d update(s) could not be delivered before exit (coordinator unreachable); "
                      "their training is lost", len(self.state.outbox))

    # a sync: begin -> encode -> push -> pull -> apply, one SyncJob handed along ---------------

    def sync(self, final: bool = False) -> dict[str, Any]:
        """A whole sync, waiting for the network (the final sync, tests, --no-overlap, data parallel)."""
        if not self.collective.is_primary:  # dist: rank 0 pushes the ranks' common update and pulls for all
            self.interval = IntervalStats()
            self._share_weights()
            return {}
        self.wait_sync()
        job = self.begin_sync(final)
        record = self.finish_sync(self.exchange(job), overlapped=False)
        self._share_weights()
        return record

    def start_sync(self) -> None:
        """Begin a sync and leave its exchange to the background thread."""
        if self._inflight is not None:
            raise RuntimeError("a sync is already in flight")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmoe-sync")
        job = self.begin_sync()
        self._inflight = job, self._executor.submit(self.exchange, job)

    def poll_sync(self) -> dict[str, Any] | None:
        """Finish the background sync if it is done (call at a step boundary); its record, or None."""
        if self._inflight is None or not self._inflight[1].done():
            return None
        return self.wait_sync()

    def wait_sync(self) -> dict[str, Any] | None:
        """Wait for the background sync, if any, and finish it; its record, or None."""
        if self._inflight is None:
            return None
        job, future = self._inflight
        started = time.perf_counter()
        try:
            future.result()
        except Exception:
            self._inflight = None
            raise
        # (Ctrl-C/SIGTERM meanwhile leaves the job in flight: the exchange goes on, and run() waits for it
        # again before the final sync, which must not encode or push alongside it.)
        self._inflight = None
        job.blocked += time.perf_counter() - started
        return self.finish_sync(job, overlapped=True)

    def begin_sync(self, final: bool = False) -> SyncJob:
        """Step 1 (training thread): snapshot the adapter and what a checkpoint needs; the next delta starts here."""
        started = time.perf_counter()
        stats, self.interval = self.interval, IntervalStats()
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
            job.record["checkpoint_seconds"] = resume.save(self._checkpoints(), job.checkpoint, self.encoder,
                                                           self.state)
        pushing = time.perf_counter()
        job.delivered = job.record["delivered"] = self._push()
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
            self._adopt(job.fetched, carry_from=None if job.dropped else job.snapshot)
            if self.state.version != previous:
                job.record |= self._score_version(job.fetched.weights)
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

    def _push(self) -> bool:
        """Step 3: push queued updates in order; False if the coordinator is unreachable (kept for later)."""
        outbox = self.state.outbox
        if self.secure is not None:  # all of them as one masked input, when our cohort takes inputs
            return self.secure.push(outbox, self._manifest())
        while outbox:
            update = outbox[0]
            if self._upload_base is not None:  # one request where the measured link carries it within ~2 s
                self.client.upload = upload_policy(self._upload_base, self.links.up)
            started = time.perf_counter()
            try:
                self.client.push_update(self.settings.specialty, update.body, update.meta)
            except Unavailable as exc:
                log.warning("%s; keeping %d update(s) queued and training on", exc, len(outbox))
                return False
            except FedMoEError as exc:  # refused for good (e.g. NaN after divergence): drop, resync
                log.error("coordinator refused update %s: %s; dropping it", update.meta["update_id"], exc)
            else:
                self.links.up.observe(len(update.body), time.perf_counter() - started)
            outbox.popleft()
        return True

    def _manifest(self) -> list[tuple[str, tuple[int, ...]]]:
        return manifest_of(self.state.reference or self.trainer.adapter_state())

    # pulling and applying -----------------------------------------------------

    def _pull(self, job: SyncJob) -> Fetched | None:
        """Step 4: the expert's latest weights (unreachable coordinator: logged, None); sends a heartbeat."""
        try:
            fetched = self._fetch()
        except Unavailable as exc:
            log.warning("%s; training on from local weights", exc)
            return None
        if fetched.diff_codec is not None:
            job.record["pull_codec"] = fetched.diff_codec
        self._heartbeat()
        return fetched

    def _fetch(self) -> Fetched:
        fetched = self.puller.fetch(self.state, self.puller.next_diff(self.state, self.links.down))
        if fetched.nbytes and fetched.weights is not None:
            self.links.down.observe(fetched.nbytes, fetched.seconds)
        return fetched

    def _share_weights(self) -> None:
        """dist: every data-parallel rank continues from the weights rank 0 holds (no-op in one process)."""
        if self.collective.world_size > 1:
            self.trainer.share_primary_weights()

    def _adopt(self, fetched: Fetched, carry_from: StateDict | None = None) -> None:
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
                self.interval = IntervalStats()
        self.trainer.load_adapter_state(local)
        self.state.adopt(weights, ours, fetched.version, fetched.etag)

    def _score_version(self, weights: StateDict) -> dict[str, Any]:
        """--early-stopping-patience: score a newly pulled version on our held-out split; its --results fields."""
        if self.early_stopping is None or self.heldout_score is None:
            return {}
        loss = self.heldout_score(weights)
        self.early_stopped = self.early_stopping.observe(self.state.version, loss)
        return {"heldout_loss": loss, **self.early_stopping.record()}

    def _heartbeat(self) -> None:
        try:
            self.client.heartbeat(self.settings.worker_id)
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
