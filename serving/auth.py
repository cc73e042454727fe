"""Bearer-token access to the serving API, like the coordinator's: a token file, created if absent.

Decision (docs/serving.md): the server has its own API keys instead of asking the coordinator
about every request. The coordinator's tokens admit workers and admins to training data; a chat
user needs neither, and a per-request round trip to the coordinator would put it on the serving
path. The key file holds one key per line (comments with #); when it does not exist a random key
is written to it with mode 0600, as the coordinator does with its admin token.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from serving.errors import Unauthorized

log = logging.getLogger(__name__)


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("the API key file has no key; put one key per line in it")
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: Path) -> "ApiKeys":
        """Read the keys in ``path``, writing a fresh random key there first if it does not exist."""
        if not path.exists():
            _create(path)
            log.info("wrote a new API key to %s (clients send it as 'Authorization: Bearer <key>')", path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {str(path)!r} cannot be read: {exc}") from None
        return cls([line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")])

    def check(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' (the key is in the server's "
                               "--api-key-file)")
        given = token.encode()
        if not any(hmac.compare_digest(given, key) for key in self._keys):
            raise Unauthorized("invalid API key; use a key from the server's --api-key-file")


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"sk-fedmoe-{secrets.token_urlsafe(32)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
