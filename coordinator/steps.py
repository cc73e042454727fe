"""Aggregation steps: pending updates of an expert become its next version.

A step reads the current weights and each update's payload tensor by tensor (payloads are not
kept in memory while pending), applies the configured aggregator, refuses a result that is not
finite, and commits the new version and the applied updates together through the store. The step
an incoming update would complete is computed before that update is recorded (``prepare``), so a
push whose step would overflow is refused with nothing recorded.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from compression.errors import PayloadError
from coordinator.access import audit
from coordinator.checks.adapters import non_finite_tensor, stored_deltas
from coordinator.aggregation import AGGREGATORS, AggregationParams, StateDict, Update, robust_aggregator
from coordinator.config import CoordinatorConfig
from coordinator.storage.expert_store import ExpertStore, StaleAggregation
from coordinator.checks.flat_weights import load_flat, save_flat
from coordinator.privacy_ledger import PrivacyLedgers
from coordinator.liveness import active_workers, workers_on_expert
from coordinator.recovery import quarantine_updates
from coordinator.storage.manifest_schema import ExpertRow, UpdateRow, parsed_manifest
from coordinator.checks.update_limits import as_clipped, check_step_result
from protocol.errors import InvalidPayload
from protocol.tensors import load_file, save_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedStep:
    """An aggregation step computed (and checked finite) before its last update was recorded."""

    update_ids: list[str]
    base_version: int
    weights: StateDict
    updates: list[Update]
    weighting: dict[str, Any]
    """What the step's version_applied event says of its weights (``params_for``)."""


class AggregationSteps:
    """When pending updates become a new version of their expert, and the step that makes it.

    The policy (``--updates-per-step``: fedasync applies each update, fedbuff K at a time) and the
    maths (``coordinator.aggregation``) meet here; every step is written through the store, so a
    step either commits whole (version row + updates marked applied) or leaves nothing.
    Callers hold ``store.expert_lock(name)`` around ``run_locked`` and ``prepare``, and call ``store.sync()``
    after letting go of it (a step's rows are made durable, and the payloads it applied deleted, there).
    """

    def __init__(self, store: ExpertStore, config: CoordinatorConfig, on_step: Callable[[float], None],
                 ledgers: PrivacyLedgers | None = None,
                 relay_sources: Callable[[str], int] = lambda specialty: 0) -> None:
        """``on_step(seconds)`` is called after each committed step (metrics, gateway rebuild); with --dp-noise,
        ``ledgers`` books every step before it is committed; ``relay_sources(expert)``: the relays forwarding that
        expert's updates (coordinator.relay_registry), each one more source in fedasync's N."""
        self.store = store
        self.relay_sources = relay_sources
        self.updates_per_step = config.updates_per_step
        self.params = AggregationParams(config.server_lr, config.staleness_decay)
        self.async_alpha = config.async_alpha if config.aggregation == "fedasync" else 1.0
        """fedasync's mixing weight; None: 1 / the expert's active workers, counted at each step (``params_for``)."""
        self._aggregate_fn = AGGREGATORS[config.aggregation]
        if config.robust != "none":  # a robust combination of fedbuff's buffer (coordinator.aggregation.robust)
            self._aggregate_fn = robust_aggregator(config.robust, config.trim_fraction)
        # under --secure-aggregation the workers clip and add the noise and coordinator.cohorts books each cohort
        dp = config.dp if not config.secure_aggregation else None
        self.ledgers = ledgers if dp is not None else None
        if dp is not None:  # the clipped, noised mean over a step's fixed size K (privacy/dp.py)
            from coordinator.aggregation.dp_fedavg import dp_fedavg_aggregator

            self._aggregate_fn = dp_fedavg_aggregator(dp, self.updates_per_step)
        self._on_step = on_step

    def prepare(self, name: str, stored: dict[str, Any], body: Path) -> PreparedStep | None:
        """The aggregation step this update would complete, computed before it is recorded.

        Its result must be finite (``check_step_result``; a relay applies the same rule before its 202).
        Refusing here (422) means nothing was recorded; the step is then committed as computed (not
        computed twice).
        """
        pending = self.store.rows.pending_updates(name)
        if len(pending) != self.updates_per_step - 1:
            return None
        expert = self.store.require_expert(name)
        new, updates, weighting = self._candidate(expert, pending, (stored, body))
        check_step_result(new, stored["update_id"], name)  # InvalidUpdate (422): nothing recorded
        return PreparedStep([u.update_id for u in pending] + [stored["update_id"]], expert.version, new, updates,
                            weighting)

    def _candidate(self, expert: ExpertRow, recorded: list[UpdateRow],
                   incoming: tuple[dict[str, Any], Path] | None = None
                   ) -> tuple[StateDict, list[Update], dict[str, Any]]:
        """The expert's next weights from recorded updates and, if given, one not yet recorded
        (its stored meta and temp file). Payloads are read tensor by tensor while aggregating."""
        manifest = list(parsed_manifest(expert.manifest))
        with contextlib.ExitStack() as files:
            # our own copy of the current weights: the aggregator updates it in place. In one flat buffer when
            # they are plain float32, so that neighbouring tensors take an update in one add (checks/flat_weights.py)
            weights = files.enter_context(self.store.local_file(self.store.weights(expert.name).digest))
            current = load_flat(weights) or load_file(weights)
            entries = [(u.meta, files.enter_context(self.store.local_file(_payload(u)))) for u in recorded]
            entries += [incoming] if incoming is not None else []
            updates = [Update(delta=self._deltas(meta, path, manifest), num_samples=meta["num_samples"],
                              staleness=max(0, expert.version - meta["base_version"]),
                              contributor=meta.get("worker_id") or meta["update_id"]) for meta, path in entries]
            params, weighting = self.params_for(expert.name)
            return self._aggregate_fn(current, updates, params), updates, weighting

    def params_for(self, name: str) -> tuple[AggregationParams, dict[str, Any]]:
        """The step's parameters, and what its version_applied event says of them: with ``--async-alpha auto``
        (fedasync's default), alpha = 1 / N and staleness grace N - 1 for the N sources of the expert's updates:
        its workers registered here (``liveness.workers_on_expert``) and the relays forwarding its site's mean (at
        least 1: a push from an unregistered client counts whole), with the workers counted and alive and the
        relays counted, from one read of the workers. A fixed --async-alpha keeps grace 0, the original
        staleness rule."""
        if self.async_alpha is not None:
            params = self.params if self.async_alpha == 1.0 else replace(self.params, alpha=self.async_alpha)
            return params, {"alpha": params.alpha, "staleness_grace": params.staleness_grace}
        workers = self.store.rows.workers()
        counted, relays = workers_on_expert(workers, name), self.relay_sources(name)
        n = max(1, counted + relays)
        params = replace(self.params, alpha=1.0 / n, staleness_grace=n - 1)
        return params, {"alpha": params.alpha, "staleness_grace": params.staleness_grace, "workers_counted": counted,
                        "workers_alive": active_workers(workers, name), "relays_counted": relays}

    def run(self, name: str) -> None:
        """Apply whatever steps the pending updates of ``name`` make up."""
        with self.store.expert_lock(name):
            self.run_locked(name)
        self.store.sync()  # the steps' rows durable, then the payloads they applied deleted (after the lock)

    def run_locked(self, name: str, prepared: PreparedStep | None = None) -> None:
        """``run`` under the expert's lock; ``prepared`` is used if it is the first step's batch."""
        pending = self.store.rows.pending_updates(name)
        k = self.updates_per_step
        while len(pending) >= k:
            batch, pending = pending[:k], pending[k:]
            ready = prepared if prepared is not None and prepared.update_ids == [u.update_id for u in batch] else None
            prepared = None
            if not self.apply(name, batch, ready):
                return

    def apply(self, name: str, batch: list[UpdateRow], prepared: PreparedStep | None = None) -> bool:
        """One aggregation step; False if another process sharing the data dir got there first."""
        started = time.perf_counter()
        expert = self.store.require_expert(name)
        if prepared is not None and prepared.base_version == expert.version:
            new, updates, weighting = prepared.weights, prepared.updates, prepared.weighting
        else:
            try:
                new, updates, weighting = self._candidate(expert, batch)
            except (InvalidPayload, PayloadError, FileNotFoundError):  # raw payloads are opened here, others decoded
                if all(self._still_pending(u) for u in batch):
                    raise
                log.warning("dropped an aggregation step of %s: its updates were applied meanwhile", name)
                return False  # another process applied them and dropped their payloads
            bad = non_finite_tensor(new)
            if bad is not None:  # recorded before results were checked (an older version): never apply it
                quarantine_updates(self.store, name, batch, f"applying it makes tensor {bad!r} overflow to Inf/NaN")
                return False
        written = self.store.bodies.write_temp(lambda p: _save(new, p), f"write version {expert.version + 1} of {name!r}")
        if self.ledgers is not None:  # booked before the commit: a crash in between over-counts, never under-counts
            self.ledgers.book_step(name)
        loss = _mean_loss(batch)
        try:
            self.store.commit_version(name, expert.version + 1, written, batch, loss, events=(audit.version_applied(
                name, expert.version + 1, [u.update_id for u in batch], [u.staleness for u in updates], loss,
                weighting),), durable=False)  # callers sync after letting go of the expert's lock
        except StaleAggregation as exc:
            log.warning("dropped an aggregation step of %s: %s", name, exc)
            return False
        self._on_step(time.perf_counter() - started)
        log.info("expert %s -> version %d (%d update(s), staleness %s)", name, expert.version + 1,
                 len(batch), [u.staleness for u in updates])
        return True

    def _still_pending(self, update: UpdateRow) -> bool:
        row = self.store.rows.update(update.update_id)
        assert row is not None  # update rows are never deleted
        return row.status == "pending"

    def _deltas(self, meta: dict[str, Any], path: Path,
                manifest: list[tuple[str, tuple[int, ...]]]) -> Mapping[str, torch.Tensor]:
        """Deltas read from the update's payload when aggregated (not kept in memory while pending)."""
        return as_clipped(stored_deltas(path, meta["codec"], meta["codec_config"], manifest), meta)


def _save(weights: StateDict, path: Path) -> None:
    """A version's file: straight from the step's flat buffer when it is one (``save_flat``), else by safetensors;
    the same bytes either way."""
    if not save_flat(weights, path):
        save_file(weights, path)


def _mean_loss(batch: list[UpdateRow]) -> float | None:
    pairs = [(u.meta.get("train_loss"), max(1, u.meta["num_samples"])) for u in batch]
    pairs = [(loss, n) for loss, n in pairs if loss is not None]
    if not pairs:
        return None
    total = sum(n for _, n in pairs)
    # loss x n overflowed for a finite loss near 1e308 (an Inf in JSON); weights of at most 1 cannot
    return math.fsum(loss * (n / total) for loss, n in pairs)


def _payload(update: UpdateRow) -> str:
    """A pending update's payload digest; FileNotFoundError if another process applied it meanwhile."""
    if update.blob is None:
        raise FileNotFoundError(f"the payload of update {update.update_id!r} is gone")
    return update.blob
