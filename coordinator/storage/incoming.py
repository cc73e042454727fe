"""Where a large request body lands as it arrives, as the HTTP front and the stores agree on it.

The front (coordinator/http/bodies.py) writes a body to a ``SpooledBody`` file, or into a ``BodyPlace`` the
application named before the body arrived (a resumable upload's chunk, coordinator/storage/upload_files.py);
the stores take the file over instead of copying it. Plain records: nothing here reads a socket or a file.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


@dataclass
class BodyPlace:
    """Where the application wants a large body written as it arrives, instead of a spool file of its own: the
    bytes go into ``file`` from ``offset`` on (e.g. a resumable upload's chunk, into the upload's file), and are
    fed to ``hashers`` too (e.g. the upload's running digest) besides the body's own digest.

    The application has made the place ready and holds what keeps it (the upload's lock) until ``release``, which
    the front calls exactly once when the request is over, whether the body arrived whole or not and whether the
    application used it or not: ``release`` undoes what was written unless the application kept it."""

    file: IO[bytes]
    """Open for writing, positioned at ``offset``."""
    path: Path
    offset: int
    release: Callable[[], None]
    hashers: tuple[Any, ...] = ()
    key: Any = None
    """What the application recognises the place by when its handler runs (e.g. (upload id, offset, length))."""
    hash_body: bool = True
    """Whether the front also takes the body's own digest (``SpooledBody.digest``); else ``hashers`` stand for it."""


@dataclass
class SpooledBody:
    """A request body spooled to a named file as it arrived, with its digest."""

    path: Path
    size: int
    digest: str
    """Content id (protocol/integrity.py) of the bytes, in the algorithm the client's digest header names ("" for a
    body written into a place that asked for no digest of its own)."""
    taken: bool = False
    """Set by the application when it moved the file away; otherwise the front deletes it."""
    place: BodyPlace | None = field(default=None, repr=False)
    """Set when the body was written into the application's ``BodyPlace`` (at ``place.offset`` of ``path``)."""
