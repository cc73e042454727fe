"""The worker's federated loop: train, and every interval push the delta and pull the expert.

Its parts: worker.joining (joining the expert, resuming a checkpoint), worker.sync_pipeline (the steps of a
sync), worker.sync_state (what they share) and worker.sync_settings (the flags).

Exactly-once delivery without losing work: every interval's delta (local
weights minus the weights it was computed from) goes into an *outbox* with a
fresh ``update_id``. The outbox is flushed in order at each sync; a push that
fails for lack of a coordinator stays queued (same id, same bytes) and training
goes on, so when the coordinator is back every delta arrives once, however
many retries it took. Only after the outbox is empty do we pull the latest
expert weights and continue from them.

Overlapped sync. A sync is a ``SyncJob`` (worker.sync_state) handed through five steps, begin ->
encode -> push -> pull -> apply, in three parts so that training need not wait for the network:

- ``SyncPipeline.begin_sync`` (training thread, at a step boundary): snapshot the adapter; the next delta is
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

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, Callable

from protocol.client import CoordinatorClient
from protocol.tensors import StateDict
from worker.adaptive import SyncPacing
from worker.console import SyncConsole
from worker.distributed import SingleProcess
from worker.early_stopping import BestVersion
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder, default_pull
from worker.joining import Joining
from worker.placement import PlacementFollower
from worker.pulling import ExpertPuller
from worker.secure_push import SecurePush
from worker.stopping import STOP
from worker.sync_pipeline import SyncPipeline
from worker.sync_settings import SyncSettings
from worker.sync_state import ExpertState, IntervalStats, Links, RunSummary, SyncJob, Trainer

__all__ = ["FederatedWorker", "SyncSettings"]  # SyncSettings lives in worker.sync_settings; imported from here too

log = logging.getLogger(__name__)


@dataclass
class FederatedWorker:
    """The loop: train, and sync at every interval (``joining.join()`` first; ``run()`` until done).

    Its parts: ``joining`` (worker.joining) joins the expert once; ``pipeline`` (worker.sync_pipeline) runs the
    steps of a sync. The state, interval, links and secure push are objects the loop and the parts share; the
    fields marked "read once" go to the parts when the worker is built (setting them later changes nothing);
    ``retune`` changes the settings of the loop and the parts together.
    """

    settings: SyncSettings
    client: CoordinatorClient
    trainer: Trainer
    expert_spec: dict[str, Any]
    """{"lora": ..., "base_model": {"id", "fingerprint"}} sent when creating the expert."""
    encoder: UpdateEncoder = field(default_factory=lambda: UpdateEncoder(CompressionSettings()))
    pull: InitVar[PullSettings | None] = None
    """How to pull (full weights or compressed diffs); None: what goes with the encoder's codec
    (worker.encoding.default_pull: int8 diffs, or picked at each sync under --compression auto). Read once."""
    state: ExpertState = field(default_factory=ExpertState)
    """Where we stand with the expert: version, pulled weights, reference, outbox (changed by the sync steps)."""
    profile: InitVar[dict[str, Any] | None] = None
    """Routing summary of our training prompts (protocol.profiles), sent when joining. Read once."""
    interval: IntervalStats = field(default_factory=IntervalStats)
    """Training since the last sync point (what the next update will carry)."""
    console: SyncConsole | None = None
    """Progress bar and the one log line per sync (worker.console); None: no console output."""
    on_result: InitVar[Callable[[dict[str, Any]], None] | None] = None
    """Also called with each sync's --results record (e.g. worker.tensorboard_log.TensorBoardLog.sync). Read once."""
    totals: IntervalStats = field(default_factory=IntervalStats)
    """All training steps of this process."""
    links: Links = field(default_factory=Links)
    """Measured upload and download throughput (what --compression auto decides from)."""
    _inflight: tuple[SyncJob, Future] | None = field(default=None, repr=False)
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    collective: SingleProcess = field(default_factory=SingleProcess)
    """dist: the data-parallel ranks of this worker; only rank 0 talks to the coordinator."""
    dataset: InitVar[dict[str, str] | None] = None
    """{"path", "sha256"} of the training data: a checkpoint trained on other data is not resumed. Read once."""
    placement: InitVar[PlacementFollower | None] = None
    """--follow-placement: reports this worker's links to the root and moves ``client`` where the root assigns.
    Read once."""
    pacing: SyncPacing | None = field(default=None, repr=False)
    """--comm-share's interval policy (set from the settings; None: a fixed --sync-interval)."""
    early_stopping: InitVar[BestVersion | None] = None
    """--early-stopping-patience: the best pulled version so far; the run stops when its patience runs out.
    Read once."""
    heldout_score: InitVar[Callable[[StateDict], float] | None] = None
    """Held-out loss of given expert weights on this worker's held-out split (needed with ``early_stopping``).
    Read once."""
    secure: SecurePush | None = field(default=None, repr=False)
    """With --secure-aggregation: this worker's cohorts (pushes go through them, masked)."""
    pipeline: SyncPipeline = field(init=False, repr=False)
    """The steps of a sync (worker.sync_pipeline)."""
    joining: Joining = field(init=False, repr=False)
    """Joining the expert, once before ``run`` (worker.joining)."""

    def __post_init__(self, pull: PullSettings | None, profile: dict[str, Any] | None,
                      on_result: Callable[[dict[str, Any]], None] | None, dataset: dict[str, str] | None,
                      placement: PlacementFollower | None, early_stopping: BestVersion | None,
                      heldout_score: Callable[[StateDict], float] | None) -> None:
        s = self.settings
        self.pacing = SyncPacing(s.sync_interval, s.comm_share) if s.comm_share is not None else None
        if self.settings.secure_aggregation and self.secure is None:
            self.secure = SecurePush(self.client, self.settings.specialty, self.settings.worker_id,
                                     min_dp_noise=self.settings.min_dp_noise)
        pull = pull if pull is not None else default_pull(self.encoder.settings)
        puller = ExpertPuller(self.client, self.settings.specialty, self.settings.worker_id, pull,
                              self.encoder.settings.sync_budget)
        self.pipeline = SyncPipeline(s, self.client, self.trainer, self.expert_spec, self.encoder, puller,
                                     self.state, self.interval, self.links, self.collective, dataset=dataset,
                                     secure=self.secure, placement=placement, pacing=self.pacing,
                                     early_stopping=early_stopping, heldout_score=heldout_score,
                                     console=self.console, on_result=on_result)
        self.joining = Joining(self.pipeline, profile)

    def retune(self, **changes: Any) -> None:
        """Change settings between runs (``duration``, ``overlap``, ``state_dir``, ...) for the loop and its parts at
        once: assigning ``settings`` would reach the loop only, since the parts were given theirs when built."""
        if "comm_share" in changes:
            raise ValueError("comm_share is read when the worker is built (its pacing); build a new worker")
        self.settings = replace(self.settings, **changes)
        self.pipeline.settings = self.settings

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

    # the loop -----------------------------------------------------------------

    def run(self) -> RunSummary:
        """Train and sync until ``duration`` is over, ``max_steps`` are taken or Ctrl-C; always ends with a final push."""
        s = self.settings
        started, cpu_started = time.monotonic(), time.process_time()
        end, due = started + s.duration, started + self.sync_interval
        steps_before, tokens_before, blocked_before = self.totals.steps, self.totals.tokens, self.pipeline.blocked_seconds
        STOP.arm()  # a signal now stops at the next step boundary (worker.stopping)
        at_once = False
        try:
            while not self.collective.agree(time.monotonic() >= end or STOP.requested or self.steps_left() == 0
                                            or self.pipeline.early_stopped):
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
                                 self.pipeline.blocked_seconds - blocked_before, self.state.syncs)
            try:
                if not at_once:
                    self.wait_sync()
                    self.sync(final=True)
                    if self.secure is not None:  # stay for the cohort: leaving after masking costs it a recovery
                        self.secure.finish(self.state.outbox, self.pipeline.manifest())
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

    # a sync, overlapped or not: the steps are worker.sync_pipeline's ---------------------------

    def sync(self, final: bool = False) -> dict[str, Any]:
        """A whole sync, waiting for the network (the final sync, tests, --no-overlap, data parallel)."""
        if not self.collective.is_primary:  # dist: rank 0 pushes the ranks' common update and pulls for all
            self.interval.reset()
            self.pipeline.share_weights()
            return {}
        self.wait_sync()
        job = self.pipeline.begin_sync(final)
        record = self.pipeline.finish_sync(self.pipeline.exchange(job), overlapped=False)
        self.pipeline.share_weights()
        return record

    def start_sync(self) -> None:
        """Begin a sync and leave its exchange to the background thread."""
        if self._inflight is not None:
            raise RuntimeError("a sync is already in flight")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmoe-sync")
        job = self.pipeline.begin_sync()
        self._inflight = job, self._executor.submit(self.pipeline.exchange, job)

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
        return self.pipeline.finish_sync(job, overlapped=True)
