"""A relay answers its workers' diff pulls (``GET .../weights?since=V&codec=C``) from the versions it holds.

The root's own ``DiffCache`` (coordinator/diffs.py) computes the difference, over ``CachedVersions``: the
relay cache's current weights of an expert and the few versions before them that it kept
(``RelayStore.put_cached``). The bytes are the root's for the same request (the same two weight files, the same
manifest, the same codec seeded with the current version), so a worker cannot tell where a diff came from.
A ``since`` the relay does not hold is a 404 (``reason: diff_unavailable``), as the root answers for a pruned
version: the worker then pulls the full weights, from this relay's cache, over the site's LAN. Before, a relay
sent every diff pull to the root over the long link (2.3 s of a 3.9 s sync inside a site, docs/history/wan.md).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from coordinator.storage.blobs import BlobStore
from coordinator.storage.expert_store import WeightsRef
from coordinator.relay.upstream import WeightsCache
from protocol.errors import NotFound
from protocol.streaming import read_header
from protocol.tensors import manifest_to_json


class _Manifest:
    def __init__(self, manifest: str) -> None:
        self.manifest = manifest


class CachedVersions:
    """``coordinator.diffs.DiffSource`` over a relay's weights cache."""

    def __init__(self, cache: WeightsCache, blobs: BlobStore) -> None:
        self.cache, self.blobs = cache, blobs
        self._manifests: dict[str, str] = {}  # blob digest -> manifest JSON (read from the header once)
        self._guard = threading.Lock()

    def weights(self, name: str, version: int | None = None) -> WeightsRef:
        current = self.cache.get(name)  # stale-while-revalidate, as a full pull here: never waits on the WAN
        if version is None or version == current.version:
            return WeightsRef(current.version, current.blob)
        held = self.cache.store.cached_version(name, version)
        if held is None:
            raise NotFound(f"this relay does not hold version {version} of expert {name!r} (it holds "
                           f"{self.cache.store.cached_versions(name)}); pull the full weights",
                           reason="diff_unavailable")
        return WeightsRef(held.version, held.blob)

    @contextlib.contextmanager
    def local_file(self, digest: str) -> Iterator[Path]:
        path = self.blobs.path(digest)
        if not path.is_file():  # dropped from the history meanwhile: DiffCache looks the versions up again
            raise FileNotFoundError(path)
        yield path

    def require_expert(self, name: str) -> _Manifest:
        """The manifest as the root stores it (sorted names and shapes), read from the current file's header."""
        return _Manifest(self.manifest_json(self.cache.get(name).blob))

    def manifest_json(self, blob: str) -> str:
        """``manifest_to_json`` of a cached weights file, from its header (kept per blob: weights never change)."""
        with self._guard:
            manifest = self._manifests.get(blob)
        if manifest is None:
            with self.local_file(blob) as path:
                manifest = manifest_to_json(read_header(path).manifest)
            with self._guard:
                if len(self._manifests) > 64:
                    self._manifests.clear()
                self._manifests[blob] = manifest
        return manifest
