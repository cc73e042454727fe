"""A client's update calls: push a compressed update, ask what became of one, probe the upload link.

Uploads carry their digest (``protocol.integrity``). Pushes of at least ``UploadPolicy.threshold``
bytes (8 MiB) go up in chunks and resume after a break where it stopped (``protocol.uploads``,
docs/wan.md); a coordinator that opens no upload gets the body in one request.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests

from protocol.client.bodies import Chunks
from protocol.client.transport import Transport
from protocol.schemas import UPDATE_HEADER
from protocol.uploads import ResumablePush, UploadPolicy, UploadRefused, UploadStats, UploadsUnsupported

log = logging.getLogger(__name__)


class Updates:
    def __init__(self, transport: Transport, policy: UploadPolicy = UploadPolicy()) -> None:
        self.transport = transport
        self.policy = policy
        """When and how pushes go through a resumable upload."""
        self.last_upload: UploadStats | None = None
        """What the latest resumable push cost (bytes sent and re-sent, resumes); None before one."""

    def push(self, name: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Push an update; the coordinator's UpdateStatus. Large bodies go through a resumable upload."""
        if len(body) >= self.policy.threshold:
            try:
                return self._push_resumable(name, body, meta)
            except UploadRefused as exc:  # the body may still fit where an upload did not (issue 30)
                log.info("%s opened no upload for update %s (%s); pushing it in one request", self.transport.base_url,
                         meta.get("update_id"), exc)
            except UploadsUnsupported as exc:
                log.info("%s has no resumable uploads (%s); pushing update %s in one request", self.transport.base_url,
                         exc, meta.get("update_id"))
        return self.transport.upload("POST", f"/experts/{name}/updates", body, worker=meta.get("worker_id"),
                                     expert=name, headers={UPDATE_HEADER: json.dumps(meta),
                                                           "Content-Type": "application/octet-stream"})

    def _push_resumable(self, name: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        worker = meta.get("worker_id")

        def call(method: str, path: str, attempts: int | None = None, **kwargs: Any) -> requests.Response:
            if "data" in kwargs:  # a chunk: sent as views, each under the socket timeout
                kwargs["data"] = Chunks(kwargs["data"])
            return self.transport.request(method, path, worker=worker, expert=name, attempts=attempts, **kwargs)

        retry = self.transport.retry
        push = ResumablePush(call, name, body, meta, self.policy, retry.attempts, retry.delay,
                             algorithm=self.transport.digest_algorithm)
        try:
            return push.run()
        finally:
            self.last_upload = push.stats
            if push.stats.resumes:
                log.info("push of update %s resumed %d times: %d of %d body bytes sent again", meta.get("update_id"),
                         push.stats.resumes, push.stats.resent, len(body))

    def status(self, update_id: str) -> dict[str, Any]:
        """What became of a pushed update (``GET /updates/<id>``): pending, applied, rejected ..."""
        return self.transport.json("GET", f"/updates/{update_id}")

    def probe(self, nbytes: int, worker_id: str, expert: str) -> float:
        """Seconds one POST of ``nbytes`` (at most protocol.probe.MAX_PROBE_BYTES) to /probe took, one attempt:
        the upload throughput a worker's first ``--compression auto`` push is sized from."""
        started = time.perf_counter()
        self.transport.request("POST", "/probe", worker=worker_id, expert=expert, attempts=1, data=bytes(nbytes),
                               headers={"Content-Type": "application/octet-stream"})
        return time.perf_counter() - started
