"""The one error a backend raises when it cannot be used right now."""
from __future__ import annotations

import threading
import time

from protocol.errors import Unavailable

RETRY_AFTER_S = 5
LOG_EVERY_S = 30.0
_last_logged: dict[str, float] = {}
_guard = threading.Lock()


def log_outage(logger, backend: str, message: str, *args) -> None:
    """Log a backend failure as one error line, then at most once per LOG_EVERY_S while it lasts (a busy
    coordinator would otherwise log every request that found it down)."""
    now = time.monotonic()
    with _guard:
        first = now - _last_logged.get(backend, -LOG_EVERY_S) >= LOG_EVERY_S
        if first:
            _last_logged[backend] = now
    logger.log(40 if first else 10, message, *args)


class BackendUnavailable(Unavailable):
    """A database or object store is down, unreachable or full: 503 with Retry-After; nothing was recorded."""

    def __init__(self, message: str, backend: str) -> None:
        super().__init__(message, backend=backend, retry_after=RETRY_AFTER_S)
