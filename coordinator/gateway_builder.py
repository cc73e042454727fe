"""The gateway model: every expert merged into one adapter, rebuilt in the background.

Reads only read. ``notify()`` (after an aggregation step, at start) marks the gateway out of
date; one builder thread rebuilds it, starting no sooner than ``--gateway-interval`` seconds
after the previous build ended, however many changes arrive meanwhile (they coalesce into the
next build; a new expert skips the wait). It stores the gateway durably (a restart reuses it)
and deletes all but the newest ``--keep-gateways`` gateways with their blobs, so the data dir
grows neither with polling nor with training, and the builder takes at most
build / (build + interval) of a core.

``current()`` returns the newest built gateway with ``stale`` saying whether an expert changed
since. When a build is running or due now it waits for it, up to ``WAIT_SECONDS``; when the
next build is held back by the interval it answers at once with the stale one. With no gateway
built yet it waits too, then answers 503 with Retry-After.

The merge itself is gateway.build.build_gateway, shared with get_gateway_model.py's local merge.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coordinator.checks.adapters import non_finite_tensor
from coordinator.config import CoordinatorConfig
from coordinator.errors import REFUSALS
from coordinator.storage.expert_store import ExpertStore
from gateway.build import Source, build_gateway, gateway_weights
from gateway.files import SAFETENSORS_META_KEY
from protocol.errors import Conflict, NotFound, Unavailable
from protocol.schemas import ExpertSpec
from protocol.streaming import FileTensors
from protocol.tensors import load_file, save_file

log = logging.getLogger(__name__)
WAIT_SECONDS = 30.0
"""Longest a read waits for a build that is due (or for the first one) before answering."""
RETRY_SECONDS = 5
"""Retry-After of the 503 answered while the first gateway is still being built."""


@dataclass(frozen=True)
class Plan:
    """The gateway the experts call for now: what to merge, with which weights, and its key."""

    key: str
    weights: dict[str, float]
    sources: list[Source]


class GatewayBuilder:
    """Lock order: ``_cond`` is never held while the store is used (the store's locks are taken alone)."""

    def __init__(self, store: ExpertStore, config: CoordinatorConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self._cond = threading.Condition()
        self._requested = 0  # changes notified so far
        self._built = 0  # changes covered by the last finished build
        self._finished = 0  # build attempts finished (reads waiting for one watch this)
        self._building = False
        self._urgent = False  # a new expert: build without waiting for the interval
        self._last_end = -math.inf  # when the last gateway was stored; the interval counts from there
        self._closed = False
        self._failure: tuple[str, Exception] | None = None  # (key, why) of the last failed build: a refusal
        self.builds = 0
        """Gateways built and stored by this process (tests and metrics)."""
        self._open_files = contextlib.ExitStack()  # blobs read lazily by the build running now
        self._thread = threading.Thread(target=self._run, name="gateway-builder", daemon=True)

    @property
    def _interval(self) -> float:
        return self._config.gateway_interval

    def start(self) -> None:
        self._thread.start()
        self.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=WAIT_SECONDS)

    def notify(self, urgent: bool = False) -> None:
        """An expert changed: schedule a rebuild (coalesced with any other pending change).

        ``urgent`` (a new expert) skips the interval: a gateway missing an expert is worse than one
        a few versions behind, and experts are created rarely.
        """
        with self._cond:
            self._requested += 1
            self._urgent |= urgent
            self._cond.notify_all()

    # reading --------------------------------------------------------------------

    def current(self, fresh: bool = False) -> dict[str, Any]:
        """The newest built gateway, plus ``stale``: whether an expert changed since it was built.

        ``fresh`` (a download, not a dashboard poll) asks the builder to build now, skipping the
        interval, and waits for it: the read itself still builds nothing.
        """
        plan = self._plan()
        built = self._store.rows.gateway(plan.key)
        if built is not None:
            return built | {"stale": False}
        self._raise_failure(plan.key)
        if fresh:
            self.notify(urgent=True)
        latest = self._store.rows.gateway()
        if latest is None or fresh or self._due():
            self._wait(WAIT_SECONDS)
            plan = self._plan()
            if (built := self._store.rows.gateway(plan.key)) is not None:
                return built | {"stale": False}
            self._raise_failure(plan.key)
            latest = self._store.rows.gateway()
        if latest is None:  # the first build runs at once (nothing holds it back) but is slow: try again soon
            raise Unavailable(f"the first gateway is still being built; retry in {RETRY_SECONDS} s",
                              retry_after=RETRY_SECONDS)
        return latest | {"stale": True}

    def _due(self) -> bool:
        with self._cond:
            return self._due_locked()

    def _due_locked(self) -> bool:
        """A build is running or starts now (not held back by the interval)."""
        return self._building or self._urgent or self._last_end + self._interval <= self._clock()

    def _wait(self, timeout: float) -> None:
        """Wait until a build covers every change notified so far, or the next one is held back."""
        with self._cond:
            target, finished = self._requested, self._finished
            self._cond.wait_for(lambda: self._built >= target or self._closed
                                or (self._finished > finished and not self._due_locked()), timeout)

    def _raise_failure(self, key: str) -> None:
        failure = self._failure
        if failure is not None and failure[0] == key:
            raise failure[1]

    def _plan(self) -> Plan:
        experts = self._store.rows.experts()
        if not experts:
            raise NotFound("there is no gateway yet: no expert exists (start a worker first)")
        config = self._config
        weights = gateway_weights({e.name: e.samples_seen for e in experts}, dict(config.gateway_weights or {}))
        sources = [Source(e.name, e.version, ExpertSpec.from_json(e.spec), self._loader(e.name, e.version, e.spec))
                   for e in experts]
        identity = [config.gateway_strategy, dict(config.gateway_config), weights, {e.name: e.version for e in experts}]
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return Plan(key, weights, sources)

    def _loader(self, name: str, version: int, spec: Mapping[str, Any]) -> Callable[[], Mapping[str, Any]]:
        full = spec.get("full") is not None  # a whole model: read one tensor at a time, while the build runs

        def load() -> Mapping[str, Any]:
            digest = self._store.weights(name, version).digest  # NotFound if pruned since: a newer build follows
            if full:
                return FileTensors(self._open_files.enter_context(self._store.local_file(digest)))
            with self._store.local_file(digest) as path:
                return load_file(path)

        return load

    # building -------------------------------------------------------------------

    def _run(self) -> None:
        # One intra-op thread for this thread only (OpenMP's setting is per thread): a build must not
        # compete with pushes for every core, and multithreaded LAPACK on busy cores is 10-100x
        # slower than one thread (bench/merge_speed.py, gateway/lowrank.py:sketch_factorise).
        torch.set_num_threads(1)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._built < self._requested or self._closed)
                if self._closed:
                    return
                delay = self._last_end + self._interval - self._clock()
                if delay > 0 and not self._urgent:  # built recently: let more changes coalesce into the next build
                    self._cond.wait(delay)
                    continue
                target, self._building, self._urgent = self._requested, True, False
            with self._open_files:
                self._build_once()
            with self._cond:
                self._built, self._building = target, False
                self._finished += 1
                self._cond.notify_all()

    def _build_once(self) -> None:
        try:
            plan = self._plan()
        except NotFound:
            return  # no expert yet
        try:
            if self._store.rows.gateway(plan.key) is None:
                self._build_and_store(plan)
            self._failure = None
        except NotFound as exc:  # an expert moved on (and its version was pruned) mid-build
            log.info("gateway build skipped, a newer one follows: %s", exc)
        except REFUSALS as exc:  # e.g. a MergeError: reads answer it (409, coordinator.errors)
            log.warning("cannot build the gateway: %s", exc)
            self._failure = (plan.key, exc)
        except Exception as exc:  # noqa: BLE001 - the builder thread must outlive one failed build
            log.exception("gateway build failed")
            self._failure = (plan.key, Unavailable(f"the gateway build failed ({type(exc).__name__}: {exc}); "
                                                   "see the coordinator log"))

    def _build_and_store(self, plan: Plan) -> None:
        started = time.perf_counter()
        config = self._config
        built = build_gateway(plan.sources, plan.weights, config.gateway_strategy, config.gateway_config)
        _check_finite(built.tensors)
        meta = {SAFETENSORS_META_KEY: json.dumps(built.info)}
        written = self._store.bodies.write_temp(lambda p: save_file(built.tensors, p, meta))
        version = self._store.add_gateway(plan.key, written, built.info, config.keep_gateways)
        self.builds += 1
        with self._cond:  # only stored builds hold the next one back, not checks that found nothing to do
            self._last_end = self._clock()
        log.info("gateway version %d built from %s in %.1f s", version, built.info["sources"],
                 time.perf_counter() - started)


def _check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Finite experts can still merge to Inf (LoRA factors are scaled by alpha / rank): refuse, never store it."""
    bad = non_finite_tensor(tensors)
    if bad is not None:
        raise Conflict(f"the merged gateway's tensor {bad!r} overflows float32 (Inf/NaN): an expert's weights are "
                       "too large to merge; use one expert (get_gateway_model.py --expert NAME) or give it less "
                       "weight (--gateway-weights)", reason="gateway_not_finite", tensor=bad)
