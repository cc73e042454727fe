"""The one error a backend raises when it cannot be used right now."""
from __future__ import annotations

from protocol.errors import Unavailable

RETRY_AFTER_S = 5


class BackendUnavailable(Unavailable):
    """A database or object store is down, unreachable or full: 503 with Retry-After; nothing was recorded."""

    def __init__(self, message: str, backend: str) -> None:
        super().__init__(message, backend=backend, retry_after=RETRY_AFTER_S)
