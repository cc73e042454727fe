"""Typed HTTP client for the coordinator API, used by workers and the gateway tool.

Every call has a timeout. Connection failures and 5xx answers are retried with
exponential backoff and jitter (every call is safe to repeat: pushes carry an
``update_id`` the coordinator deduplicates); 4xx answers become the same
``FedMoEError`` subclass the server raised. After the last retry a failure is
``Unavailable``.

Exception tree (``protocol.errors``): FedMoEError > BadRequest > InvalidPayload,
Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge, InvalidUpdate,
Unavailable.
"""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

from protocol.errors import FedMoEError, Unavailable, error_from_response
from protocol.schemas import API_PREFIX, EXPERT_HEADER, UPDATE_HEADER, VERSION_HEADER, WORKER_HEADER
from protocol.streaming import tensors_from_buffer
from protocol.tensors import StateDict, dumps

PULL_CHUNK = 4 << 20  # bytes read from the socket at a time into a pull's preallocated buffer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    """Tries per call, the first included."""
    base_delay: float = 0.5
    """Seconds before the first retry; doubles each time, with full jitter."""
    max_delay: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** attempt))


@dataclass(frozen=True)
class Pulled:
    """Result of a weights pull: tensors is None when unchanged (HTTP 304)."""

    tensors: StateDict | None
    version: int
    etag: str | None
    nbytes: int = 0
    """Body bytes received."""


class CoordinatorClient:
    def __init__(self, base_url: str, *, timeout: tuple[float, float] = (5.0, 120.0),
                 retry: RetryPolicy = RetryPolicy(), use_proxy: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry
        self.session = requests.Session()
        self.session.trust_env = use_proxy  # honour HTTP(S)_PROXY only when asked to

    def close(self) -> None:
        self.session.close()

    # plumbing -----------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        url = f"{self.base_url}{API_PREFIX}{path}"
        last: str = ""
        for attempt in range(self.retry.attempts):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                response = self.session.request(method, url, timeout=self.timeout, **kwargs)
            except requests.RequestException as exc:
                last = f"cannot reach the coordinator at {self.base_url}: {_reason(exc)}"
                log.debug("%s %s failed (%s), attempt %d", method, path, last, attempt + 1)
                continue
            if response.status_code < 500 or response.status_code == 501:
                if response.status_code >= 400:
                    raise error_from_response(response.status_code, _json(response))
                return response
            last = f"coordinator answered HTTP {response.status_code} to {method} {path}"
        raise Unavailable(last + f" (gave up after {self.retry.attempts} tries)")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # API ----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def register_worker(self, worker_id: str, specialty: str, base_model: dict[str, str],
                        sync_interval: float | None = None) -> dict[str, Any]:
        body = {"worker_id": worker_id, "specialty": specialty, "base_model": base_model}
        if sync_interval is not None:
            body["sync_interval"] = sync_interval  # lets the coordinator tell alive from stale
        return self._json("POST", "/workers", json=body)

    def heartbeat(self, worker_id: str) -> None:
        self._request("POST", f"/workers/{worker_id}/heartbeat")

    def list_workers(self) -> list[dict[str, Any]]:
        return self._json("GET", "/workers")["workers"]

    def list_experts(self) -> list[dict[str, Any]]:
        return self._json("GET", "/experts")["experts"]

    def expert(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/experts/{name}")

    def create_expert(self, name: str, adapter: StateDict, spec: dict[str, Any]) -> dict[str, Any]:
        """Create the expert, or get it if it exists with the same setup (409 if not)."""
        return self._json("PUT", f"/experts/{name}", data=Chunks(dumps(adapter)),
                          headers={EXPERT_HEADER: json.dumps(spec)})

    def pull_weights(self, name: str, etag: str | None = None, version: int | None = None,
                     worker_id: str | None = None) -> Pulled:
        headers = {"If-None-Match": etag} if etag else {}
        if worker_id:
            headers[WORKER_HEADER] = worker_id
        params = {"version": version} if version is not None else {}
        r = self._request("GET", f"/experts/{name}/weights", headers=headers, params=params, stream=True)
        body = bytearray() if r.status_code == 304 else _read_body(r, self.base_url)
        tensors = None if r.status_code == 304 else tensors_from_buffer(body)
        return Pulled(tensors, int(r.headers.get(VERSION_HEADER, -1)), r.headers.get("ETag"), len(body))

    def pull_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any] | None = None,
                  worker_id: str | None = None) -> tuple[bytes, int]:
        """The compressed difference between the current weights and version ``since``.

        Returns (payload, current version); the payload is empty when nothing changed. Decode it
        with ``compression.decode_update(payload, manifest, make_codec(codec, codec_config))``.
        """
        params = {"since": since, "codec": codec, "codec_config": json.dumps(codec_config or {})}
        headers = {WORKER_HEADER: worker_id} if worker_id else {}
        r = self._request("GET", f"/experts/{name}/weights", params=params, headers=headers)
        return (b"" if r.status_code == 304 else r.content), int(r.headers.get(VERSION_HEADER, -1))

    def push_update(self, name: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        return self._json("POST", f"/experts/{name}/updates", data=Chunks(body),
                          headers={UPDATE_HEADER: json.dumps(meta), "Content-Type": "application/octet-stream"})

    def update_status(self, update_id: str) -> dict[str, Any]:
        return self._json("GET", f"/updates/{update_id}")

    def put_profile(self, name: str, worker_id: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Send this worker's routing profile (gateway.router.profile_to_json) for its expert."""
        return self._json("PUT", f"/experts/{name}/profiles/{worker_id}", json=profile)

    def route(self, prompt: str, threshold: float | None = None) -> dict[str, Any]:
        """Which expert (or "gateway") should answer ``prompt``, with the scores."""
        body: dict[str, Any] = {"prompt": prompt}
        if threshold is not None:
            body["threshold"] = threshold
        return self._json("POST", "/route", json=body)

    def gateway_info(self) -> dict[str, Any]:
        return self._json("GET", "/gateway")

    def gateway_weights(self, fmt: str = "safetensors") -> bytes:
        return self._request("GET", "/gateway/weights", params={"format": fmt}).content

    def gateway_tensors(self) -> StateDict:
        """The gateway's tensors, streamed into one buffer (views into it, no further copies)."""
        r = self._request("GET", "/gateway/weights", params={"format": "safetensors"}, stream=True)
        return tensors_from_buffer(_read_body(r, self.base_url))


class Chunks:
    """A request body sent as 4 MiB views of one buffer, with its Content-Length.

    Python's ``sendall`` applies the socket timeout to the *whole* call, so one ``sendall`` of
    a 1 GiB body failed with "timed out" whenever the coordinator took longer than the 5 s
    connect timeout to take it all; per chunk, the timeout means "no progress for 5 s". The
    views copy nothing, and iterating again (a retry) starts from the first byte.
    """

    def __init__(self, body: bytes) -> None:
        self._view = memoryview(body).cast("B")

    def __len__(self) -> int:
        return len(self._view)

    def __iter__(self):
        return (self._view[i:i + PULL_CHUNK] for i in range(0, len(self._view), PULL_CHUNK))


def _read_body(response: requests.Response, base_url: str) -> bytearray:
    """A response body read straight into one buffer of its Content-Length, chunk by chunk.

    ``response.content`` joins a list of chunks (twice the body at its peak) and the safetensors
    loader then copies every tensor out of it; here the bytes land once and stay where they land.
    """
    try:
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit() or response.headers.get("Content-Encoding"):
            return bytearray(response.content)
        body = bytearray(int(length))
        view, got = memoryview(body), 0
        while got < len(body):
            n = response.raw.readinto(view[got:got + PULL_CHUNK])
            if not n:
                raise Unavailable(f"connection to {base_url} closed after {got} of {len(body)} body bytes")
            got += n
        return body
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise Unavailable(f"cannot read a response from {base_url}: {_reason(exc)}") from None
    finally:
        response.close()


def _json(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _reason(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.ConnectionError):
        return "connection refused or dropped"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return type(exc).__name__


__all__ = ["CoordinatorClient", "FedMoEError", "Pulled", "RetryPolicy", "Unavailable"]
