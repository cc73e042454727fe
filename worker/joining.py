"""Joining the federation: resume a checkpoint if there is one, register, create or check the expert, first pull.

The sync steps (worker.sync_pipeline) do the pushing, pulling and adopting; this part runs them once, in the
order a start needs: updates queued in a resumed checkpoint are delivered before the first pull.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from protocol.errors import BadRequest, FedMoEError, NotFound, Unavailable
from worker import resume
from worker.adaptive import probe_upload
from worker.checkpoint import CheckpointError, discard_checkpoint, load_checkpoint
from worker.privacy_floor import check_expert
from worker.sync_pipeline import SyncPipeline

log = logging.getLogger(__name__)


@dataclass
class Joining:
    """How one worker joins its expert; ``worker.federation.FederatedWorker`` builds it and calls ``join``."""

    pipeline: SyncPipeline
    """The sync steps whose state a join sets up (and whose push, pull and adopt it uses)."""
    profile: dict[str, Any] | None = None
    """Routing summary of our training prompts (protocol.profiles), sent when joining."""

    def join(self) -> dict[str, Any]:
        """Resume a checkpoint if any, register, create the expert if we are its first worker, pull it."""
        pipeline = self.pipeline
        s = pipeline.settings
        if not pipeline.collective.is_primary:  # dist: rank 0 joins; we start from the weights it pulled
            pipeline.share_weights()
            return {}
        resumed = self._resume()
        pipeline.client.workers.register(s.worker_id, s.specialty, pipeline.expert_spec["base_model"], s.sync_interval)
        if pipeline.placement is not None:  # its reports go to the root under this worker's own token there
            pipeline.placement.root.workers.register(s.worker_id, s.specialty, pipeline.expert_spec["base_model"],
                                                 s.sync_interval)
            pipeline.placement.follow()  # before the first pull: the worker starts at the coordinator the root assigns
        info = self._join_expert()
        if s.min_dp_noise is not None:  # before our profile, queued updates or anything else drawn from our data;
            # asked afresh: a relay answers the create above from its cache, this one from its root
            check_expert(s.specialty, pipeline.client.experts.get(s.specialty), s.min_dp_noise)
        if resumed and info["version"] < pipeline.state.version:
            self._forget_history(info["version"])
        if self.profile is not None:
            pipeline.client.experts.put_profile(s.specialty, s.worker_id, self.profile)
        if pipeline.secure is not None:
            pipeline.secure.start()  # joins a cohort now: keys and shares are exchanged while we train
        elif pipeline.state.outbox and not pipeline.push():
            raise Unavailable("cannot deliver the updates saved in the checkpoint; is the coordinator up?")
        if pipeline.encoder.settings.adaptive and not pipeline.links.up.observed:
            self._probe_upload()
        fetched = pipeline.fetch()
        if fetched.weights is not None:
            pipeline.adopt(fetched)
            pipeline.score_version(fetched.weights)
        pipeline.share_weights()
        log.info("joined expert %s at version %d as %s", s.specialty, pipeline.state.version, s.worker_id)
        return info

    def _join_expert(self) -> dict[str, Any]:
        """Create the expert from our adapter if it does not exist; else only check our setup against it.

        An existing expert is pulled, not uploaded to: the PUT carries an empty adapter, which the
        coordinator ignores once it has checked that rank, base model etc. match (409 if not).
        """
        pipeline = self.pipeline
        name = pipeline.settings.specialty
        try:
            pipeline.client.experts.get(name)
        except NotFound:
            return pipeline.client.experts.create(name, pipeline.trainer.adapter_state(), pipeline.expert_spec)
        try:
            return pipeline.client.experts.create(name, {}, pipeline.expert_spec)
        except BadRequest:  # a coordinator that checks the body before looking the expert up
            return pipeline.client.experts.create(name, pipeline.trainer.adapter_state(), pipeline.expert_spec)

    def _probe_upload(self) -> None:
        """--compression auto: time an upload probe or two, so the first push is sized from the link."""
        pipeline = self.pipeline
        s, budget = pipeline.settings, pipeline.encoder.settings.sync_budget
        assert budget is not None  # --compression auto requires --sync-budget
        try:
            update_bytes = 4 * sum(t.numel() for t in pipeline.trainer.adapter_state().values())
            pipeline.links.up = probe_upload(lambda n: pipeline.client.updates.probe(n, s.worker_id, s.specialty), budget,
                                         update_bytes)
        except FedMoEError as exc:  # e.g. a coordinator from before POST /probe: the first pushes start small
            log.info("no upload probe (%s); --compression auto starts from %.0f B/s", exc,
                     pipeline.links.up.bytes_per_second)
            return
        if pipeline.links.up.observed:
            log.info("upload link: %.2f MB/s measured with a %d-byte probe", pipeline.links.up.bytes_per_second / 1e6,
                     pipeline.links.up.largest)
        else:
            log.info("upload link: too slow for a probe within half the budget; pushes start from %.0f B/s",
                     pipeline.links.up.bytes_per_second)

    def _resume(self) -> bool:
        """Load the checkpoint in the state dir into trainer, encoder and loop; False if there is none."""
        pipeline = self.pipeline
        s = pipeline.settings
        if s.state_dir is None:
            return False
        if s.state_dir.exists() and not s.state_dir.is_dir():
            raise CheckpointError(f"--state-dir {s.state_dir} is a file; give a directory for the worker's checkpoints")
        if not s.resume:
            if dropped := discard_checkpoint(s.state_dir):
                log.warning("--fresh: discarded the checkpoint in %s and its %d undelivered update(s)",
                            s.state_dir, dropped)
            return False
        checkpoint = load_checkpoint(s.state_dir, pipeline.identity)
        if checkpoint is None:
            return False
        resume.restore(checkpoint, pipeline.trainer, pipeline.encoder, s.state_dir, pipeline.state)
        pipeline.checkpoints().remember(checkpoint)  # what is on disk need not be written again
        log.warning("resuming the checkpoint in %s (sync %d, step %d, expert version %d, %d queued update(s)%s); "
                    "pass --fresh to start over", s.state_dir, pipeline.state.syncs, pipeline.trainer.global_step,
                    pipeline.state.version, len(pipeline.state.outbox),
                    resume.codec_change(checkpoint.progress.get("codec"), pipeline.encoder))
        return True

    def _forget_history(self, version: int) -> None:
        """The coordinator lacks the versions our checkpoint builds on (a new data dir?): start from it.

        Our queued updates and error-feedback residual are deltas on versions it never had, so they
        are dropped (if the expert was just created, it was created from our adapter, which already
        contains them).
        """
        pipeline = self.pipeline
        log.warning("the coordinator has expert %s at version %d, behind this worker's checkpoint (version %d): "
                    "dropping %d queued update(s) and starting from the coordinator's weights",
                    pipeline.settings.specialty, version, pipeline.state.version, len(pipeline.state.outbox))
        pipeline.state.forget_history(version)
        pipeline.encoder.reset()

