"""Worker tokens in the replicas' shared PostgreSQL database (``--manifest postgresql://...``).

The same ``TokenStore`` (coordinator/access/tokens.py) over the connection, lock and error rules of the
PostgreSQL manifest backend (coordinator/storage/backends/postgres.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from coordinator.access.tokens import TokenStore
from coordinator.storage.backends.errors import BackendUnavailable
from coordinator.storage.backends.postgres import PgConnection, busy, unavailable


class PostgresTokenStore(TokenStore):
    """Worker tokens and revocations in PostgreSQL, so a token issued by one replica is good at every other.

    Each replica keeps its cache of tokens seen valid (coordinator/access/tokens.py); a revocation reaches
    the other replicas' caches only when those entries expire from it (see docs/scale.md).
    """

    def __init__(self, url: str, *args: Any, **kwargs: Any) -> None:
        self.url = url
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def _db(self) -> Iterator[Any]:
        try:
            db = PgConnection(self.url, rows=tuple_row)
        except BackendUnavailable:
            raise
        try:
            yield db
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            raise busy(self.url, exc) from None
        except psycopg.OperationalError as exc:
            raise unavailable(self.url, exc) from None
        finally:
            db.close()
