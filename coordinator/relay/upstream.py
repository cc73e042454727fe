"""The relay's link to its upstream (the root, or another relay): joining, and the weights cache.

``UpstreamClient`` is the project's ``CoordinatorClient`` (timeouts, retries with backoff, errors
mapped back to exceptions) plus the calls only a relay makes: registering itself with the relay join
token for a relay-scoped token (kept in ``<data dir>/relay_token`` so a restart renews it), and
reporting its workers. ``WeightsCache`` serves workers' pulls from the relay's disk, revalidated
upstream with ``If-None-Match`` at most once per ``revalidate_seconds`` per expert; an unreachable
upstream serves the cached copy. With ``DiffPulls`` (``--upstream-pull-compression``) a new version comes
as a compressed diff since the cached one, as a worker's ``--pull-compression`` pull does, with a full
pull every ``full_every``-th time; the cached copy is then the root's weights within the codec's error,
under an ETag of its own bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compression import make_codec
from compression.wire import decode_update
from coordinator.storage.blobs import BlobStore
from coordinator.relay.relay_store import RelayStore
from coordinator.relay.relay_store_schema import CachedWeights
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.client.bodies import Chunks, read_body
from protocol.errors import Conflict, FedMoEError, Forbidden, NotFound, Unauthorized, Unavailable
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, VERSION_HEADER
from protocol.tensors import dumps, load_file, manifest_of

log = logging.getLogger(__name__)


class RelayStartError(Exception):
    """The relay cannot start (upstream refused it, or a different base model)."""


class UpstreamClient(CoordinatorClient):
    """The client, with the relay's own token as its credentials (``Credentials``): a 401 to it joins again, once."""

    def __init__(self, url: str, join_token: str | None, token_file: Path, *,
                 retry: RetryPolicy = RetryPolicy(attempts=2, base_delay=0.5, max_delay=2.0),
                 relay_join_token: str | None = None) -> None:
        """``relay_join_token``: the root's relay join token, which registers the relay (the workers' join token
        cannot, coordinator/access/tokens.py); without it the relay registers with ``join_token`` (an admin token does)."""
        super().__init__(url, retry=retry, token=join_token, timeout=(5.0, 120.0))
        self.transport.credentials = self
        self.join_token = join_token
        self.registering_token = relay_join_token or join_token
        self.token_file = token_file
        self.relay_token: str | None = token_file.read_text().strip() if token_file.is_file() else None
        self._registration: dict[str, Any] | None = None

    def token_for(self, worker: str | None, expert: str | None) -> tuple[str | None, str | None]:
        """Every call of the relay carries its relay token (else the join token); "relay" renews it once joined."""
        return self.relay_token or self.transport.token, "relay" if self._registration is not None else None

    def renew(self, owner: str) -> bool:
        """Our token expired or the root forgot it: join again."""
        if self._registration is None:
            return False
        self.relay_token = None
        self.register_relay(**self._registration)
        return True

    def register_relay(self, relay_id: str, url: str | None, base_model: dict[str, str] | None) -> dict[str, Any]:
        """Join the upstream; a relay-scoped token from now on. RelayStartError on a 409 (other base model)."""
        body = {"relay_id": relay_id, "url": url, "base_model": base_model}
        self._registration = body
        info = None
        if self.relay_token:  # renewal with our own token (also when it has expired)
            try:
                info = self.transport.call_with_token("POST", "/relays", self.relay_token, json=body).json()
            except (Unauthorized, Forbidden) as exc:
                log.info("upstream did not renew the relay token (%s); registering with the join token", exc)
            except Conflict as exc:
                raise RelayStartError(f"upstream {self.base_url} refused this relay: {exc}") from None
        if info is None:
            try:
                info = self.transport.call_with_token("POST", "/relays", self.registering_token, json=body).json()
            except Conflict as exc:
                raise RelayStartError(f"upstream {self.base_url} refused this relay: {exc}") from None
            except (Unauthorized, Forbidden) as exc:
                raise RelayStartError(f"upstream {self.base_url} refused to register this relay ({exc}); pass the "
                                      "root's relay join token with --relay-join-token-file") from None
        token = info.pop("token", None)
        if token:
            self.relay_token = token
            tmp = self.token_file.with_name(".relay_token.tmp")
            tmp.write_text(token + "\n")
            tmp.chmod(0o600)
            tmp.replace(self.token_file)
        return info

    def report(self, relay_id: str, workers: list[dict[str, Any]], stats: dict[str, int]) -> None:
        self.transport.request("POST", f"/relays/{relay_id}/report", json={"workers": workers, "stats": stats})

    def weights_body(self, name: str, etag: str | None) -> tuple[bytes | None, int, str | None]:
        """(body or None if unchanged, version, ETag) of the expert's current weights, as raw bytes."""
        headers = {"If-None-Match": f'"{etag}"'} if etag else {}
        r = self.transport.request("GET", f"/experts/{name}/weights", headers=headers, stream=True)
        version = int(r.headers.get(VERSION_HEADER, -1))
        if r.status_code == 304:
            r.close()
            return None, version, etag
        return bytes(read_body(r, self.base_url)), version, r.headers.get("ETag", "").strip('"') or None

    def version_body(self, name: str, version: int, if_none_match: str | None = None) -> tuple[bytes | None, str | None]:
        """(body, ETag) of version ``version`` of the expert's weights, as raw bytes (None: the upstream's 304 to
        ``if_none_match``, a client's header passed on); the upstream's errors as they are (NotFound for a
        version it does not keep)."""
        headers = {"If-None-Match": if_none_match} if if_none_match else {}
        r = self.transport.request("GET", f"/experts/{name}/weights", params={"version": str(version)},
                                   headers=headers, stream=True)
        etag = r.headers.get("ETag", "").strip('"') or None
        if r.status_code == 304:
            r.close()
            return None, etag
        return bytes(read_body(r, self.base_url)), etag

    def create_expert_from_file(self, name: str, body: Path, spec: dict[str, Any]):
        """PUT the expert's initial adapter (a received file) upstream; the response (201 or 200)."""
        data = body.read_bytes()
        return self.transport.request("PUT", f"/experts/{name}", data=Chunks(data),
                                      headers={EXPERT_HEADER: json.dumps(spec), DIGEST_HEADER: digest_header(data)})

    def passthrough(self, method: str, path: str, **kwargs: Any) -> Any:
        """A JSON call relayed as it is (expert metadata, profiles)."""
        return self.transport.json(method, path, **kwargs)


@dataclass(frozen=True)
class DiffPulls:
    """Fetch new versions upstream as compressed diffs (``--upstream-pull-compression``)."""

    codec: str
    """A diff codec the root encodes with (``fp16``, ``int8``, ...)."""
    config: dict[str, Any] = field(default_factory=dict)
    full_every: int = 10
    """Every N-th fetch of an expert is a full one (and the first after a start), so errors cannot add up."""

    def __post_init__(self) -> None:
        make_codec(self.codec, self.config)  # CompressionError listing the valid names and keys
        if self.full_every < 1:
            raise ValueError(f"--upstream-full-pull-every must be >= 1, got {self.full_every}")


@dataclass
class _Freshness:
    checked: float = float("-inf")
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the choice to serve the cached copy or revalidate, and ``refreshing``."""
    fetching: threading.Lock = field(default_factory=threading.Lock)
    """Held while the expert is revalidated upstream: one revalidation at a time, foreground or background."""
    refreshing: bool = False
    """A background revalidation is queued or running."""
    diffs: int | None = None
    """Diff fetches since the last full one (None: no full fetch by this process yet)."""


class WeightsCache:
    """The newest weights of each expert as the relay last saw them upstream, on disk."""

    def __init__(self, store: RelayStore, blobs: BlobStore, upstream: UpstreamClient, revalidate_seconds: float,
                 drop_unreferenced: Callable[[list[str]], None], clock: Callable[[], float] = time.monotonic,
                 in_background: bool = True, diff_pulls: DiffPulls | None = None) -> None:
        self.store, self.blobs, self.upstream = store, blobs, upstream
        self.diff_pulls = diff_pulls
        self.revalidate_seconds = revalidate_seconds
        self.in_background = in_background
        """Stale-while-revalidate: a pull finding a stale copy gets it at once and starts one revalidation on
        the refresher thread. Waiting for it made every pull after a new root version wait for the full
        download over the WAN (~4 s of a worker's 4.1 s sync inside a site, docs/history/wan.md)."""
        self._refresher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedmoe-relay-refresh")
        self.drop_unreferenced = drop_unreferenced
        self.clock = clock
        self._fresh: dict[str, _Freshness] = {}
        self._guard = threading.Lock()
        self.upstream_fetches = 0
        """Full bodies downloaded from upstream (a test's and the report's count)."""
        self.diff_fetches = 0
        """New versions built from a diff fetched upstream."""
        self.bytes_fetched = 0

    def get(self, name: str, wait: bool = False) -> CachedWeights:
        """The expert's weights, revalidated upstream unless checked within revalidate_seconds (in the
        background, returning the cached copy at once, unless ``wait`` or nothing is cached).

        Upstream unreachable: the cached copy (stale is better than nothing); none cached: Unavailable.
        An expert upstream does not know: NotFound.
        """
        with self._guard:
            fresh = self._fresh.setdefault(name, _Freshness())
        with fresh.lock:
            cached = self.store.cached(name)
            if cached is not None and self.clock() - fresh.checked < self.revalidate_seconds:
                return cached
            if cached is not None and self.in_background and not wait:
                if not fresh.refreshing:
                    fresh.refreshing = True
                    self._refresher.submit(self._refresh, name, fresh)
                return cached
        try:
            return self._revalidate_once(name, fresh)
        except Unavailable as exc:
            cached = self.store.cached(name)
            if cached is None:
                raise Unavailable(f"the relay has no copy of expert {name!r} and cannot reach upstream: "
                                  f"{exc}") from None
            log.warning("upstream unreachable (%s); serving cached %s version %d", exc, name, cached.version)
            return cached

    def _revalidate_once(self, name: str, fresh: _Freshness) -> CachedWeights:
        """Revalidate, unless whoever held ``fetching`` before us just did: concurrent callers wait for one."""
        with fresh.fetching:
            cached = self.store.cached(name)
            if cached is not None and self.clock() - fresh.checked < self.revalidate_seconds:
                return cached
            fetched = None
            if cached is not None and self._diff_due(fresh):
                fetched = self._revalidate_by_diff(name, cached)
            if fetched is None:
                fetched = self._revalidate(name, cached)
                fresh.diffs = 0
            elif fetched is not cached:
                fresh.diffs = (fresh.diffs or 0) + 1
            fresh.checked = self.clock()
            return fetched

    def _diff_due(self, fresh: _Freshness) -> bool:
        """Whether the next fetch may be a diff: diff pulls on, a full fetch done by this process, not the Nth."""
        return (self.diff_pulls is not None and fresh.diffs is not None
                and fresh.diffs + 1 < self.diff_pulls.full_every)

    def _refresh(self, name: str, fresh: _Freshness) -> None:
        """The background revalidation ``get`` started: pulls meanwhile get the cached copy."""
        try:
            self._revalidate_once(name, fresh)
        except FedMoEError as exc:  # unreachable, or gone upstream: the next stale pull tries again
            log.warning("could not revalidate expert %s upstream (%s); serving the cached copy", name, exc)
        except Exception:  # a thread's exception would vanish: say it, the next stale pull tries again
            log.exception("revalidating expert %s upstream failed", name)
        finally:
            with fresh.lock:
                fresh.refreshing = False

    def close(self) -> None:
        self._refresher.shutdown(wait=True, cancel_futures=True)

    def _revalidate(self, name: str, cached: CachedWeights | None) -> CachedWeights:
        body, version, etag = self.upstream.weights_body(name, cached.etag if cached else None)
        if body is None and cached is not None:
            return cached
        if body is None:
            raise NotFound(f"upstream sent no weights for {name!r}")
        self.upstream_fetches += 1
        self.bytes_fetched += len(body)
        entry = self._keep(name, version, etag or hashlib.sha256(body).hexdigest(), body, cached)
        log.info("cached expert %s version %d (%d bytes) from upstream", name, version, len(body))
        return entry

    def _revalidate_by_diff(self, name: str, cached: CachedWeights) -> CachedWeights | None:
        """The new version as the cached weights plus a diff fetched upstream; ``cached`` if there is none,
        None if upstream no longer keeps the cached version (the caller then fetches it in full)."""
        assert self.diff_pulls is not None
        codec, config = self.diff_pulls.codec, self.diff_pulls.config
        try:
            payload, version = self.upstream.experts.pull_diff(name, cached.version, codec, config)
        except NotFound:
            log.info("upstream no longer keeps %s version %d; fetching the new version in full", name, cached.version)
            return None
        if not payload or version == cached.version:
            return cached
        base = load_file(self.blobs.path(cached.blob))
        delta = decode_update(payload, manifest_of(base), make_codec(codec, config))
        body = dumps({k: base[k] + delta[k].to(base[k].dtype) for k in base})
        self.diff_fetches += 1
        self.bytes_fetched += len(payload)
        # an ETag of these bytes, not the root's: they are the root's version within the codec's error
        entry = self._keep(name, version, hashlib.sha256(body).hexdigest(), body, cached)
        log.info("cached expert %s version %d from a %d-byte %s diff since version %d", name, version, len(payload),
                 codec, cached.version)
        return entry

    def _keep(self, name: str, version: int, etag: str, body: bytes, cached: CachedWeights | None) -> CachedWeights:
        """Store ``body`` as the expert's current cached weights (the replaced copy joins the history)."""
        info = self.upstream.passthrough("GET", f"/experts/{name}")
        digest = self.blobs.put_bytes(body)
        entry = CachedWeights(name, version, etag, digest, {k: v for k, v in info.items() if k != "versions"})
        dropped = self.store.put_cached(entry)  # the replaced version joins the history (diff pulls' bases)
        if cached is not None and cached.blob != digest:
            dropped.append(cached.blob)
        if dropped:
            self.drop_unreferenced(dropped)
        return entry

    def known(self, name: str) -> CachedWeights | None:
        """The cached copy without revalidation (None if never fetched)."""
        return self.store.cached(name)


def upstream_error_is_final(exc: FedMoEError) -> bool:
    """A 4xx other than 429/507: the upstream will never take this request as it is."""
    return not isinstance(exc, Unavailable)
