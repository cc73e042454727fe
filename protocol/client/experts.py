"""A client's expert calls: create and describe experts, pull their weights (whole, or as a diff), profiles.

A pull reads the body straight into one buffer (``protocol.client.bodies.read_body``) and resumes a
body cut mid-way with a Range request (``protocol.resume``); a coordinator on an object store may send
the pull to a presigned URL, whose bytes are checked against the coordinator's ETag.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import requests

from protocol.client.bodies import read_body
from protocol.client.transport import Transport
from protocol.resume import can_resume, check_etag, resumable_body
from protocol.schemas import EXPERT_HEADER, REDIRECT_HEADER, VERSION_HEADER, WORKER_HEADER
from protocol.streaming import tensors_from_buffer
from protocol.tensors import StateDict, dumps


@dataclass(frozen=True)
class Pulled:
    """Result of a weights pull: tensors is None when unchanged (HTTP 304)."""

    tensors: StateDict | None
    version: int
    etag: str | None
    nbytes: int = 0
    """Body bytes received."""
    resumes: int = 0
    """How many times an interrupted body was resumed with a Range request."""


class Experts:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def get(self, name: str) -> dict[str, Any]:
        """One expert's description (``GET /experts/<name>``): version, rank, updates applied, samples seen."""
        return self.transport.json("GET", f"/experts/{name}")

    def create(self, name: str, adapter: StateDict, spec: dict[str, Any]) -> dict[str, Any]:
        """Create the expert, or get it if it exists with the same setup (409 if not)."""
        return self.transport.upload("PUT", f"/experts/{name}", dumps(adapter), expert=name,
                                     headers={EXPERT_HEADER: json.dumps(spec)})

    def pull(self, name: str, etag: str | None = None, version: int | None = None,
             worker_id: str | None = None) -> Pulled:
        """The expert's weights (``version``, else the newest); ``Pulled.tensors`` is None if ``etag`` still holds."""
        headers = {"If-None-Match": etag} if etag else {}
        headers[REDIRECT_HEADER] = "1"  # a coordinator on an object store may send us to a presigned URL
        if worker_id:
            headers[WORKER_HEADER] = worker_id
        params = {"version": version} if version is not None else {}
        path = f"/experts/{name}/weights"

        def get(extra: dict[str, str]) -> requests.Response:
            return self.transport.request("GET", path, headers=extra, params=params, worker=worker_id, expert=name,
                                          stream=True)

        r = get(headers)
        origin = r.history[0] if r.history else r  # the coordinator's answer: version and content-id ETag
        resumes = 0
        if can_resume(r):  # a drop mid-body resumes with Range + If-Range (protocol/resume.py)
            resend = {k: v for k, v in headers.items() if k != "If-None-Match"}
            body, r, resumes = resumable_body(r, lambda extra: get(resend | extra), self.transport.retry.attempts,
                                              self.transport.base_url)
        else:
            body = bytearray() if r.status_code == 304 else read_body(r, self.transport.base_url)
        if r.status_code != 304 and origin is not r and origin.headers.get("ETag"):
            check_etag(body, origin.headers["ETag"], self.transport.base_url)  # the object store's bytes are ours
        tensors = None if r.status_code == 304 else tensors_from_buffer(body)
        return Pulled(tensors, int(origin.headers.get(VERSION_HEADER, -1)), origin.headers.get("ETag"), len(body),
                      resumes)

    def pull_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any] | None = None,
                  worker_id: str | None = None) -> tuple[bytes, int]:
        """The compressed difference between the current weights and version ``since``.

        Returns (payload, current version); the payload is empty when nothing changed. Decode it
        with ``compression.decode_update(payload, manifest, make_codec(codec, codec_config))``.
        """
        params = {"since": since, "codec": codec, "codec_config": json.dumps(codec_config or {})}
        headers = {WORKER_HEADER: worker_id} if worker_id else {}
        r = self.transport.request("GET", f"/experts/{name}/weights", params=params, headers=headers,
                                   worker=worker_id, expert=name)
        return (b"" if r.status_code == 304 else r.content), int(r.headers.get(VERSION_HEADER, -1))

    def put_profile(self, name: str, worker_id: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Send this worker's routing profile (protocol.profiles.profile_to_json) for its expert."""
        return self.transport.json("PUT", f"/experts/{name}/profiles/{worker_id}", json=profile, worker=worker_id,
                                   expert=name)

    def list(self) -> list[dict[str, Any]]:  # last: a method named list would shadow the type in the ones below
        """Every expert's description (``GET /experts``)."""
        return self.transport.json("GET", "/experts")["experts"]
