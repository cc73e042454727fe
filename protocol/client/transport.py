"""How every client call reaches a coordinator: timeouts, retries, fail-over, TLS, tokens.

Every call has a timeout. Connection failures and 5xx answers are retried with
exponential backoff and jitter (every call is safe to repeat: pushes carry an
``update_id`` the coordinator deduplicates); 429 answers are retried after their
Retry-After; other 4xx answers become the same ``FedMoEError`` subclass the
server raised. After the last retry a failure is ``Unavailable``.

``base_url`` may be a comma list (relays and the root): the transport probes them and talks to
the best (protocol/probe.py), fails over to the next best when its coordinator stops answering,
and re-probes every ``failback_seconds`` to fail back when a better one is up again.

Which token a call carries is the ``Credentials``' choice (a worker's own token, a relay's);
without one, the token given, else ``FEDMOE_TOKEN``, else the one a coordinator on this machine
recorded (``protocol.credentials``). A 401 to a token its credentials can renew registers again
once and repeats the call.
"""
from __future__ import annotations

import logging
import random
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests

from protocol.client.bodies import Chunks, reason
from protocol.credentials import resolve_token
from protocol.errors import BadRequest, TLSFailure, TooManyRequests, Unauthorized, Unavailable, error_from_response
from protocol.expect import EXPECT_FROM, send_expecting_continue
from protocol.integrity import DEFAULT_ALGORITHM, DIGEST_HEADER, digest_header, is_old_server_refusal
from protocol.probe import LinkEstimate, choose, probe, split_urls
from protocol.schemas import API_PREFIX

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


class Credentials(Protocol):
    """Who a call is made as: the token it carries, and how to get a new one after a 401."""

    def token_for(self, worker: str | None, expert: str | None) -> tuple[str | None, str | None]:
        """(token, owner: who ``renew`` can register again, or None) for a call for ``worker`` about ``expert``."""
        ...

    def renew(self, owner: str) -> bool:
        """Register ``owner`` again after its token was refused; False if it cannot be."""
        ...


class Transport:
    def __init__(self, base_url: str, *, timeout: tuple[float, float] = (5.0, 120.0),
                 retry: RetryPolicy = RetryPolicy(), use_proxy: bool = False, token: str | None = None,
                 ca_cert: str | Path | None = None, failback_seconds: float = 300.0,
                 prober: Callable[[str], LinkEstimate] = probe) -> None:
        """``timeout`` is (connect, read) seconds for every call; ``ca_cert`` a PEM file to trust for https."""
        self._candidates = split_urls(base_url) if "," in base_url else []
        self._prober, self.failback_seconds = prober, failback_seconds
        self._probed_at = time.monotonic()
        self.base_url = self._best()[0] if self._candidates else base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry
        self.session = requests.Session()
        self.session.trust_env = use_proxy  # honour HTTP(S)_PROXY only when asked to
        if ca_cert is not None:
            if not Path(ca_cert).is_file():
                raise ValueError(f"--ca-cert {str(ca_cert)!r} does not exist")
            self.session.verify = str(ca_cert)
        self._token = token
        self.credentials: Credentials | None = None
        self.digest_algorithm = DEFAULT_ALGORITHM  # sha256 once a coordinator older than 0.7 refused blake3
        self._plain_http_seen: set[str] = set()  # base URLs that answered plain HTTP: no TLS probe after a drop

    def close(self) -> None:
        self.session.close()

    @property
    def token(self) -> str | None:
        """The token given, else FEDMOE_TOKEN, else the local coordinator's: looked up on every call, so a
        coordinator started (or restarted on a fresh data dir) after this client is still found."""
        return resolve_token(self.base_url, self._token)[0]

    @property
    def token_source(self) -> str:
        """Where ``token`` comes from, for messages ("--token", "FEDMOE_TOKEN", a file)."""
        return resolve_token(self.base_url, self._token)[1]

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

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def upload(self, method: str, path: str, body: bytes, headers: dict[str, str], **kwargs: Any) -> Any:
        """Send a body with its digest; against a coordinator older than 0.7 (sha256 only), once more in SHA-256."""
        for _ in range(2):
            try:
                return self.json(method, path, data=Chunks(body), **kwargs,
                                 headers=headers | {DIGEST_HEADER: digest_header(body, self.digest_algorithm)})
            except BadRequest as exc:
                if self.digest_algorithm == "sha256" or not is_old_server_refusal(str(exc)):
                    raise
                log.info("%s takes SHA-256 body digests only (before 0.7); using SHA-256", self.base_url)
                self.digest_algorithm = "sha256"
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One call at the current coordinator; with several (a comma list), fail over and back.

        ``worker`` / ``expert`` say whose token to send; ``attempts`` overrides RetryPolicy.attempts (1: no retry);
        the rest goes to ``requests``."""
        if self._candidates and time.monotonic() - self._probed_at >= self.failback_seconds:
            best = self._best()[0]
            if best != self.base_url:
                log.info("switching from %s to %s (measured better)", self.base_url, best)
                self.base_url = best
        try:
            return self._authorized(method, path, **kwargs)
        except Unavailable as exc:
            if len(self._candidates) < 2 or isinstance(exc, TooManyRequests):
                raise
            failed, self.base_url = self.base_url, self._best(exclude=self.base_url)[0]
            log.warning("%s; failing over from %s to %s", exc, failed, self.base_url)
            return self._authorized(method, path, **kwargs)

    def _best(self, exclude: str | None = None) -> list[str]:
        """Reachable candidates, best first (``exclude`` left out); all of them if none answers."""
        self._probed_at = time.monotonic()
        ranked = choose([u for u in self._candidates if u != exclude], prober=self._prober)
        return [e.url for e in ranked if e.reachable] or [e.url for e in ranked]

    def _token_for(self, worker: str | None, expert: str | None) -> tuple[str | None, str | None]:
        return self.credentials.token_for(worker, expert) if self.credentials else (self.token, None)

    def _authorized(self, method: str, path: str, *, worker: str | None = None, expert: str | None = None,
                    attempts: int | None = None, **kwargs: Any) -> requests.Response:
        """One call with the right token; after a 401 to a token its credentials renew, once more."""
        token, owner = self._token_for(worker, expert)
        try:
            return self.call_with_token(method, path, token, attempts, **kwargs)
        except Unauthorized as exc:
            if owner is None or self.credentials is None or not self.credentials.renew(owner):
                if owner is None and token is not None:
                    exc.message = f"{exc.message} (token from {self.token_source})"
                    exc.args = (exc.message,)
                raise
            return self.call_with_token(method, path, self._token_for(worker, expert)[0], attempts, **kwargs)

    def call_with_token(self, method: str, path: str, token: str | None, attempts: int | None = None,
                        **kwargs: Any) -> requests.Response:
        """One call with ``token``, retried (RetryPolicy) at this coordinator only; no renewal, no fail-over."""
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
                        f"because of --use-proxy): {reason(exc)}; check the proxy or drop --use-proxy")
                log.debug("%s %s failed (%s), attempt %d", method, path, last, attempt + 1)
                continue
            except requests.RequestException as exc:
                if isinstance(exc, requests.ConnectionError) and self._plain_http_to_tls():
                    raise TLSFailure(f"{self.base_url} speaks TLS (the coordinator runs with --tls-cert): use "
                                     f"https://{self.base_url.split('://', 1)[1]}") from None
                last = f"cannot reach the coordinator at {self.base_url}: {reason(exc)}"
                log.debug("%s %s failed (%s), attempt %d", method, path, last, attempt + 1)
                continue
            self._plain_http_seen.add(self.base_url)
            if response.status_code == 429:
                wait = _retry_after(response, self.retry.max_retry_after)
                last = f"coordinator rate-limited {method} {path} (HTTP 429)"
                if attempt + 1 == attempts:
                    raise error_from_response(429, _answer(response))
                log.info("rate-limited by the coordinator; retrying in %.1f s", wait)
                continue
            if response.status_code < 500 or response.status_code == 501:
                if response.status_code >= 400:
                    raise error_from_response(response.status_code, _answer(response))
                return response
            last = f"coordinator answered HTTP {response.status_code} to {method} {path}"
            if response.status_code == 503 and "Retry-After" in response.headers:  # e.g. the first gateway builds
                wait = _retry_after(response, self.retry.max_retry_after)
                last += f": {error_from_response(503, _answer(response)).message}"
            elif response.status_code == 507:  # raised as such: a caller tells "no room" from "unreachable"
                refusal = error_from_response(507, _answer(response))
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


def _answer(response: requests.Response) -> Any:
    """An error answer's JSON, or its text when it is not JSON (a proxy's page)."""
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
