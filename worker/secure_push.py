"""A worker's pushes under --secure-aggregation: through its cohorts, masked, never in the clear.

``SecurePush`` keeps the worker's part in its current cohort moving on a background thread (join,
keys, shares, the unmasking answer: ``privacy.secagg.session.CohortSession``), so a cohort is formed
and its keys exchanged while the worker trains. At a sync, ``push`` takes every queued update of the
outbox, adds what earlier cohorts still owe (``OwedDelta``: an abandoned cohort's, or a late one's),
and sends the sum as one masked input. If the cohort cannot take it yet, the updates stay queued and
the worker trains on, as when the coordinator is unreachable. When a cohort finishes the worker
learns whether its input counted, and joins the next cohort at once.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from compression.registry import make_codec
from compression.wire import decode_update
from privacy.secagg.config import CohortConfig
from privacy.secagg.errors import SecAggRefused
from privacy.secagg.session import CohortSession, OwedDelta
from privacy.secagg.vector import Manifest, flatten
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError
from protocol.schemas import RAW_CODEC
from protocol.tensors import loads
from worker.privacy_floor import cohort_below_floor
from worker.sync_state import Outgoing

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5
FINAL_WAIT_SECONDS = 180.0
"""How long the final sync waits for its cohort (the coordinator's --secagg-round-timeout is 60 s by default)."""


def decoded_delta(update: Outgoing, manifest: Manifest) -> dict[str, torch.Tensor]:
    """What an outgoing update carries, as the coordinator would decode it (a dense codec's values)."""
    codec = update.meta.get("codec", RAW_CODEC)
    if codec == RAW_CODEC:
        return loads(update.body)
    return decode_update(update.body, list(manifest), make_codec(codec, update.meta.get("codec_config") or {}))


class SecurePush:
    """The cohorts of one worker of one expert."""

    def __init__(self, client: CoordinatorClient, expert: str, worker: str, min_dp_noise: float | None = None) -> None:
        self.transport = client.cohorts
        self.expert, self.worker = expert, worker
        self.min_dp_noise = min_dp_noise
        """--min-dp-noise: cohorts announcing less DP noise are refused before this worker posts its keys."""
        self.owed = OwedDelta()
        self.session = self._new_session()
        self.sent: list[CohortSession] = []
        """Sessions whose input went out and whose outcome is not known yet."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _new_session(self) -> CohortSession:
        return CohortSession(self.transport, self.expert, self.worker, admit=self._admit)

    def _admit(self, config: CohortConfig) -> None:
        """SecAggRefused for a cohort below --min-dp-noise (logged by ``advance``, asked again at the next poll)."""
        why = cohort_below_floor(config.dp.noise_multiplier if config.dp is not None else None, self.min_dp_noise)
        if why is not None:
            raise SecAggRefused(f"not joining cohort {config.cohort_id}: {why}; this worker's updates stay queued")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fedmoe-secagg", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.advance()

    def advance(self) -> None:
        """One poll: every open session does what its round asks; finished ones settle what they owe."""
        with self._lock:
            for session in [*self.sent, self.session]:
                try:
                    session.advance()
                except FedMoEError as exc:  # unreachable, or refused (a malicious request): logged, retried
                    log.warning("secure aggregation, cohort %s: %s", session.cohort_id or "(forming)", exc)
            for session in [s for s in self.sent if s.outcome is not None]:
                self.sent.remove(session)
                self.owed.settle(session.cohort_id or "", bool(session.outcome))
                log.info("cohort %s finished: this worker's input %s%s", session.cohort_id,
                         "counted" if session.outcome else "did not count (it is sent again with the next one)",
                         f" ({session.reason})" if session.reason else "")
            if self.session.outcome is not None or self.session.submitted:
                self.session = self._new_session()  # join the next one now

    def push(self, outbox: deque[Outgoing], manifest: Manifest) -> bool:
        """Send every queued update as one masked input; False (kept queued) if the cohort is not ready."""
        with self._lock:
            if not outbox:
                return True
            if not self.session.can_submit:
                log.info("secure aggregation: cohort %s is not ready for inputs (phase %s); keeping %d update(s) "
                         "queued", self.session.cohort_id or "(forming)", self.session.phase, len(outbox))
                return False
            fresh = np.sum([flatten(decoded_delta(u, manifest), manifest) for u in outbox], axis=0)
            vector = self.owed.next_delta(fresh)
            samples = sum(int(u.meta.get("num_samples", 0)) for u in outbox)
            meta: dict[str, Any] = {"base_version": min(int(u.meta["base_version"]) for u in outbox),
                                    "update_id": outbox[-1].meta["update_id"]}
            self.session.submit(vector, samples, meta, rounding_seed=secrets.randbits(63))
            self.owed.submitted(self.session.cohort_id or "", vector)
            self.sent.append(self.session)
            outbox.clear()
            return True

    def finish(self, outbox: deque[Outgoing], manifest: Manifest, timeout: float = FINAL_WAIT_SECONDS,
               clock: Callable[[], float] = time.monotonic) -> bool:
        """At exit: send what is queued as soon as a cohort takes it, then keep answering until every sent
        input's cohort finished (a member that leaves after masking costs its cohort a recovery). False on
        timeout: what is still queued is reported undelivered."""
        end = clock() + timeout
        while (outbox or self.sent) and clock() < end:
            if outbox:
                self.push(outbox, manifest)
            self._stop.wait(POLL_SECONDS)
        return not (outbox or self.sent)
