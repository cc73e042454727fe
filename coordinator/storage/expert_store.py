"""The expert store: the one object that holds blobs and manifest rows.

Two backends sit behind it: ``blobs`` (immutable content-addressed bytes; ``BlobStore`` keeps
them as local files) and ``rows`` (the durable manifest: experts, versions, updates, gateways;
``ManifestStore`` keeps it in SQLite). The store owns the rule that ties them together:

    a blob is adopted and the row naming it recorded as one step, and a blob is deleted only
    once no row names it; the two never interleave (``_guard``).

So every method that records a blob takes the fsynced temp file and adopts it itself, and
``drop_unreferenced`` is the only way a blob goes. Nothing outside this module touches a blob
and a row together. Reads hand out digests (``WeightsRef``), never storage handles: a caller
reads a blob with ``local_file`` (a local path, fetched first if the backend is remote) or through
``blobs`` (``open``; ``local_path`` only to let a server send a local file directly), and rows through
``rows``. Bodies on their way in are ``bodies`` (storage/body_spool.py); rows that name no blob (workers,
the audit log) are written through ``ledger`` (storage/ledger.py).

Lock order (outermost first), wherever more than one is taken:
``expert_lock(name)`` -> ``_guard`` -> the manifest's connection lock. A caller holding
``_guard`` or a manifest lock never waits for an expert lock.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, TypeGuard, TypeVar

from coordinator.storage.audit_log import Event
from coordinator.storage.backends.errors import BackendUnavailable
from coordinator.storage.blobs import is_storage_full, storage_errors
from coordinator.storage.group_commit import GroupCommit
from coordinator.storage.manifest import StaleAggregation
from coordinator.storage.manifest_schema import ExpertRow, UpdateRow
from coordinator.storage.manifest_roles import ManifestBackend, ManifestReads
from coordinator.storage.blob_backend import BlobBackend, BlobReads, PresigningBlobBackend
from coordinator.storage.ledger import Ledger
from coordinator.storage.body_spool import BodySpool
from protocol.errors import NotFound

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["BlobBackend", "ExpertStore", "StaleAggregation", "WeightsRef"]


def _presigning(blobs: BlobBackend) -> TypeGuard[PresigningBlobBackend]:
    return getattr(blobs, "presigned_url", None) is not None


@dataclass(frozen=True)
class WeightsRef:
    """One stored version of an expert: read its bytes through the store by ``digest``."""

    version: int
    digest: str


class ExpertStore:
    def __init__(self, blobs: BlobBackend, rows: ManifestBackend, keep_versions: int, locks: Any = None) -> None:
        self._blobs = blobs
        self._locks = locks
        """Cross-process expert locks (coordinator/storage/backends/postgres.py ExpertLocks) when replicas share rows."""
        self._rows = rows
        self.keep_versions = keep_versions
        """Versions of each expert whose weights are kept (--keep-versions); older ones are pruned."""
        self._guard = threading.RLock()  # adopt+record vs. drop-unreferenced (see the module docstring)
        self._expert_locks: dict[str, threading.Lock] = {}
        self._expert_locks_guard = threading.Lock()
        self.group_commit = GroupCommit(self._flush)
        """One flush (blob directories, then the manifest's WAL) for every write that waits at once."""
        self._unreferenced: list[str] = []  # blobs to delete once the rows that let go of them are durable
        self._unreferenced_guard = threading.Lock()
        self._repairing = threading.Lock()  # one repair at a time (repair_in_background)
        self.bodies = BodySpool(blobs)
        """Request bodies on their way in (temp files), until a method below adopts or the caller forgets them."""
        self.ledger = Ledger(rows, self.sync)
        """Workers, their pulls and profiles, the audit log: rows that name no blob, durable when written."""
        blobs.on_lost = self.repair_in_background

    @property
    def rows_shared(self) -> bool:
        """The manifest is shared with other replicas (PostgreSQL): no one process may set anything of it aside
        on the strength of its own view (coordinator/recovery.py)."""
        return self._locks is not None

    def _flush(self) -> None:
        self._blobs.flush()  # directories first: a durable row never names a blob whose rename is not
        self._rows.flush()

    def sync(self) -> None:
        """Return once every write made so far is durable (shared with concurrent writers: group commit), then
        delete the blobs that writes before the call let go of (``commit_version(durable=False)``).
        Every write below calls it before returning, except those with ``durable=False``, whose caller
        calls it after letting go of the expert's lock, and before it acknowledges the update."""
        with self._unreferenced_guard:
            unreferenced, self._unreferenced = self._unreferenced, []
        try:
            self.group_commit.sync()
        except BaseException:
            self._drop_later(unreferenced)
            raise
        if self._rows.held_up():  # housekeeping, not durability: not a second wait for a lock held elsewhere
            self._drop_later(unreferenced)
            return
        try:
            self.drop_unreferenced(unreferenced)
        except BackendUnavailable:  # the writes are acknowledged all the same
            self._drop_later(unreferenced)

    def _drop_later(self, digests: list[str]) -> None:
        """The next sync deletes them (or the next start, as orphans)."""
        with self._unreferenced_guard:
            self._unreferenced += digests

    def close(self) -> None:
        self._rows.close()

    def expert_lock(self, name: str) -> ContextManager[Any]:
        """Serialises changes to one expert (checks, recording an update, aggregation steps), across
        replicas too when the rows are shared (PostgreSQL advisory locks)."""
        if self._locks is not None:
            return self._locks.hold(name)
        with self._expert_locks_guard:
            return self._expert_locks.setdefault(name, threading.Lock())

    # adopt and record: every row that names a blob is written here --------------------------

    def _adopt_and_record(self, tmp: Path, record: Callable[[str], T], action: str | None,
                          digest: str | None = None) -> T:
        """Move ``tmp`` into the blob store, then ``record(digest)`` its row; a row that cannot be
        committed leaves no blob behind. With ``action``, a full disk at either step is a 507 naming it."""
        with self._guard, (storage_errors(action) if action else contextlib.nullcontext()):
            digest = self._blobs.adopt(tmp, digest, sync=False)  # durable at the next flush (sync())
            try:
                return record(digest)
            except BackendUnavailable:  # the rows cannot be asked now (a lock held elsewhere): not a second wait
                self._drop_later([digest])
                raise
            except BaseException:
                self.drop_unreferenced([digest])
                raise

    def create_expert(self, name: str, spec: dict[str, Any], manifest: str, body: Path,
                      events: tuple[Event, ...] = ()) -> None:
        """Store an expert's first weights (version 0) from a temp file."""
        self._adopt_and_record(body, lambda digest: self._rows.create_expert(name, spec, manifest, digest, events),
                               f"store expert {name!r}")
        self.sync()

    def add_update(self, name: str, meta: dict[str, Any], body: Path, body_digest: str, body_bytes: int,
                   raw_bytes: int, norm: float | None, events: tuple[Event, ...] = (),
                   durable: bool = True) -> UpdateRow:
        """Record a pending update with its payload: the point of no loss (202 only after this and, with
        ``durable=False``, after the caller's ``sync()``)."""
        row = self._adopt_and_record(
            body, lambda digest: self._rows.add_update(name, meta, digest, body_bytes, raw_bytes, norm, events),
            f"record update {meta['update_id']!r}", body_digest)
        if durable:
            self.sync()
        return row

    def commit_version(self, name: str, version: int, written: Path, applied: list[UpdateRow],
                       train_loss: float | None, events: tuple[Event, ...] = (), durable: bool = True) -> None:
        """Record a new version from a temp file and mark ``applied`` as applied, atomically; then drop
        their payloads and prune versions past ``keep_versions``. StaleAggregation (nothing stored) if
        the expert or the updates moved on meanwhile (another process on this data dir).
        ``durable=False``: the flush and the deletions wait for the caller's next ``sync()`` (made after it
        lets go of the expert's lock: a step no longer holds it through a flush and ten unlinks)."""
        self._adopt_and_record(
            written, lambda digest: self._rows.commit_version(name, version, digest, applied, train_loss, events),
            f"record version {version} of {name!r}")
        pruned = self._prune_versions(name)
        # blobs go only after a flush that covers these rows: a crash must not leave a durable row naming a
        # deleted blob (one that stays after a crash is an orphan, deleted at the next start)
        with self._unreferenced_guard:
            self._unreferenced += [u.blob for u in applied if u.blob] + pruned
        if durable:
            self.sync()

    def _prune_versions(self, name: str) -> list[str]:
        """Forget versions past ``keep_versions``; on a full disk keep them for the next step's prune (the new
        version is committed already: the push that made it must not be answered 507)."""
        try:
            return self._rows.prune_versions(name, self.keep_versions)
        except Exception as exc:
            if not is_storage_full(exc):
                raise
            log.warning("disk full: old versions of %s not pruned yet (next step tries again)", name)
            return []

    def add_gateway(self, key: str, written: Path, info: dict[str, Any], keep: int) -> int:
        """Store a built gateway from a temp file; delete all but the newest ``keep``. Returns its version."""
        version, pruned = self._adopt_and_record(written, lambda digest: self._rows.add_gateway(key, digest, info, keep),
                                                 None)  # a full disk fails the build, as any error does
        self.sync()
        self.drop_unreferenced(pruned)
        return version

    # reading blobs --------------------------------------------------------------------------

    def weights(self, name: str, version: int | None = None) -> WeightsRef:
        """Version ``version`` (default: the current one) of an expert; NotFound if absent or pruned."""
        expert = self.require_expert(name)
        exists, digest = self._rows.version_blob(name, expert.version if version is None else version)
        while version is None and digest is None:  # replaced and pruned between the two reads
            expert = self.require_expert(name)
            exists, digest = self._rows.version_blob(name, expert.version)
        version = expert.version if version is None else version
        if not exists:
            raise NotFound(f"expert {name!r} has no version {version} (current: {expert.version})")
        if digest is None:
            raise NotFound(f"version {version} of {name!r} was pruned; the newest "
                           f"{self.keep_versions} versions are kept (--keep-versions)")
        return WeightsRef(version, digest)

    def local_file(self, digest: str) -> ContextManager[Path]:
        """A local file holding the blob, valid inside the block (a remote backend fetches it first).

        A local blob can be pruned while it is read: readers catch FileNotFoundError and look again.
        """
        return self._blobs.local_file(digest)

    # housekeeping ---------------------------------------------------------------------------

    def drop_unreferenced(self, digests: list[str]) -> None:
        """Delete those of ``digests`` that no row names any more."""
        if not digests:
            return
        with self._guard:
            for digest in set(digests) - self._rows.referenced_blobs():
                self._blobs.delete(digest)

    def remove_orphans(self) -> int:
        """Delete blobs written just before a crash and never recorded; how many there were.

        Only when the manifest and the blob store are seen to belong together (the store holds at least one blob
        the manifest names): a manifest that names none of the store's blobs (an empty or mistyped --manifest
        database, a fresh SQLite file next to old blobs) would otherwise have every blob deleted as unrecorded."""
        with self._guard:
            stored, referenced = set(self._blobs.digests()), self._rows.referenced_blobs()
            orphans = stored - referenced
            together = bool(stored & referenced) or bool(referenced - self._blobs.missing(referenced))
            if orphans and not together:
                log.warning("left %d unrecorded blob(s) in %s in place: the manifest names none of the blobs there "
                            "(is it the manifest of this store?)", len(orphans), self._blobs.location)
                return 0
            for digest in orphans:
                self._blobs.delete(digest)
        return len(orphans)

    def repair(self) -> tuple[list[str], set[str]]:
        """Put back every blob the rows name that the blob store lost, from a copy held here (a remote store's
        local cache); (restored, still missing). A blob dropped meanwhile may come back as an orphan (removed
        at a later start)."""
        lost = self._blobs.missing(self._rows.referenced_blobs())
        restored = [digest for digest in sorted(lost) if self._blobs.restore(digest)]
        if restored:
            log.warning("re-uploaded %d blob(s) missing from %s from this replica's cache", len(restored),
                        self._blobs.location)
        return restored, lost - set(restored)

    def repair_in_background(self) -> None:
        """``repair`` on a thread of its own, unless one is running (the blob store found it lost blobs)."""
        if not self._repairing.acquire(blocking=False):
            return

        def run() -> None:
            try:
                restored, missing = self.repair()
                if missing:
                    log.error("%d blob(s) the manifest names are missing from %s and not in this replica's cache",
                              len(missing), self._blobs.location)
            except Exception as exc:  # noqa: BLE001 - a background repair reports, the next start tries again
                log.error("repairing the blob store failed: %s", exc)
            finally:
                self._repairing.release()

        threading.Thread(target=run, name="fedmoe-repair", daemon=True).start()

    def quarantine_updates(self, name: str, updates: list[UpdateRow], reason: str,
                           event: Callable[[UpdateRow, str | None], Event]) -> int:
        """Set pending updates aside for good, keeping a copy of each payload for a human;
        ``event(update, copy name)`` says why in the audit log. Returns how many were still pending."""
        marked = [(u.seq, event(u, self._blobs.quarantine(u.blob, reason) if u.blob else None)) for u in updates]
        count = self._rows.quarantine_updates(marked)
        self.sync()
        self.drop_unreferenced([u.blob for u in updates if u.blob])
        return count

    def remove_expert(self, expert: ExpertRow, reason: str, event: Callable[[list[str]], Event]) -> list[str]:
        """Forget an expert whose weights cannot be used, keeping copies of all its blobs;
        ``event(copy names)`` is its audit row. Returns the copies' names."""
        digests = self._rows.expert_blobs(expert.name)
        kept = [copy for d in digests if (copy := self._blobs.quarantine(d, reason)) is not None]
        self._rows.remove_expert(expert.name, events=(event(kept),))
        self.sync()
        self.drop_unreferenced(digests)
        return kept

    # rows and blobs to read ----------------------------------------------------------------

    @property
    def blobs(self) -> BlobReads:
        """The blobs to read (by digest, from a row); every write goes through this store."""
        return self._blobs

    @property
    def rows(self) -> ManifestReads:
        """The manifest's rows to read (experts, versions, updates, workers, events, gateways); every write
        goes through this store, which writes a row that names a blob together with its blob."""
        return self._rows

    def require_expert(self, name: str) -> ExpertRow:
        """The expert's row, or NotFound listing the known experts."""
        expert = self._rows.expert(name)
        if expert is None:
            raise NotFound(f"no expert named {name!r}; known experts: {[e.name for e in self._rows.experts()]}")
        return expert

    def redirect_url(self, digest: str, min_bytes: int) -> tuple[str, int] | None:
        """(URL, size): a short-lived URL to GET a blob of at least ``min_bytes`` from directly (the object store's
        bandwidth, not ours), when the blob backend offers one; else None (serve it ourselves)."""
        blobs = self._blobs
        if not _presigning(blobs) or min_bytes <= 0:
            return None
        size = blobs.remote_size(digest)
        return (blobs.presigned_url(digest), size) if size >= min_bytes else None
