"""The front's placer for resumable uploads: a chunk is written into its upload's file as it arrives.

Before, a 64 MiB chunk was spooled by the front to a file of its own (written and hashed), then copied into the
upload's file (``copy_file_range``) while a thread hashed it again into the upload's running digest: per GiB,
0.54 s of writing plus 0.6-1.1 s of copying (docs/scale.md, fifth and seventh rounds). Here the front asks,
once the head is in and before any of the body is read, where the body goes (coordinator/http/front.py,
``BodyPlacer``): for ``PUT /api/v1/experts/<name>/uploads/<id>`` from the upload's owner (a worker or a relay, or the
admin), at the
upload's offset, the answer is the upload's own file (``UploadStore.place_chunk``), with the upload's lock held
until the request is over. The route's handler then only checks the chunk's digest and makes it durable.

The request still goes through the application as usual (token, rate limit, Content-Range checks, the answer);
anything this placer cannot vouch for (no token or a bad one, another principal's upload, an unknown id, a chunk not
at the offset, the upload busy) gets no place: the body is spooled and the handler answers as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from flask import Flask

from coordinator.access.auth import bearer_token
from coordinator.storage.incoming import BodyPlace
from coordinator.access.tokens import ADMIN, RELAY, WORKER
from coordinator.storage.upload_files import UploadStore
from coordinator.api.uploads import chunk_range, owner_of
from protocol.errors import FedMoEError
from protocol.schemas import API_PREFIX

CHUNK_PATH = re.compile(rf"{re.escape(API_PREFIX)}/experts/([^/?#]+)/uploads/([0-9a-f]{{32}})")


@dataclass(frozen=True)
class UploadPlacer:
    """``BodyPlacer`` for an app with the upload routes (coordinator/api/uploads.py ``install``)."""

    app: Flask

    def wants(self, method: str, path: str) -> bool:
        return method == "PUT" and CHUNK_PATH.fullmatch(path) is not None

    def place(self, environ: dict[str, Any]) -> BodyPlace | None:
        m = CHUNK_PATH.fullmatch(environ.get("PATH_INFO", ""))
        store: UploadStore | None = self.app.extensions.get("fedmoe_uploads")
        if m is None or store is None or environ.get("REQUEST_METHOD") != "PUT":
            return None
        name, upload_id = m.groups()
        with self.app.request_context(environ):
            try:
                upload = store.get(upload_id, name, self._caller())
                start, length = chunk_range(upload)
            except FedMoEError:  # the handler says what is wrong, with the body spooled as before
                return None
        own_digest = "HTTP_X_FEDMOE_DIGEST" in environ or "HTTP_X_FEDMOE_UPLOAD_DIGEST" not in environ
        return store.place_chunk(upload, start, length, hash_body=own_digest)

    def _caller(self) -> str | None:
        """The owner whose upload this may be (coordinator/api/uploads.py ``owner_of``; None: the admin, or auth off);
        FedMoEError if no upload may be written with this token."""
        auth = self.app.extensions.get("fedmoe_auth")
        if auth is None:
            return None
        caller = auth.tokens.authenticate(bearer_token())
        if caller.role not in (ADMIN, WORKER, RELAY):
            raise FedMoEError(f"the {caller.role} token cannot send chunks")
        return owner_of(caller)
