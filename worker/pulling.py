"""The pull step of a sync: the expert's latest weights, in full or as a compressed diff since our version."""
from __future__ import annotations

import logging
import time

from compression import make_codec
from compression.wire import decode_update
from protocol.client import CoordinatorClient
from protocol.errors import NotFound
from protocol.tensors import dumps, manifest_of
from worker.adaptive import LinkEstimate, choose_pull
from worker.encoding import CodecChoice, PullSettings
from worker.sync_state import ExpertState, Fetched

log = logging.getLogger(__name__)


class ExpertPuller:
    """Fetches an expert for one worker; never changes the worker's weights (the apply step does)."""

    def __init__(self, client: CoordinatorClient, specialty: str, worker_id: str, settings: PullSettings,
                 sync_budget: float | None = None) -> None:
        self.client, self.specialty, self.worker_id, self.settings = client, specialty, worker_id, settings
        self.sync_budget = sync_budget
        """--compression auto's budget: pull diffs when full weights would take longer (None: never adaptive)."""

    @property
    def fixed_diff(self) -> CodecChoice | None:
        """The diff codec of --pull-compression, or None (full pulls)."""
        return CodecChoice(self.settings.codec, dict(self.settings.config)) if self.settings.codec else None

    @property
    def may_pull_diffs(self) -> bool:
        """Whether a pull may be a diff (--pull-compression, or --compression auto): only then do the pulled
        weights matter after a restart, as the base a diff decodes against."""
        return self.fixed_diff is not None or self.sync_budget is not None

    def full_due(self, state: ExpertState) -> bool:
        """Whether the next pull must be a full one: nothing pulled yet, or every --full-pull-every-th pull."""
        return not state.pulled or (state.pulls + 1) % self.settings.full_every == 0

    def next_diff(self, state: ExpertState, down: LinkEstimate) -> CodecChoice | None:
        """The diff codec of the next pull: --pull-compression's, or with --compression auto one picked
        when the measured download throughput cannot fetch full weights within the budget; None: full."""
        if self.fixed_diff is not None or self.sync_budget is None or self.full_due(state):
            return self.fixed_diff
        pulled = state.pulled
        numel = sum(t.numel() for t in pulled.values())
        full_bytes = len(dumps({})) + 4 * numel + 72 * len(pulled)
        decision = choose_pull(full_bytes, numel, len(pulled), self.sync_budget, down)
        if decision.choice is not None:
            log.info("--compression auto: full weights (~%d bytes) would overrun the %.3g s budget at %.0f B/s; "
                     "pulling a %s diff", full_bytes, self.sync_budget, down.bytes_per_second, decision.choice.codec)
        return decision.choice

    def fetch(self, state: ExpertState, diff: CodecChoice | None) -> Fetched:
        """The latest weights: a diff pull with ``diff`` unless a full pull is due (or our version is gone)."""
        state.pulls += 1
        started = time.perf_counter()
        if diff is not None and state.pulled and state.pulls % self.settings.full_every != 0:
            try:
                payload, version = self.client.experts.pull_diff(self.specialty, state.version, diff.codec, diff.config,
                                                         self.worker_id)
            except NotFound:  # our version was pruned on the coordinator: fall back to full weights
                log.info("version %d is no longer kept; pulling full weights", state.version)
            else:
                weights = None
                if payload:
                    delta = decode_update(payload, manifest_of(state.pulled), make_codec(diff.codec, diff.config))
                    weights = {k: state.pulled[k] + delta[k] for k in state.pulled}
                return Fetched(weights, version, None, len(payload), time.perf_counter() - started, diff.codec)
        pulled = self.client.experts.pull(self.specialty, etag=state.etag, worker_id=self.worker_id)
        return Fetched(pulled.tensors, pulled.version, pulled.etag, pulled.nbytes, time.perf_counter() - started)
