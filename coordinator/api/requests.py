"""What a view reads from its request: the service that answers it, a JSON object, a tensor body.

Shared by every blueprint of the API (the root's routes, resumable uploads, the relay registry, placement,
and a relay's own API), so none of them imports another's views for these. ``WorkerFacing`` is what the views
a relay shares with the root (registration, heartbeats, the audit log, diff pulls, refused pushes, bodies)
need of the service behind them: the root's ``Coordinator`` and a relay's ``RelayService`` both offer it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from flask import current_app, request
from werkzeug.exceptions import ClientDisconnected

from coordinator.storage.audit_log import Event
from coordinator.access.auth import principal
from coordinator.access.tokens import WORKER
from coordinator.http.wsgi import SPOOLED_BODY
from coordinator.service import Coordinator
from protocol.errors import BadRequest, PayloadTooLarge, RequestTimeout
from protocol.integrity import DIGEST_HEADER, ClientReader, Readable, parse_digest
from protocol.schemas import BaseModelSpec, loads_json


class WorkerFacing(Protocol):
    """The service a worker talks to, root or relay, as far as the views they share use it."""

    def register_worker(self, worker_id: str, specialty: str, base_model: BaseModelSpec,
                        sync_interval: float | None) -> dict[str, Any]: ...
    def heartbeat(self, worker_id: str) -> None: ...
    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]: ...
    def weights_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any],
                     version: int | None = None) -> tuple[bytes, int]: ...
    def record_pull(self, worker_id: str | None, name: str, body_bytes: int) -> None: ...
    def record_event(self, event: Event) -> None: ...
    def check_body_size(self, length: int | None) -> None: ...
    def receive_body(self, stream: Readable, length: int | None, expected_digest: str | None,
                     spooled: Any = None) -> Path: ...


def service() -> WorkerFacing:
    """The service answering this request: the root's Coordinator or a relay's RelayService."""
    return current_app.extensions["fedmoe"]


def coordinator() -> Coordinator:
    """The root's Coordinator (only the root's own views call this)."""
    return current_app.extensions["fedmoe"]


JSON_BODY_LIMIT = 1 << 20  # registrations, profiles: a few KiB in practice
PROMPT_BODY_LIMIT = 64 << 10  # /route: parsing and routing cost ~100x the body, so keep it small


def json_body(limit: int = JSON_BODY_LIMIT) -> dict[str, Any]:
    """The request's JSON object, read up to ``limit`` bytes (413 above it), nested at most MAX_JSON_DEPTH."""
    if not request.is_json:
        raise BadRequest("request body must be a JSON object (Content-Type: application/json)")
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"a JSON body on this route may be at most {limit} bytes, got "
                              f"{request.content_length}", limit=limit)
    raw = request.stream.read(limit + 1)  # chunked bodies have no Content-Length: stop past the limit
    if len(raw) > limit:
        raise PayloadTooLarge(f"a JSON body on this route may be at most {limit} bytes", limit=limit)
    data = loads_json(raw, "request body")
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object (Content-Type: application/json)")
    return data


def receive_body() -> Path:
    """Stream the request body into a fsynced temp file, enforcing the size limit up front.

    With an X-FedMoE-Digest header (our workers always send one; worker tokens must) the body is
    hashed on the way and a mismatch is a 400 that leaves nothing behind. A large body the front
    already spooled into the blob store's temp dir (hashing it as it arrived) is taken as it is.
    """
    c = service()
    c.check_body_size(request.content_length)  # 413 before anything is read
    header = request.headers.get(DIGEST_HEADER)
    if header is None and principal().role == WORKER:
        raise BadRequest(f"a worker's upload must carry {DIGEST_HEADER}: blake3=<hex digest of the body>")
    expected = parse_digest(header) if header is not None else None
    # chunked: let werkzeug find the end; else the raw input (werkzeug's wrapper would copy every chunk twice more)
    stream = request.stream if request.content_length is None else request.environ["wsgi.input"]
    try:
        return c.receive_body(ClientReader(stream), request.content_length, expected,
                              request.environ.get(SPOOLED_BODY))
    except ClientDisconnected:  # a read that failed: stalled past --socket-timeout, or gone
        raise RequestTimeout("the request body stopped arriving before its Content-Length; send it again") from None
