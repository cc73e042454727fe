"""One resumable upload's record (``Upload``): what coordinator/storage/upload_files.py keeps in ``<id>.json``.

A leaf of its own, so the upload files and their bounds (coordinator/storage/upload_limits.py) both use it
without importing each other.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from protocol.schemas import UpdateMeta

UPLOAD_ID_RE = re.compile(r"[0-9a-f]{32}")


@dataclass
class Upload:
    """One resumable push. ``offset`` is the number of bytes received and acknowledged (durable)."""

    upload_id: str
    expert: str
    owner: str | None
    """The principal whose token opened it (only it, or the admin, may use it; coordinator/api/uploads.py
    ``owner_of``): a worker id, or ``relay:<id>``; None when opened by the admin."""
    meta: UpdateMeta
    size: int
    digest: str
    """SHA-256 (hex) the whole body must have."""
    offset: int = 0
    created_at: float = 0.0
    touched_at: float = 0.0
    completed: bool = False
    """The push ran; the body is gone and the record stays (until it expires) to answer a retried finish."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    hasher: Any = field(default=None, repr=False, compare=False)
    """SHA-256 of body[:offset], or None until rebuilt after a restart."""

    def to_json(self) -> dict[str, Any]:
        return {"upload_id": self.upload_id, "expert": self.expert, "owner": self.owner, "meta": self.meta.to_json(),
                "size": self.size, "digest": self.digest, "offset": self.offset, "created_at": self.created_at,
                "touched_at": self.touched_at, "completed": self.completed}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Upload":
        upload = cls(upload_id=str(obj["upload_id"]), expert=str(obj["expert"]), owner=obj["owner"],
                     meta=UpdateMeta.from_json(obj["meta"]), size=int(obj["size"]), digest=str(obj["digest"]),
                     offset=int(obj["offset"]), created_at=float(obj["created_at"]),
                     touched_at=float(obj["touched_at"]), completed=bool(obj["completed"]))
        if not UPLOAD_ID_RE.fullmatch(upload.upload_id) or not 0 <= upload.offset <= upload.size:
            raise ValueError(f"bad upload record {upload.upload_id!r}")
        return upload

    def status(self, idle_seconds: float) -> dict[str, Any]:
        return {"upload_id": self.upload_id, "update_id": self.meta.update_id, "expert": self.expert,
                "offset": self.offset, "size": self.size, "complete": self.completed,
                "expires_at": self.touched_at + idle_seconds}
