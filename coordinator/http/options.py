"""The buffering front's settings, and what it may ask the application before it reads a body."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coordinator.storage.incoming import BodyPlace
from coordinator.http.wsgi import Answer

log = logging.getLogger(__name__)


class BodyPlacer(Protocol):
    """Where the application wants some large bodies written as they arrive (coordinator/api/upload_placement.py)."""

    def wants(self, method: str, path: str) -> bool:
        """Whether to ask ``place`` for this request (on the event loop: must be cheap and never block)."""

    def place(self, environ: dict[str, Any]) -> BodyPlace | None:
        """On a request thread, before the body is read (``environ`` has the head, an empty ``wsgi.input``): a place
        for the body, or None to spool it as usual (the application then answers as it would have)."""


class Admission(Protocol):
    """What the application answers from a request's head alone (coordinator/api/admission.py), asked before a body
    the front would spool (over SPOOL_IN_MEMORY, or chunked), one over the limit or one the client holds back
    (Expect: 100-continue) is read: a client without a token, or over the route's own limit, costs no disk and no
    wait for its body (audit F9)."""

    def admit(self, environ: dict[str, Any]) -> Answer | None:
        """On a request thread (``environ`` has the head, an empty ``wsgi.input``): None to read the body and run the
        request as usual, or the answer to send instead; the front then closes the connection (the body is unread).
        Keys it adds to ``environ`` under ADMISSION_MARKS reach the request's own environ."""


@dataclass(frozen=True)
class FrontOptions:
    threads: int = 16
    """Request threads: requests whose application code runs at once."""
    socket_timeout: float = 60.0
    """Seconds a connection may make no progress (head, body or answer) before it is dropped."""
    keepalive: float = 30.0
    """Seconds an idle kept-alive connection stays open."""
    max_body: int = 1 << 30
    """Largest request body; a larger Content-Length is answered 413 before any of it is read."""
    max_body_flag: str = "coordinator flag --max-body-mb"
    """Where the 413 tells the client the limit comes from."""
    spool_dir: Path | None = None
    """Where bodies over 1 MiB are spooled (unlinked files); None = the system temp dir."""
    max_connections: int = 10_000
    """Connections held at once; more are closed at accept."""
    placer: BodyPlacer | None = None
    """Writes some spooled bodies where the application wants them instead (needs ``spool_dir``)."""
    admission: Admission | None = None
    """Refuses requests from their head before a large body is read."""
    tls_cert: Path | None = None
    """PEM certificate (chain): serve HTTPS (``coordinator.http.serve`` makes the TLS context from it)."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""


def ask_before_body(admission: Admission | None, placer: BodyPlacer | None,
                    environ: dict[str, Any]) -> tuple[Answer | None, BodyPlace | None]:
    """On a request thread: the application's refusal from the head, or else where it wants the body (or None)."""
    if admission is not None:
        refusal = admission.admit(environ)  # a bug here is the request's 500, as in the application itself
        if refusal is not None:
            return refusal, None
    if placer is None:
        return None, None
    try:
        return None, placer.place(environ)
    except Exception:  # noqa: BLE001 - a bug in the placer: spool the body as usual, the application answers
        log.exception("could not place the body of %s %s (a bug); spooling it", environ.get("REQUEST_METHOD"),
                      environ.get("PATH_INFO"))
        return None, None
