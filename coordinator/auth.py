"""Access rules of the HTTP API, checked once per request before any view runs.

Each endpoint needs one of these (README, "Security", has the table):

- ``public``: anyone (health check, the dashboard page itself; it asks for a token to read data).
- ``join``: the join token or admin (registering a worker).
- ``read``: any valid token (metadata: experts, workers, gateway info, metrics, routing).
- ``expert``: a worker token of that expert's specialty, or admin (create it, push, pull its
  weights, send profiles). Where the path names a worker, the token must be that worker's.
- ``self``: that worker's own token, or admin (heartbeat).
- ``admin``: admin only (gateway weights, revoking workers).

Endpoints not in the table (added later) need ``read`` for GET/HEAD and ``admin`` otherwise, so
a new endpoint is never open by accident. Then the rate limiter: per worker for worker tokens,
per client address for the join token, none for the admin.
"""
from __future__ import annotations

import math
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from flask.testing import FlaskClient

from coordinator.config import CoordinatorConfig
from coordinator.ratelimit import RateLimiter
from coordinator.tokens import ADMIN, JOIN, WORKER, Principal, TokenStore
from protocol.errors import Forbidden, TooManyRequests
from protocol.schemas import API_PREFIX

PUBLIC, JOIN_ONLY, READ, EXPERT, SELF, ADMIN_ONLY = "public", "join", "read", "expert", "self", "admin"
RULES: dict[str, str] = {
    "api.health": PUBLIC, "dashboard": PUBLIC, "static": PUBLIC,
    "api.register_worker": JOIN_ONLY,
    "api.list_workers": READ, "api.list_experts": READ, "api.expert_info": READ, "api.update_status": READ,
    "api.route": READ, "api.profiles": READ, "api.gateway_info": READ, "api.events": READ, "metrics": READ,
    "api.create_expert": EXPERT, "api.expert_weights": EXPERT, "api.push_update": EXPERT,
    "api.put_profile": EXPERT,
    "api.heartbeat": SELF,
    "api.gateway_weights": ADMIN_ONLY, "auth.revoke_worker": ADMIN_ONLY,
}
ADMIN_PRINCIPAL = Principal(ADMIN)

bp = Blueprint("auth", __name__, url_prefix=API_PREFIX)


class Authenticator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.tokens = TokenStore(config.data_dir, config.admin_token_file, config.token_ttl_hours * 3600)
        self.limiter = RateLimiter(config.rate_limit) if config.rate_limit else None

    @property
    def admin_token(self) -> str:
        return self.tokens.admin_token

    def check_request(self) -> Response | None:
        """Flask before_request hook: None lets the request through, a response ends it."""
        if request.endpoint is None:  # 404/405: let Flask answer
            return None
        rule = RULES.get(request.endpoint) or (READ if request.method in ("GET", "HEAD") else ADMIN_ONLY)
        if rule == PUBLIC:
            return None
        principal = self.tokens.authenticate(bearer_token())
        _authorize(principal, rule, request.view_args or {})
        g.principal = principal
        if principal.role != ADMIN and self.limiter is not None:
            # per worker; join-token calls (registrations, reads) per client address
            key = principal.worker_id if principal.role == WORKER else f"join@{request.remote_addr}"
            wait = self.limiter.acquire(key or "")
            if wait > 0:
                return _too_many(key or "", wait)
        return None


def bearer_token() -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _authorize(p: Principal, rule: str, args: dict[str, Any]) -> None:
    if p.role == ADMIN:
        return
    if rule == JOIN_ONLY:
        if p.role != JOIN:
            raise Forbidden("registering a worker needs the join token (or the admin token)")
        return
    if rule == READ:
        return
    if p.role == JOIN:
        raise Forbidden("the join token can only register workers and read; use the worker token that "
                        "registering (POST /api/v1/workers) returned")
    if rule == ADMIN_ONLY:
        raise Forbidden("this endpoint needs the admin token")
    if rule in (EXPERT, SELF) and "worker_id" in args and args["worker_id"] != p.worker_id:
        raise Forbidden(f"a token of worker {p.worker_id!r} cannot act for worker {args['worker_id']!r}")
    if rule == EXPERT and args.get("name") != p.specialty:
        raise Forbidden(f"the token of worker {p.worker_id!r} is for expert {p.specialty!r}, "
                        f"not {args.get('name')!r}")


def _too_many(key: str, wait: float) -> Response:
    retry_after = max(1, math.ceil(wait))
    error = TooManyRequests(f"{key!r} is over the coordinator's --rate-limit; retry in {retry_after} s",
                            retry_after=retry_after)
    response = jsonify(error.to_json())
    response.status_code = error.status
    response.headers["Retry-After"] = str(retry_after)
    return response


def principal() -> Principal:
    """Who is calling; admin when auth is off."""
    return g.get("principal", ADMIN_PRINCIPAL)


def authenticator() -> Authenticator | None:
    return current_app.extensions.get("fedmoe_auth")


def check_acts_as(worker_id: str | None) -> None:
    """A worker token may only speak for its own worker (e.g. the worker_id in a push's metadata)."""
    p = principal()
    if p.role == WORKER and worker_id is not None and worker_id != p.worker_id:
        raise Forbidden(f"a token of worker {p.worker_id!r} cannot act for worker {worker_id!r}")


@bp.delete("/workers/<worker_id>")
def revoke_worker(worker_id: str) -> Response:
    """Revoke a worker's tokens; it cannot register again under this id."""
    from coordinator.api import coordinator

    known = any(w["worker_id"] == worker_id for w in coordinator().list_workers())
    return jsonify(current_app.extensions["fedmoe_auth"].tokens.revoke(worker_id, known))


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


def install(app: Flask, config: CoordinatorConfig) -> None:
    """Turn authentication on for ``app`` (unless ``config.auth`` is off)."""
    app.test_client_class = AdminTestClient
    if not config.auth:
        return
    app.register_blueprint(bp)
    auth = Authenticator(config)
    app.extensions["fedmoe_auth"] = auth
    app.before_request(auth.check_request)
