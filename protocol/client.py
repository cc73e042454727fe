"""Typed HTTP client for the coordinator API, used by workers and the gateway tool.

Every call has a timeout. Connection failures and 5xx answers are retried with
exponential backoff and jitter (every call is safe to repeat: pushes carry an
``update_id`` the coordinator deduplicates); 429 answers are retried after their
Retry-After; other 4xx answers become the same ``FedMoEError`` subclass the
server raised. After the last retry a failure is ``Unavailable``.

Credentials (README, "Security"): the token given, else ``FEDMOE_TOKEN``, else the
one a coordinator on this machine recorded (``protocol.credentials``). Registering a
worker returns a token scoped to its specialty; the client keeps it and uses it for
that worker's pushes, pulls, heartbeats and profiles, and registers again once if
it is rejected (expired). It also keeps it on disk (``protocol.credentials``): a worker id
that holds a valid token can only be registered again with that token (or by the admin), so
registering presents the worker's own token first, the join token only if that is refused.
Uploads carry their SHA-256 (``protocol.integrity``). Pushes of at least ``UploadPolicy.threshold`` bytes
(8 MiB) go up in chunks and resume after a break where it stopped (``protocol.uploads``, docs/wan.md).

Exception tree (``protocol.errors``; the status each answers with in parentheses)::

    FedMoEError
    ├── BadRequest (400)
    │   └── InvalidPayload (400)
    ├── Unauthorized (401)
    ├── Forbidden (403)
    ├── NotFound (404)
    ├── RequestTimeout (408)
    ├── Conflict (409)
    ├── PayloadTooLarge (413)
    ├── InvalidUpdate (422)
    ├── TLSFailure            (client side only: the handshake failed)
    └── Unavailable (503)     (also: unreachable after the last retry)
        ├── TooManyRequests (429)
        └── InsufficientStorage (507)
"""
from __future__ import annotations

import json
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3

from protocol.credentials import resolve_token, store_worker_token, stored_worker_token
from protocol.expect import EXPECT_FROM, send_expecting_continue
from protocol.errors import (BadRequest, FedMoEError, Forbidden, TLSFailure, TooManyRequests, Unauthorized, Unavailable,
                             error_from_response)
from protocol.integrity import DEFAULT_ALGORITHM, DIGEST_HEADER, digest_header, is_old_server_refusal
from protocol.probe import LinkEstimate, choose, probe, split_urls
from protocol.resume import can_resume, check_etag, resumable_body
from protocol.schemas import API_PREFIX, EXPERT_HEADER, REDIRECT_HEADER, UPDATE_HEADER, VERSION_HEADER, WORKER_HEADER
from protocol.streaming import tensors_from_buffer
from protocol.tensors import StateDict, dumps
from protocol.uploads import ResumablePush, UploadPolicy, UploadRefused, UploadStats, UploadsUnsupported

PULL_CHUNK = 4 << 20  # bytes read from the socket at a time into a pull's preallocated buffer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    """Tries per call, the first included."""
    base_delay: float = 0.5
    """Seconds before the first retry; doubles each time, with full jitter."""
    max_delay: float = 10.0
    max_retry_after: float = 60.0
    """Longest Retry-After (from a 429) we wait for; longer ones are capped."""

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
    resumes: int = 0
    """How many times an interrupted body was resumed with a Range request."""


class CoordinatorClient:
    def __init__(self, base_url: str, *, timeout: tuple[float, float] = (5.0, 120.0),
                 retry: RetryPolicy = RetryPolicy(), use_proxy: bool = False, token: str | None = None,
                 ca_cert: str | Path | None = None, upload: UploadPolicy = UploadPolicy(),
                 failback_seconds: float = 300.0, prober: Callable[[str], LinkEstimate] = probe) -> None:
        """``timeout`` is (connect, read) seconds for every call; ``ca_cert`` a PEM file to trust for https;
        ``upload`` when and how pushes go through a resumable upload.

        ``base_url`` may be a comma list (relays and the root): the client probes them and talks to the
        best (protocol/probe.py), fails over to the next best when its coordinator stops answering, and
        re-probes every ``failback_seconds`` to fail back when a better one is up again.
        """
        self._candidates = split_urls(base_url) if "," in base_url else []
        self._prober, self.failback_seconds = prober, failback_seconds
        self._probed_at = time.monotonic()
        self.base_url = self._best()[0] if self._candidates else base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry
        self.upload = upload
        self.last_upload: UploadStats | None = None
        """What the latest resumable push cost (bytes sent and re-sent, resumes); None before one."""
        self.session = requests.Session()
        self.session.trust_env = use_proxy  # honour HTTP(S)_PROXY only when asked to
        if ca_cert is not None:
            if not Path(ca_cert).is_file():
                raise ValueError(f"--ca-cert {str(ca_cert)!r} does not exist")
            self.session.verify = str(ca_cert)
        self._token = token
        self._worker_tokens: dict[str, tuple[str, str]] = {}  # worker_id -> (token, specialty)
        self._expert_tokens: dict[str, tuple[str, str]] = {}  # specialty -> its latest (token, worker_id)
        self._registrations: dict[str, dict[str, Any]] = {}  # worker_id -> body, to renew its token
        self.digest_algorithm = DEFAULT_ALGORITHM  # sha256 once a coordinator older than 0.7 refused blake3
        self._plain_http_seen: set[str] = set()  # base URLs that answered plain HTTP: no TLS probe after a drop

    def close(self) -> None:
        self.session.close()

    @property
    def token(self) -> str | None:
        """The token given, else FEDMOE_TOKEN, else the local coordinator's: looked up on every call, so a
        coordinator started (or restarted on a fresh data dir) after this client is still found."""
        return resolve_token(self.base_url, self._token)[0]

    # plumbing -----------------------------------------------------------------

    def _token_for(self, worker: str | None, expert: str | None) -> tuple[str | None, str | None]:
        """(token, worker it belongs to or None) for a call on behalf of ``worker`` / about ``expert``."""
        if worker in self._worker_tokens:
            token, specialty = self._worker_tokens[worker]
            if None in (expert, specialty) or specialty == expert:  # a heartbeat names no expert: still this worker's
                return token, worker
        if expert is not None and expert in self._expert_tokens:
            return self._expert_tokens[expert]
        return self.token, None

    def _best(self, exclude: str | None = None) -> list[str]:
        """Reachable candidates, best first (``exclude`` left out); all of them if none answers."""
        self._probed_at = time.monotonic()
        ranked = choose([u for u in self._candidates if u != exclude], prober=self._prober)
        return [e.url for e in ranked if e.reachable] or [e.url for e in ranked]

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One call at the current coordinator; with several (a comma list), fail over and back."""
        if self._candidates and time.monotonic() - self._probed_at >= self.failback_seconds:
            best = self._best()[0]
            if best != self.base_url:
                log.info("switching from %s to %s (measured better)", self.base_url, best)
                self.base_url = best
        try:
            return self._request_here(method, path, **kwargs)
        except Unavailable as exc:
            if len(self._candidates) < 2 or isinstance(exc, TooManyRequests):
                raise
            failed, self.base_url = self.base_url, self._best(exclude=self.base_url)[0]
            log.warning("%s; failing over from %s to %s", exc, failed, self.base_url)
            return self._request_here(method, path, **kwargs)

    def _request_here(self, method: str, path: str, *, worker: str | None = None, expert: str | None = None,
                      attempts: int | None = None, **kwargs: Any) -> requests.Response:
        """One call with the right token; ``attempts`` overrides RetryPolicy.attempts (1: no retry)."""
        token, owner = self._token_for(worker, expert)
        try:
            return self._attempts(method, path, token, attempts, **kwargs)
        except Unauthorized as exc:
            if owner is None or owner not in self._registrations:
                if owner is None and token is not None:
                    exc.message = f"{exc.message} (token from {resolve_token(self.base_url, self._token)[1]})"
                    exc.args = (exc.message,)
                raise
            log.info("worker token of %s rejected (%s); registering again", owner, exc)
            self.register_worker(**self._registrations.pop(owner))
            return self._attempts(method, path, self._token_for(worker, expert)[0], attempts, **kwargs)

    def _attempts(self, method: str, path: str, token: str | None, attempts: int | None = None,
                  **kwargs: Any) -> requests.Response:
        url = f"{self.base_url}{API_PREFIX}{path}"
        headers = dict(kwargs.pop("headers", None) or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        last, wait, refusal = "", None, None
        attempts = self.retry.attempts if attempts is None else attempts
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1) if wait is None else wait)
            wait, refusal = None, None
            try:
                response = self._send(method, url, headers, kwargs)
            except requests.exceptions.SSLError as exc:
                raise TLSFailure(_tls_message(self.base_url, exc)) from None
            except requests.exceptions.ProxyError as exc:  # the proxy, not the coordinator, is the one to check
                last = (f"cannot reach the coordinator through the proxy {self._proxy(url)} (from the environment, "
                        f"because of --use-proxy): {_reason(exc)}; check the proxy or drop --use-proxy")
                log.debug("%s %s failed (%s), attempt %d", method, path, last, attempt + 1)
                continue
            except requests.RequestException as exc:
                if isinstance(exc, requests.ConnectionError) and self._plain_http_to_tls():
                    raise TLSFailure(f"{self.base_url} speaks TLS (the coordinator runs with --tls-cert): use "
                                     f"https://{self.base_url.split('://', 1)[1]}") from None
                last = f"cannot reach the coordinator at {self.base_url}: {_reason(exc)}"
                log.debug("%s %s failed (%s), attempt %d", method, path, last, attempt + 1)
                continue
            self._plain_http_seen.add(self.base_url)
            if response.status_code == 429:
                wait = _retry_after(response, self.retry.max_retry_after)
                last = f"coordinator rate-limited {method} {path} (HTTP 429)"
                if attempt + 1 == attempts:
                    raise error_from_response(429, _json(response))
                log.info("rate-limited by the coordinator; retrying in %.1f s", wait)
                continue
            if response.status_code < 500 or response.status_code == 501:
                if response.status_code >= 400:
                    raise error_from_response(response.status_code, _json(response))
                return response
            last = f"coordinator answered HTTP {response.status_code} to {method} {path}"
            if response.status_code == 503 and "Retry-After" in response.headers:  # e.g. the first gateway builds
                wait = _retry_after(response, self.retry.max_retry_after)
                last += f": {error_from_response(503, _json(response)).message}"
            elif response.status_code == 507:  # raised as such: a caller tells "no room" from "unreachable"
                refusal = error_from_response(507, _json(response))
                last += f": {refusal.message}"
        if refusal is not None:
            raise type(refusal)(last + f" (gave up after {attempts} tries)", **refusal.details)
        raise Unavailable(last + f" (gave up after {attempts} tries)")

    def _send(self, method: str, url: str, headers: dict[str, str], kwargs: dict[str, Any]) -> requests.Response:
        """One request. A body of EXPECT_FROM bytes or more first sends its head alone and waits for the server's
        verdict (protocol/expect.py), so that a refusal (401, 413, 429) costs no upload; not through a proxy."""
        body = kwargs.get("data")
        if not (isinstance(body, Chunks) and len(body) >= EXPECT_FROM and set(kwargs) <= {"data", "params"}) \
                or self._proxy_for(url):
            return self.session.request(method, url, timeout=self.timeout, headers=headers, **kwargs)
        prepared = self.session.prepare_request(requests.Request(method, url, headers=headers, **kwargs))
        return send_expecting_continue(prepared, self.session.verify, self.timeout)

    def _proxy_for(self, url: str) -> bool:
        """Whether ``url`` goes through a proxy (--use-proxy and the environment names one for it)."""
        return self.session.trust_env and bool(requests.utils.select_proxy(url, requests.utils.get_environ_proxies(url)))

    def _plain_http_to_tls(self) -> bool:
        """After a dropped http:// connection: does the port answer a TLS handshake? (Retrying would not help.)

        Asked only of a coordinator that never answered this client in plain HTTP: one that did drops a
        connection under load or a restart, and each probe was a TLS handshake its log showed as a 400."""
        parts = urlsplit(self.base_url)
        if parts.scheme != "http" or not parts.hostname or self.base_url in self._plain_http_seen:
            return False
        try:
            return _speaks_tls(parts.hostname, parts.port or 80, self.timeout[0])
        except ValueError:  # a bad port number: requests reports it
            return False

    def _proxy(self, url: str) -> str:
        """The proxy requests uses for ``url`` (HTTP(S)_PROXY, NO_PROXY), without its credentials."""
        proxy = requests.utils.select_proxy(url, requests.utils.get_environ_proxies(url)) or "?"
        parts = urlsplit(proxy)
        return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl() if parts.netloc else proxy

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # API ----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def register_worker(self, worker_id: str, specialty: str, base_model: dict[str, str],
                        sync_interval: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"worker_id": worker_id, "specialty": specialty, "base_model": base_model}
        if sync_interval is not None:
            body["sync_interval"] = sync_interval  # lets the coordinator tell alive from stale
        info = self._register(worker_id, body)
        token, expires_at = info.pop("token", None), info.get("token_expires_at")
        if token:  # from now on this worker's calls use its own, specialty-scoped token
            self._keep_worker_token(worker_id, token, expires_at)
            self._worker_tokens[worker_id] = (token, specialty)
            self._expert_tokens[specialty] = (token, worker_id)
            self._registrations[worker_id] = {"worker_id": worker_id, "specialty": specialty,
                                              "base_model": base_model, "sync_interval": sync_interval}
        return info

    def _register(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /workers with the worker's own token (renewal; expired is fine), else with our token."""
        # the token this coordinator issued (kept per URL: after failing back to a relay, its own), else ours
        owns = [stored_worker_token(self.base_url, worker_id),
                self._worker_tokens[worker_id][0] if worker_id in self._worker_tokens else None]
        for own in dict.fromkeys(t for t in owns if t):
            try:
                return self._attempts("POST", "/workers", own, json=body).json()
            except (Unauthorized, Forbidden) as exc:  # e.g. a coordinator on a fresh data dir never issued it
                log.info("the coordinator did not renew the token of %s (%s); registering with %s", worker_id,
                         exc, resolve_token(self.base_url, self._token)[1])
        return self._json("POST", "/workers", json=body)

    def _keep_worker_token(self, worker_id: str, token: str, expires_at: Any) -> None:
        try:
            store_worker_token(self.base_url, worker_id, token, float(expires_at or time.time()))
        except OSError as exc:  # only a restart within the token's lifetime needs it
            log.warning("cannot keep the token of worker %s on disk (%s); after a restart it needs the admin "
                        "token or another --worker-id", worker_id, exc)

    def heartbeat(self, worker_id: str) -> None:
        self._request("POST", f"/workers/{worker_id}/heartbeat", worker=worker_id)

    def revoke_worker(self, worker_id: str) -> dict[str, Any]:
        """Admin: revoke every token of ``worker_id``; it cannot register again."""
        return self._json("DELETE", f"/workers/{worker_id}")

    def relays(self) -> list[dict[str, Any]]:
        """The root's relays (GET /api/v1/relays): their URLs, workers and bytes saved."""
        return self._json("GET", "/relays")["relays"]

    def report_probes(self, worker_id: str, links: dict[str, dict[str, float | None]]) -> dict[str, Any]:
        """Send this worker's link measurements to the root (``POST /api/v1/workers/<id>/probes``): host id
        ("root" or a relay id) -> {"rtt_ms", "mbps"} (None: unreachable). The answer is the worker's placement."""
        return self._json("POST", f"/workers/{worker_id}/probes", worker=worker_id, json={"links": links})

    def placement(self) -> dict[str, Any]:
        """The root's plan (``GET /api/v1/placement``): its groups, each with the relay its members sync with."""
        return self._json("GET", "/placement")

    def move_to(self, urls: list[str]) -> bool:
        """Talk to ``urls[0]`` from the next call on, with the rest as its fail-over (as a comma list given at start
        would be, without probing them now); True if that changes the coordinator. A worker token is per
        coordinator: the first call at the new one registers again, and queued pushes keep their update ids, so
        a push acknowledged just before the move is applied once (docs/history/wan.md, "Exactly once across relays")."""
        urls = [u.rstrip("/") for u in urls]
        moved = urls[0] != self.base_url
        self._candidates = urls if len(urls) > 1 else []
        self.base_url, self._probed_at = urls[0], time.monotonic()
        return moved

    def list_workers(self) -> list[dict[str, Any]]:
        return self._json("GET", "/workers")["workers"]

    def events(self, kind: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The audit log, newest first (``GET /api/v1/events``), of one ``kind`` if given."""
        params: dict[str, Any] = {"limit": limit} | ({"kind": kind} if kind else {})
        return self._json("GET", "/events", params=params)["events"]

    def list_experts(self) -> list[dict[str, Any]]:
        return self._json("GET", "/experts")["experts"]

    def expert(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/experts/{name}")

    def create_expert(self, name: str, adapter: StateDict, spec: dict[str, Any]) -> dict[str, Any]:
        """Create the expert, or get it if it exists with the same setup (409 if not)."""
        body = dumps(adapter)
        return self._upload("PUT", f"/experts/{name}", body, expert=name, headers={EXPERT_HEADER: json.dumps(spec)})

    def _upload(self, method: str, path: str, body: bytes, headers: dict[str, str], **kwargs: Any) -> Any:
        """Send a body with its digest; against a coordinator older than 0.7 (sha256 only), once more in SHA-256."""
        for _ in range(2):
            try:
                return self._json(method, path, data=Chunks(body), **kwargs,
                                  headers=headers | {DIGEST_HEADER: digest_header(body, self.digest_algorithm)})
            except BadRequest as exc:
                if self.digest_algorithm == "sha256" or not is_old_server_refusal(str(exc)):
                    raise
                log.info("%s takes SHA-256 body digests only (before 0.7); using SHA-256", self.base_url)
                self.digest_algorithm = "sha256"
        raise AssertionError("unreachable")

    def pull_weights(self, name: str, etag: str | None = None, version: int | None = None,
                     worker_id: str | None = None) -> Pulled:
        headers = {"If-None-Match": etag} if etag else {}
        headers[REDIRECT_HEADER] = "1"  # a coordinator on an object store may send us to a presigned URL
        if worker_id:
            headers[WORKER_HEADER] = worker_id
        params = {"version": version} if version is not None else {}
        path = f"/experts/{name}/weights"
        r = self._request("GET", path, headers=headers, params=params, worker=worker_id, expert=name, stream=True)
        origin = r.history[0] if r.history else r  # the coordinator's answer: version and content-id ETag
        resumes = 0
        if can_resume(r):  # a drop mid-body resumes with Range + If-Range (protocol/resume.py)
            resend = {k: v for k, v in headers.items() if k != "If-None-Match"}
            body, r, resumes = resumable_body(
                r, lambda extra: self._request("GET", path, headers=resend | extra, params=params, worker=worker_id,
                                               expert=name, stream=True),
                self.retry.attempts, self.base_url)
        else:
            body = bytearray() if r.status_code == 304 else _read_body(r, self.base_url)
        if r.status_code != 304 and origin is not r and origin.headers.get("ETag"):
            check_etag(body, origin.headers["ETag"], self.base_url)  # the object store's bytes are ours
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
        r = self._request("GET", f"/experts/{name}/weights", params=params, headers=headers, worker=worker_id,
                          expert=name)
        return (b"" if r.status_code == 304 else r.content), int(r.headers.get(VERSION_HEADER, -1))

    def push_update(self, name: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Push an update; the coordinator's UpdateStatus. Large bodies go through a resumable upload."""
        if len(body) >= self.upload.threshold:
            try:
                return self._push_resumable(name, body, meta)
            except UploadRefused as exc:  # the body may still fit where an upload did not (issue 30)
                log.info("%s opened no upload for update %s (%s); pushing it in one request", self.base_url,
                         meta.get("update_id"), exc)
            except UploadsUnsupported as exc:
                log.info("%s has no resumable uploads (%s); pushing update %s in one request", self.base_url, exc,
                         meta.get("update_id"))
        return self._upload("POST", f"/experts/{name}/updates", body, worker=meta.get("worker_id"), expert=name,
                            headers={UPDATE_HEADER: json.dumps(meta), "Content-Type": "application/octet-stream"})

    def _push_resumable(self, name: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        worker = meta.get("worker_id")

        def call(method: str, path: str, attempts: int | None = None, **kwargs: Any) -> requests.Response:
            if "data" in kwargs:  # a chunk: sent as views, each under the socket timeout
                kwargs["data"] = Chunks(kwargs["data"])
            return self._request(method, path, worker=worker, expert=name, attempts=attempts, **kwargs)

        push = ResumablePush(call, name, body, meta, self.upload, self.retry.attempts, self.retry.delay,
                             algorithm=self.digest_algorithm)
        try:
            return push.run()
        finally:
            self.last_upload = push.stats
            if push.stats.resumes:
                log.info("push of update %s resumed %d times: %d of %d body bytes sent again", meta.get("update_id"),
                         push.stats.resumes, push.stats.resent, len(body))

    def probe_upload(self, nbytes: int, worker_id: str, expert: str) -> float:
        """Seconds one POST of ``nbytes`` (at most protocol.probe.MAX_PROBE_BYTES) to /probe took, one attempt:
        the upload throughput a worker's first ``--compression auto`` push is sized from."""
        started = time.perf_counter()
        self._request("POST", "/probe", worker=worker_id, expert=expert, attempts=1, data=bytes(nbytes),
                      headers={"Content-Type": "application/octet-stream"})
        return time.perf_counter() - started

    def update_status(self, update_id: str) -> dict[str, Any]:
        return self._json("GET", f"/updates/{update_id}")

    def put_profile(self, name: str, worker_id: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Send this worker's routing profile (protocol.profiles.profile_to_json) for its expert."""
        return self._json("PUT", f"/experts/{name}/profiles/{worker_id}", json=profile, worker=worker_id, expert=name)

    def route(self, prompt: str, threshold: float | None = None, expected: str | None = None) -> dict[str, Any]:
        """Which expert (or "gateway") should answer ``prompt``, with the scores; with ``expected`` (the expert
        the prompt belongs to) also the outcome: right, wrong_expert or fallback."""
        body: dict[str, Any] = {"prompt": prompt}
        if threshold is not None:
            body["threshold"] = threshold
        if expected is not None:
            body["expected"] = expected
        return self._json("POST", "/route", json=body)

    def profiles(self) -> dict[str, Any]:
        """{"threshold", "profiles": {expert: protocol.profiles.profile_to_json form}} for routing locally."""
        return self._json("GET", "/profiles")

    def gateway_info(self, fresh: bool = False) -> dict[str, Any]:
        """The newest gateway's description; ``fresh`` asks for one built from the experts as they are now
        (the coordinator builds it at once, without waiting for --gateway-interval; up to 30 s)."""
        return self._json("GET", "/gateway", params={"fresh": "1"} if fresh else {})

    def gateway_weights(self, fmt: str = "safetensors") -> bytes:
        return self._request("GET", "/gateway/weights", params={"format": fmt}).content

    def gateway_tensors(self) -> StateDict:
        """The gateway's tensors, streamed into one buffer (views into it, no further copies)."""
        params = {"format": "safetensors"}
        r = self._request("GET", "/gateway/weights", params=params, stream=True)
        if not can_resume(r):
            return tensors_from_buffer(_read_body(r, self.base_url))

        def refetch(extra: dict[str, str]) -> requests.Response:  # a drop mid-body resumes (protocol/resume.py)
            return self._request("GET", "/gateway/weights", params=params, headers=extra, stream=True)

        return tensors_from_buffer(resumable_body(r, refetch, self.retry.attempts, self.base_url)[0])


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


def _retry_after(response: requests.Response, cap: float) -> float:
    """Seconds a 429 asks us to wait (Retry-After in seconds), within [0.1, cap]."""
    try:
        seconds = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.1), cap)


def _tls_message(url: str, exc: requests.exceptions.SSLError) -> str:
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        detail = text.split("certificate verify failed:", 1)[-1].split("(_ssl", 1)[0].strip(" ')\"")
        return (f"the TLS certificate of {url} is not trusted ({detail}); pass --ca-cert with the coordinator's "
                "certificate or its CA")
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return f"{url} does not answer TLS; is the coordinator running without --tls-cert? use http://"
    return f"TLS handshake with {url} failed: {text[-200:]}"


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """True if ``host:port`` completes a TLS handshake (certificate not checked: we only ask the protocol)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ssl.SSLError):
        return False


def _reason(exc: Exception) -> str:
    if isinstance(exc, requests.ConnectionError):
        return "connection refused or dropped"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return type(exc).__name__


__all__ = ["CoordinatorClient", "FedMoEError", "Pulled", "RetryPolicy", "TLSFailure", "TooManyRequests",
           "Unavailable"]
