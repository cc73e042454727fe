"""Secure aggregation's routes and the loop that applies each unmasked cohort (root and relay alike).

``install(app, host, settings)`` mounts the cohort routes (``protocol.client.cohorts`` lists them) over one
``privacy.secagg.SecureAggregator`` journalled in ``<data dir>/secagg``, and starts a thread that, every
``TICK_SECONDS``, closes the rounds whose deadline passed and hands each unmasked cohort to the host
as one update: its sample-weighted mean, with ``num_samples`` the cohort's total and update id
``secagg-<cohort id>``. The host's own exactly-once rule (a known update id is answered, not applied
again) makes a crash between recording that update and marking the cohort applied harmless. At the
root the update becomes one step; at a relay it is forwarded like any other, so neither sees an
individual update.

With --dp-noise at the root, cohorts are DP cohorts (``privacy.secagg.noise``: the members clip their update
and add their share of the noise) and each cohort's step is booked in the expert's privacy ledger before its
masks come off; a cohort the budget cannot pay for is abandoned unopened, and joining is refused (409) once
the budget is spent. A relay under such a root forms its site's cohorts with the root's sigma and C, has the root
book each before unmasking it (coordinator/relay/dp_cohorts.py), and forwards its sum marked ``dp_cohort``.
"""
from __future__ import annotations

import io
import logging
import threading
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from coordinator.access.auth import acting_worker
from coordinator.errors import REFUSALS
from coordinator.privacy_ledger import PrivacyLedgers
from privacy.secagg.aggregator import CohortSum, SecAggSettings, SecureAggregator, cohort_update_id
from privacy.secagg.config import CohortConfig
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.journal import CohortJournal
from privacy.secagg.noise import CohortNoise
from privacy.secagg.vector import manifest_numel, unflatten
from protocol.dp_cohort import DPCohortSum
from protocol.errors import BadRequest, Forbidden, NotFound, PayloadTooLarge, PrivacyBudgetSpent
from protocol.integrity import DIGEST_HEADER, hash_bytes, parse_digest
from protocol.schemas import API_PREFIX, RAW_CODEC, UPDATE_HEADER, UpdateMeta, check_name, parse_header_json
from protocol.tensors import dumps

log = logging.getLogger(__name__)
bp = Blueprint("cohorts", __name__, url_prefix=API_PREFIX)
TICK_SECONDS = 0.5
EXTENSION = "fedmoe_secagg"
BUDGETS = "fedmoe_secagg_budgets"
"""The BudgetCheck a join is checked against: the root's ledgers under DP, a relay's SpentBudgets, or None."""


class SecureAggregationRequired(Forbidden):
    """A push in the clear to a coordinator that takes updates only through secure-aggregation cohorts."""

    code = "secure_aggregation_required"


class CohortHost(Protocol):
    """What the root's ``Coordinator`` and a ``RelayService`` both offer the cohorts."""

    def manifest(self, name: str) -> list[tuple[str, tuple[int, ...]]]: ...
    def receive_body(self, stream: Any, length: int | None, expected_digest: str | None,
                     spooled: Any = None) -> Path: ...
    def submit_update(self, name: str, meta: UpdateMeta, body: Path) -> tuple[dict[str, Any], bool]: ...


def refuse_clear_push(meta: UpdateMeta) -> None:
    """The push route's check under --secure-aggregation: only a relay's batch (a cohort's mean) comes in clear."""
    if current_app.extensions.get(EXTENSION) is not None and meta.members is None:
        raise SecureAggregationRequired(
            "this coordinator takes updates only through secure-aggregation cohorts; start the worker with "
            "--secure-aggregation (its update is then masked, and only the cohort's sum is seen here)")


class BudgetCheck(Protocol):
    """What a cohort join is checked against: PrivacyBudgetSpent once the expert's budget is spent."""

    def check_budget(self, name: str) -> None: ...


Booking = Callable[[CohortConfig, int], "str | None"]
"""Asked before a DP cohort's masks come off (``SecureAggregator.ready``'s release): None once its step is booked,
the reason to abandon it unopened if it cannot be, ``ReleaseDeferred`` to ask again at the next tick."""


def dp_cohort_sum(config: CohortConfig, survivors: int) -> DPCohortSum | None:
    """What a DP cohort's step is booked and forwarded as (None for a cohort without DP)."""
    if config.dp is None:
        return None
    return DPCohortSum(cohort_update_id(config.cohort_id), len(config.members), survivors,
                       config.dp.noise_multiplier, config.dp.clip_norm)


def ledger_booking(ledgers: PrivacyLedgers) -> Booking:
    """The root's booking: in its own ledger, before the masks come off (a sum seen is privacy spent)."""

    def book(config: CohortConfig, survivors: int) -> str | None:
        try:
            ledgers.book_cohort(config.expert, cohort_update_id(config.cohort_id), survivors, len(config.members))
        except PrivacyBudgetSpent as exc:
            log.error("cohort %s of %s abandoned unopened: %s", config.cohort_id, config.expert, exc.message)
            return f"the expert's privacy budget is spent: {exc.message}"
        return None

    return book


class CohortApplier:
    """The background loop: deadlines, then every unmasked cohort handed to the host as one update."""

    def __init__(self, aggregator: SecureAggregator, host: CohortHost, booking: Booking | None = None) -> None:
        self.aggregator, self.host, self.booking = aggregator, host, booking
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedmoe-secagg", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad cohort; it is logged
                log.exception("secure aggregation: a tick failed")

    def run_once(self) -> None:
        self.aggregator.tick()
        for ready in self.aggregator.ready(self.booking):
            self.apply(ready)

    def apply(self, ready: CohortSum) -> None:
        config = ready.config
        manifest = self.host.manifest(config.expert)
        data = dumps(unflatten(ready.mean, manifest))
        body = self.host.receive_body(io.BytesIO(data), len(data), None)
        base = min(int(m.get("base_version", 0)) for m in ready.meta.values())
        meta = UpdateMeta(update_id=ready.update_id, base_version=base, num_samples=ready.weight, codec=RAW_CODEC,
                          members={m.get("update_id", f"{config.cohort_id}-{w}"): m["digest"]
                                   for w, m in ready.meta.items()},
                          dp_cohort=dp_cohort_sum(config, len(ready.members)))  # a relay forwards it marked so
        try:
            self.host.submit_update(config.expert, meta, body)
        except REFUSALS as exc:  # refused for good (not finite, norm rejected): nothing applied, members re-queue
            log.error("cohort %s of %s refused: %s; abandoning it", config.cohort_id, config.expert, exc)
            self.aggregator.abandon(config.cohort_id, f"its sum was refused: {exc}")
            return
        self.aggregator.applied(config.cohort_id)
        log.info("cohort %s of %s applied: %d members, %d samples", config.cohort_id, config.expert,
                 len(ready.members), ready.weight)


def install(app: Flask, host: CohortHost, settings: SecAggSettings, data_dir: Path,
            ledgers: PrivacyLedgers | None = None, booking: Booking | None = None,
            budgets: BudgetCheck | None = None) -> CohortApplier:
    """Mount the cohort routes over an aggregator journalled in ``data_dir/secagg``, and start its applier.

    At the root, ``ledgers`` with DP settings (its --dp-noise) makes every cohort a DP cohort, booked there. A relay
    passes its own ``booking`` (at its root, coordinator/relay/dp_cohorts.py) and announces the root's sigma and C
    to the aggregator once it has learned them (``SecureAggregator.announce_dp``), and ``budgets``, what its root
    said of spent budgets, which a join is checked against as the root checks its ledgers."""
    journal = CohortJournal(data_dir / "secagg")
    dp = ledgers.dp if ledgers is not None else None
    noise = CohortNoise(dp.noise_multiplier, dp.clip_norm) if dp is not None else None
    aggregator = SecureAggregator(journal, settings, lambda expert: manifest_numel(host.manifest(expert)), dp=noise)
    if dp is not None and ledgers is not None:
        booking = ledger_booking(ledgers)
    applier = CohortApplier(aggregator, host, booking)
    app.extensions[EXTENSION] = aggregator
    app.extensions[BUDGETS] = ledgers if dp is not None else budgets
    app.extensions["fedmoe_secagg_host"] = host
    app.register_blueprint(bp)
    applier.start()
    return applier


def aggregator() -> SecureAggregator:
    found = current_app.extensions.get(EXTENSION)
    if found is None:
        raise NotFound("secure aggregation is off here (the coordinator runs without --secure-aggregation)")
    return found


def _worker(claimed: Any) -> str:
    worker = acting_worker(claimed if isinstance(claimed, str) else None, "worker_id")
    if worker is None:
        raise BadRequest("a cohort request must name its worker_id")
    return check_name(worker, "worker_id")


def _json() -> dict[str, Any]:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object (Content-Type: application/json)")
    return body


@bp.post("/experts/<name>/cohorts")
def join(name: str) -> Response:
    check_name(name, "expert name")
    current_app.extensions["fedmoe_secagg_host"].manifest(name)  # 404 for an unknown expert
    budgets = current_app.extensions.get(BUDGETS)
    if budgets is not None:  # 409 privacy_budget_spent: a cohort formed now could never be applied
        budgets.check_budget(name)
    return jsonify(aggregator().join(name, _worker(_json().get("worker_id"))))


@bp.get("/cohorts/<cohort_id>")
def status(cohort_id: str) -> Response:
    return jsonify(aggregator().status(cohort_id, _worker(request.args.get("worker_id"))))


@bp.post("/cohorts/<cohort_id>/keys")
def post_keys(cohort_id: str) -> Response:
    body = _json()
    return jsonify(aggregator().post_keys(cohort_id, _worker(body.get("worker_id")), body))


@bp.post("/cohorts/<cohort_id>/shares")
def post_shares(cohort_id: str) -> Response:
    body = _json()
    return jsonify(aggregator().post_shares(cohort_id, _worker(body.get("worker_id")), body))


@bp.get("/cohorts/<cohort_id>/shares")
def shares(cohort_id: str) -> Response:
    return jsonify(aggregator().shares_for(cohort_id, _worker(request.args.get("worker_id"))))


@bp.post("/cohorts/<cohort_id>/inputs")
def post_input(cohort_id: str) -> tuple[Response, int]:
    meta = parse_header_json(request.headers.get(UPDATE_HEADER), UPDATE_HEADER)
    worker = _worker(meta.get("worker_id"))
    agg = aggregator()
    expected = 4 * (agg.numel_of_cohort(cohort_id) + 1)
    if request.content_length is not None and request.content_length != expected:
        raise (PayloadTooLarge if request.content_length > expected else BadSecAggMessage)(
            f"a masked input for cohort {cohort_id} is {expected} bytes, got {request.content_length}")
    body = request.stream.read(expected + 1)
    digest = hash_bytes(body)
    header = request.headers.get(DIGEST_HEADER)
    if header is not None and parse_digest(header) != digest:
        raise BadRequest(f"the body does not match its {DIGEST_HEADER}; nothing was recorded")
    update_id, base = meta.get("update_id"), meta.get("base_version", 0)
    if not isinstance(base, int) or isinstance(base, bool) or base < 0 or (
            update_id is not None and not isinstance(update_id, str)):
        raise BadRequest(f"{UPDATE_HEADER}: base_version must be a non-negative integer, update_id a string")
    record = {"base_version": base, "digest": digest, **({"update_id": update_id} if update_id else {})}
    return jsonify(agg.post_masked(cohort_id, worker, body, record)), 202


@bp.post("/cohorts/<cohort_id>/answers")
def post_answer(cohort_id: str) -> Response:
    body = _json()
    return jsonify(aggregator().post_answer(cohort_id, _worker(body.get("worker_id")), body))


@bp.get("/cohorts")
def cohorts() -> Response:
    expert = request.args.get("expert")
    return jsonify({"cohorts": aggregator().cohorts(expert)})
