"""Access rules of the HTTP API, checked once per request before any view runs.

Each endpoint needs one of these (README, "Security", has the table):

- ``public``: anyone (health check, the dashboard page itself; it asks for a token to read data).
- ``join``: the join token or admin (registering a worker); also a worker's own token, expired or
  not, to renew it. The join token cannot register an id that is active (``coordinator.access.tokens``).
  Registering a relay takes the relay join token instead (or the relay's own token, or admin); the relay
  join token is good for nothing else.
- ``read``: any valid token (metadata: experts, workers, gateway info, metrics, routing).
- ``expert``: a worker token of that expert's specialty, or admin (create it, push, pull its
  weights, send profiles). Where the path names a worker, the token must be that worker's.
- ``self``: that worker's own token, or admin (heartbeat).
- ``admin``: admin only (gateway weights, revoking workers).

Endpoints not in the table (added later) need ``read`` for GET/HEAD and ``admin`` otherwise, so
a new endpoint is never open by accident. Then the rate limiter: per worker for worker tokens,
per client address for the join token, none for the admin.

Who a worker is comes from its token, never from request fields: a worker token's pushes and
pulls are recorded under its worker id, and a worker id in the metadata or the X-FedMoE-Worker
header that differs is a 403. Every refusal here (401, 403, 429) goes to the audit log under
the caller (the token's worker, the join token's address, or unknown), throttled per caller so a
flood of bad requests cannot push the real history out of the bounded log.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, current_app, g, jsonify, request
from flask.testing import FlaskClient

from coordinator.access.audit import refusal_event, rejection_event
from coordinator.storage.audit_log import Event
from coordinator.config import CoordinatorConfig
from coordinator.access.ratelimit import RateLimiter
from coordinator.access.tokens import ADMIN, JOIN, RELAY, RELAY_JOIN, WORKER, Principal, TokenStore
from protocol.errors import FedMoEError, Forbidden, TooManyRequests, Unauthorized
from protocol.schemas import UPDATE_HEADER, WORKER_HEADER, UpdateMeta

PUBLIC, JOIN_ONLY, READ, EXPERT, SELF, ADMIN_ONLY = "public", "join", "read", "expert", "self", "admin"
RULES: dict[str, str] = {
    "api.health": PUBLIC, "dashboard": PUBLIC, "static": PUBLIC,
    "api.register_worker": JOIN_ONLY,
    "api.list_workers": READ, "api.list_experts": READ, "api.expert_info": READ, "api.update_status": READ,
    "api.route": READ, "api.profiles": READ, "api.gateway_info": READ, "api.events": READ, "metrics": READ,
    "api.create_expert": EXPERT, "api.expert_weights": EXPERT, "api.push_update": EXPERT,
    "api.put_profile": EXPERT,
    "uploads.open_upload": EXPERT, "uploads.upload_status": EXPERT, "uploads.upload_chunk": EXPERT,
    "uploads.complete_upload": EXPERT, "uploads.abandon_upload": EXPERT,
    "api.heartbeat": SELF,
    "api.gateway_weights": ADMIN_ONLY, "api.revoke_worker": ADMIN_ONLY,
    "relays.probe": PUBLIC, "api.probe": PUBLIC,  # protocol/probe.py: throughput, before a worker has a token
    "relays.probe_upload": READ, "api.probe_upload": READ,  # bytes in: only for callers with a token
    "relays.register_relay": JOIN_ONLY, "relays.list_relays": READ, "relays.relay_report": SELF,
    "relays.book_dp_cohort": EXPERT,  # relay (or admin) tokens only, checked in the view
    "placement.report_probes": SELF, "placement.placement_view": READ,  # coordinator/api/placement.py
    # secure aggregation (coordinator.cohorts): joining names the expert; a cohort's rounds need the worker's own
    # token (the view takes the worker id from it), never the join token
    "cohorts.join": EXPERT, "cohorts.status": SELF, "cohorts.post_keys": SELF, "cohorts.post_shares": SELF,
    "cohorts.shares": SELF, "cohorts.post_input": SELF, "cohorts.post_answer": SELF, "cohorts.cohorts": READ,
}
ADMIN_PRINCIPAL = Principal(ADMIN)
RATE_TAKEN = "fedmoe.rate_taken"
"""WSGI environ key: this request's rate-limit token was taken from its head (``Authenticator.take_rate``)."""


REFUSALS_LOGGED_PER_CALLER = 6.0
"""Audit rows per minute for one caller's refused requests; the rest are counted into its next row."""
REFUSALS_LOGGED = 120.0
"""Audit rows per minute for refused requests of all callers together."""


class RefusalLog:
    """Writes refusals to the audit log, at most so many a minute per caller and overall."""

    def __init__(self, record_event: Callable[[Event], None]) -> None:
        self._record_event = record_event
        self.per_caller = RateLimiter(REFUSALS_LOGGED_PER_CALLER)
        self.overall = RateLimiter(REFUSALS_LOGGED)
        self._unlogged: dict[str, int] = {}  # caller -> refusals not written since its last row
        self._lock = threading.Lock()

    def record(self, caller_key: str, event: Event) -> None:
        with self._lock:
            if len(self._unlogged) > 10_000:  # keys include client addresses: keep the table bounded
                self._unlogged.clear()
            if self.per_caller.acquire(caller_key) > 0 or self.overall.acquire("*") > 0:
                self._unlogged[caller_key] = self._unlogged.get(caller_key, 0) + 1
                return
            skipped = self._unlogged.pop(caller_key, 0)
        if skipped:
            event.detail["not_logged_before"] = skipped
        self._record_event(event)


class Authenticator:
    def __init__(self, config: CoordinatorConfig, record_event: Callable[[Event], None]) -> None:
        """``record_event`` writes an audit row (``Coordinator.record_event``): refusals go there."""
        if config.manifest:  # replicas: tokens in the shared database (coordinator/access/postgres_tokens.py)
            from coordinator.access.postgres_tokens import PostgresTokenStore
            self.tokens: TokenStore = PostgresTokenStore(config.manifest, config.data_dir, config.admin_token_file,
                                             config.token_ttl_hours * 3600)
        else:
            self.tokens = TokenStore(config.data_dir, config.admin_token_file, config.token_ttl_hours * 3600)
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit else None
        self.refusals = RefusalLog(record_event)

    @property
    def admin_token(self) -> str:
        return self.tokens.admin_token

    def check_request(self) -> Response | None:
        """Flask before_request hook: None lets the request through, a response ends it."""
        if request.endpoint is None:  # 404/405: let Flask answer
            return None
        caller = self.authorize_request()
        if caller is None:
            return None
        g.principal = caller
        if request.environ.get(RATE_TAKEN):  # the front's admission check took this request's token from its head
            return None
        wait, key = self._take_rate(caller)
        if wait > 0:
            response, exc = _too_many(key, wait)
            self.record_refusal(exc)
            return response
        return None

    def take_rate(self, caller: Principal | None) -> None:
        """Take the current request's token from ``caller``'s bucket, from the head alone (coordinator/api/admission.py):
        TooManyRequests (audited, with its Retry-After) when it is empty. Marks the request (RATE_TAKEN) so that
        ``check_request`` does not take a second token for it."""
        if caller is None:
            return
        wait, key = self._take_rate(caller)
        if wait > 0:
            exc = _too_many_error(key, wait)
            self.record_refusal(exc)
            raise exc
        request.environ[RATE_TAKEN] = True

    def _take_rate(self, caller: Principal) -> tuple[float, str]:
        """(seconds until ``caller`` may send again, 0 when it may now, its bucket's key); no limit for the admin."""
        if caller.role == ADMIN or self.limiter is None:
            return 0.0, ""
        # per worker; join-token calls (registrations, reads) per client address
        key = caller.worker_id if caller.role == WORKER else \
            f"relay:{caller.worker_id}" if caller.role == RELAY else f"{caller.role}@{request.remote_addr}"
        return self.limiter.acquire(key or ""), key or ""

    def authorize_request(self) -> Principal | None:
        """The current request's caller under its route's rule (None: a public route); 401/403 as FedMoEError.
        No rate limit (``take_rate``, ``check_request``)."""
        rule = RULES.get(request.endpoint or "") or (READ if request.method in ("GET", "HEAD") else ADMIN_ONLY)
        if rule == PUBLIC:
            return None
        caller = g.caller = self.tokens.authenticate(bearer_token(), allow_expired=rule == JOIN_ONLY)  # expired: renew
        _authorize(caller, rule, request.view_args or {})
        return caller

    def record_refusal(self, exc: FedMoEError) -> None:
        """Audit a refused request (the app's error handler calls this for every 401 and 403).

        Who: the authenticated caller, else the worker an expired or revoked token belongs to, else
        the client address. A refused push becomes an update_rejected row, like the view's own.
        """
        if g.get("audited"):
            return
        g.audited = True
        caller: Principal | None = g.get("caller")
        worker_id = caller.worker_id if caller is not None else self.tokens.owner(bearer_token())
        role = caller.role if caller is not None else ("worker" if worker_id else "unknown")
        who = worker_id or f"{role}@{request.remote_addr}"
        args = request.view_args or {}
        if request.endpoint == "api.push_update":
            event = rejection_event(str(args.get("name")), exc.status, exc.code, exc.message, exc.details,
                                    request.headers.get(UPDATE_HEADER), request.headers.get(WORKER_HEADER),
                                    request.remote_addr, caller=who)
        else:
            event = refusal_event(exc.status, exc.code, exc.message, request.method, request.path,
                                  args.get("name"), worker_id, role, request.remote_addr)
        self.refusals.record(who, event)


def bearer_token() -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _authorize(p: Principal, rule: str, args: dict[str, Any]) -> None:
    if p.role == ADMIN:
        return
    if rule == JOIN_ONLY:  # a worker token may renew itself: check_may_register, in the view
        return
    if p.role == RELAY_JOIN:
        raise Forbidden("the relay join token only registers relays (POST /api/v1/relays); a relay works with the "
                        "relay token that registering returns")
    if p.expired:  # never reached: only JOIN_ONLY authenticates with allow_expired
        raise Unauthorized(f"the token of worker {p.worker_id!r} expired", reason="expired")
    if rule == READ:
        return
    if p.role == JOIN:
        raise Forbidden("the join token can only register workers and read; use the worker token that "
                        "registering (POST /api/v1/workers) returned")
    if rule == ADMIN_ONLY:
        raise Forbidden("this endpoint needs the admin token")
    if p.role == RELAY:  # a relay acts for its workers on any expert; SELF is its own report only
        if rule == SELF and args.get("relay_id") != p.worker_id:
            raise Forbidden(f"the token of relay {p.worker_id!r} can only report for itself")
        return
    if "relay_id" in args:
        raise Forbidden("this endpoint needs a relay's token")
    if rule in (EXPERT, SELF) and "worker_id" in args and args["worker_id"] != p.worker_id:
        raise Forbidden(f"a token of worker {p.worker_id!r} cannot act for worker {args['worker_id']!r}")
    if rule == EXPERT and args.get("name") != p.specialty:
        raise Forbidden(f"the token of worker {p.worker_id!r} is for expert {p.specialty!r}, "
                        f"not {args.get('name')!r}")


def _too_many_error(key: str, wait: float) -> TooManyRequests:
    retry_after = max(1, math.ceil(wait))
    return TooManyRequests(f"{key!r} is over the coordinator's --rate-limit; retry in {retry_after} s",
                           retry_after=retry_after)


def _too_many(key: str, wait: float) -> tuple[Response, TooManyRequests]:
    error = _too_many_error(key, wait)
    retry_after = error.details["retry_after"]
    response = jsonify(error.to_json())
    response.status_code = error.status
    response.headers["Retry-After"] = str(retry_after)
    return response, error


def principal() -> Principal:
    """Who is calling; admin when auth is off."""
    return g.get("principal", ADMIN_PRINCIPAL)


def authenticator() -> Authenticator | None:
    return current_app.extensions.get("fedmoe_auth")


def acting_worker(claimed: str | None, field: str) -> str | None:
    """The worker a request is recorded under: a worker token's own id (a different ``claimed`` id,
    from the request's ``field``, is a 403), else the claimed one (admin, or auth off)."""
    p = principal()
    if p.role != WORKER:  # admin, or a relay acting for its workers
        return claimed
    if claimed is not None and claimed != p.worker_id:
        raise Forbidden(f"a token of worker {p.worker_id!r} cannot act for worker {claimed!r} ({field})")
    return p.worker_id


def check_may_register(worker_id: str, specialty: str) -> None:
    """Forbidden unless the caller may (re-)register this worker id (``coordinator.access.tokens``)."""
    auth = authenticator()
    if auth is not None:
        auth.tokens.check_may_register(principal(), worker_id, specialty)


def check_may_carry_members(meta: UpdateMeta) -> None:
    """Only a relay (or the admin) names the worker updates a push carries: a worker that could would
    claim other workers' update ids, and the root would then refuse their pushes as duplicates."""
    if meta.members is not None and principal().role == WORKER:
        raise Forbidden("a worker's update cannot carry 'members' (only a relay's combined update does)")


def issue_token(worker_id: str, specialty: str) -> dict[str, object]:
    """A new worker token (``{}`` with auth off), checked once more against concurrent registrations."""
    auth = authenticator()
    return auth.tokens.issue(worker_id, specialty, principal()) if auth is not None else {}


class AdminTestClient(FlaskClient):
    """Flask's in-process test client, acting as the admin unless given ``token=`` (None: no token).

    It never touches the network; in-process callers hold the data dir, and so the admin token,
    anyway. Tests written without tokens keep working; auth tests pass their own.
    """

    def __init__(self, *args: Any, token: str | None | bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        auth = self.application.extensions.get("fedmoe_auth")
        if token is True:
            token = auth.admin_token if auth else None
        if token:
            self.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {token}"


def install(app: Flask, config: CoordinatorConfig, record_event: Callable[[Event], None]) -> None:
    """Turn authentication on for ``app`` (unless ``config.auth`` is off); refusals go to ``record_event``."""
    app.test_client_class = AdminTestClient
    if not config.auth:
        return
    auth = Authenticator(config, record_event)
    app.extensions["fedmoe_auth"] = auth
    app.before_request(auth.check_request)
