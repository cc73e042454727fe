"""The front's admission check: a request whose body the front would spool is judged from its head alone first.

Before (audit F9), the front read a body of up to --max-body-mb (1 GiB, spooled to the data dir) before the
application saw its request: a client with no token could fill the disk, and ``POST /api/v1/probe`` read 1 GiB
before its 4 MiB 413. Here the front (coordinator/http/front.py, ``Admission``) asks, on a request thread and before any
of a large body is read, what the application would answer from the head alone: its route (404/405), its token and
the route's rule (coordinator/access/auth.py: 401, 403) and the route's own body limit (413). A refusal is the
application's own JSON answer (audited like any 401/403); the front sends it and closes the connection.

The rate limiter too (429 with Retry-After from the head, issue 30): its token is taken here and the request is
marked (coordinator/access/auth.py, RATE_TAKEN), so that the application does not take a second one. Everything that needs
the body is left to the request itself. Bodies the front keeps in memory (up to 1 MiB) are not asked about, unless
the client waits for the head's verdict (Expect: 100-continue): the application answers as usual.
"""
from __future__ import annotations

from flask import Flask, request

from coordinator.api.requests import JSON_BODY_LIMIT, PROMPT_BODY_LIMIT
from coordinator.http.flask_admission import FlaskAdmission, route_exists
from protocol.errors import PayloadTooLarge
from protocol.probe import MAX_PROBE_BYTES

BODY_LIMITS: dict[str, int] = {
    "relays.probe_upload": MAX_PROBE_BYTES, "api.probe_upload": MAX_PROBE_BYTES,  # coordinator/api/relays.py reads this much
    "api.route": PROMPT_BODY_LIMIT,  # json_body(PROMPT_BODY_LIMIT)
    # the views that read their body with json_body() and its default limit
    "api.register_worker": JSON_BODY_LIMIT, "api.put_profile": JSON_BODY_LIMIT, "uploads.open_upload": JSON_BODY_LIMIT,
    "relays.register_relay": JSON_BODY_LIMIT, "relays.relay_report": JSON_BODY_LIMIT,
    # secure aggregation's JSON rounds (coordinator/cohorts.py): keys, sealed shares, unmasking answers
    "cohorts.join": JSON_BODY_LIMIT, "cohorts.post_keys": JSON_BODY_LIMIT, "cohorts.post_shares": JSON_BODY_LIMIT,
    "cohorts.post_answer": JSON_BODY_LIMIT,
}
"""Endpoints (named as in coordinator/access/auth.py's RULES, the same in a relay) whose views take less than --max-body-mb."""


class HeadAdmission(FlaskAdmission):
    """``Admission`` for a FedMoE app (the root's or a relay's): same routes, same auth, same error answers."""

    def __init__(self, app: Flask) -> None:
        super().__init__(app, lambda: _check(app))


def _check(app: Flask) -> None:
    route_exists()  # the answer does not depend on the body
    auth = app.extensions.get("fedmoe_auth")
    caller = auth.authorize_request() if auth is not None else None  # the request's token and rule
    limit = BODY_LIMITS.get(request.endpoint or "")
    if limit is not None and request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"a body on this route may be at most {limit} bytes, got {request.content_length}",
                              limit=limit)
    if auth is not None:  # last: a request refused above costs its caller no token
        auth.take_rate(caller)
