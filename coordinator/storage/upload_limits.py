"""Bounds on resumable uploads: how long an idle one lives, and how many one principal and all together may hold.

An open used to reserve the upload's declared size against free disk although nothing was written yet: 89 opens
of 1 GiB that never sent a byte (0.7 s of requests) claimed 73 GiB, and every resumable open after them, an
honest 9 MiB one included, was refused with 507 for the hour the idle uploads lived. Now an open reserves nothing:
an upload takes the disk its received bytes take. The open still asks whether this one body would fit on the disk
now (else 507), and a chunk the disk cannot hold is a 507 when it arrives, nothing of it kept.

What an open costs is then a record (two small files): bounded per principal (``per_owner``: a worker, or a relay),
in all (``max_open``) and in time (``idle_seconds``, minutes). Why a bounded record count cannot lock an honest
pusher out: at ``max_open``, an open evicts the uploads idle longest, if they have been idle at least
``protected_seconds``; an upload that received a chunk more recently, or is receiving one, is never evicted nor
expired. To keep every slot, an attacker has to keep sending bytes into all of them, from ``max_open / per_owner``
identities, each within its --rate-limit; even then an honest open is only refused with a 507, and the client
pushes the update in one request instead (protocol/uploads.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.storage.upload_record import Upload


@dataclass(frozen=True)
class UploadLimits:
    idle_seconds: float = 300.0
    """An upload with no chunk for this long expires and its files are removed (never one receiving a chunk)."""
    per_owner: int = 2
    """Open uploads one principal (a worker, a relay) may hold; opening one more evicts its least recently used."""
    max_open: int = 1000
    """Open uploads of every principal together (the admin's included)."""
    protected_seconds: float = 60.0
    """An upload with a chunk this recent is never evicted to make room for another principal's open."""

    def __post_init__(self) -> None:
        if not self.idle_seconds > 0 or not self.protected_seconds >= 0:
            raise ValueError(f"upload idle time must be > 0 s and the protected time >= 0 s, got "
                             f"{self.idle_seconds}, {self.protected_seconds}")
        if self.per_owner < 1 or self.max_open < 1:
            raise ValueError(f"need at least 1 upload per principal and in all, got {self.per_owner}, {self.max_open}")


def is_expired(upload: Upload, now: float, limits: UploadLimits) -> bool:
    """Idle past ``idle_seconds`` and not receiving a chunk now (a chunk arriving holds the upload's lock)."""
    return upload.touched_at < now - limits.idle_seconds and not upload.lock.locked()


def own_evictions(mine: Sequence[Upload], limits: UploadLimits) -> list[Upload]:
    """Which of one principal's open uploads go so that it may open one more: its least recently used."""
    oldest_first = sorted(mine, key=lambda u: u.touched_at)
    return oldest_first[:max(0, len(oldest_first) - limits.per_owner + 1)]


def global_evictions(open_uploads: Sequence[Upload], now: float, limits: UploadLimits) -> list[Upload] | None:
    """Which open uploads go so that one more may open under ``max_open``: the longest idle, none of them with a chunk
    in the last ``protected_seconds`` or one arriving. None when there are not enough such uploads (refuse the open)."""
    excess = len(open_uploads) - limits.max_open + 1
    if excess <= 0:
        return []
    since = now - limits.protected_seconds
    stale = sorted((u for u in open_uploads if u.touched_at < since and not u.lock.locked()),
                   key=lambda u: u.touched_at)
    return stale[:excess] if len(stale) >= excess else None
