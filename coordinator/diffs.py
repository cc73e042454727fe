"""Diff pulls: an expert's current weights minus an older version, encoded with a codec, cached.

Lets a worker that holds version ``since`` catch up for a fraction of the bytes of a full pull.
A version can be pruned while its file is read (each push prunes the oldest kept one), so a pull
that finds a file gone looks the versions up again. Whenever no difference can be served (``since``
pruned, the expert kept changing, the difference does not fit the codec, e.g. fp16's range) the
answer is a 404 saying so (``details.reason``), on which workers pull full weights; never a 500.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, ContextManager, Protocol

from compression import Codec
from compression.errors import CompressionError
from compression.wire import encode_update
from coordinator.checks.adapters import make_checked_codec
from coordinator.storage.expert_store import WeightsRef
from protocol.errors import NotFound
from protocol.streaming import FileTensors
from protocol.tensors import load_file, manifest_from_json

log = logging.getLogger(__name__)
DIFF_CACHE_BYTES = 256 << 20
DIFFS_KEPT = 16  # a handful of (since, codec) pairs cover a fleet
ATTEMPTS = 3


class ExpertManifest(Protocol):
    @property
    def manifest(self) -> str: ...  # manifest_to_json of the expert's tensors


class DiffSource(Protocol):
    """Where the versions come from: the root's ``ExpertStore``, or a relay's cache (coordinator/relay/diffs.py),
    which answers its workers' diff pulls with this same code, byte for byte the root's answer."""

    def weights(self, name: str, version: int | None = None) -> WeightsRef: ...  # NotFound if not held
    def local_file(self, digest: str) -> ContextManager[Path]: ...  # FileNotFoundError once pruned
    def require_expert(self, name: str) -> ExpertManifest: ...


class DiffCache:
    def __init__(self, store: DiffSource) -> None:
        self._store = store
        self._diffs: dict[tuple, bytes] = {}  # (expert, since, version, codec, config) -> encoded diff
        self._compute_lock = threading.Lock()  # concurrent pulls of one diff wait: one model copy in memory, not N
        self._guard = threading.Lock()  # the dict itself
        # Lock order: _compute_lock -> _guard, and _compute_lock -> the store's locks (reads); the
        # store never calls back here, and no expert lock is held by a pull.

    def get(self, name: str, since: int, codec: str, codec_config: dict[str, Any],
            version: int | None = None) -> tuple[bytes, int]:
        """(payload, version): version ``version`` (default: the current one) minus version ``since``; the payload
        is empty when they are the same version. NotFound when either is not kept (the client pulls full weights)."""
        encoder = make_checked_codec(codec, codec_config)
        for attempt in range(ATTEMPTS):
            current = self._store.weights(name, version)
            if since == current.version:
                return b"", current.version
            old = self._store.weights(name, since)  # NotFound once ``since`` itself is pruned
            try:
                return self._encoded(name, since, current, old, codec, codec_config, encoder), current.version
            except FileNotFoundError:
                log.info("version %d or %d of %s was pruned during a diff pull (attempt %d)",
                         since, current.version, name, attempt + 1)
        raise NotFound(f"expert {name!r} kept changing while the difference from version {since} was computed; "
                       "pull full weights", reason="diff_unavailable")

    def _encoded(self, name: str, since: int, current: WeightsRef, old: WeightsRef, codec: str,
                 codec_config: dict[str, Any], encoder: Codec) -> bytes:
        key = (name, since, current.version, codec, json.dumps(codec_config, sort_keys=True))
        with self._compute_lock:
            with self._guard:
                cached = self._diffs.get(key)
            if cached is not None:
                return cached
            with self._store.local_file(current.digest) as new_path, self._store.local_file(old.digest) as old_path:
                diff, base = load_file(new_path), FileTensors(old_path)
                for k, t in diff.items():
                    t.sub_(base[k])
            manifest = manifest_from_json(self._store.require_expert(name).manifest)
            try:
                cached = encode_update(diff, manifest, encoder, seed=current.version)
            except CompressionError as exc:  # e.g. a change beyond fp16's range
                raise NotFound(f"the change of {name!r} since version {since} cannot be encoded with "
                               f"{codec!r}: {exc}; pull full weights (or use another --pull-compression)",
                               reason="diff_not_encodable") from None
            with self._guard:
                self._diffs[key] = cached
                while len(self._diffs) > DIFFS_KEPT or sum(map(len, self._diffs.values())) > DIFF_CACHE_BYTES:
                    self._diffs.pop(next(iter(self._diffs)))  # bounded in bytes too, for full experts
        return cached
