"""Start-up recovery: finish what a crash interrupted, and never destroy on the strength of one process's view.

At start the coordinator, in this order:

1. **repairs**: blobs the manifest names that the blob store lost are uploaded again from this replica's
   cache (``ExpertStore.repair``; a replica that served them holds them in its --data-dir);
2. **refuses to start** (``StoreMismatch``: one line naming the missing blobs and the store) while a blob it
   needs is still missing: an expert's current weights or a pending update's payload. A missing blob says
   where this process looks, not what the blob is: a typo in the --blobs prefix, an object store restarted
   empty and an unmounted blobs/ directory all look the same from here. Such experts used to be
   "quarantined" at once: their rows, versions and profiles deleted from the shared PostgreSQL and their
   pending updates marked quarantined, so every replica answered 404 for them and for their acknowledged
   updates (1,003 of them, after one replica started with a mistyped prefix);
3. removes unrecorded blobs, when the manifest and the store are seen to belong together
   (``ExpertStore.remove_orphans``);
4. **checks content**: each expert's current weights and each pending update must be usable (loader,
   manifest, finiteness). What is not is bad for any process that reads it (an older coordinator accepted
   it, or the disk damaged it). With the manifest in this data dir (SQLite: one process owns it) it is
   quarantined as before, so one bad push cannot keep the coordinator down: a copy is kept under
   ``<data dir>/quarantine/<digest>``, the rows stop naming it, the log says so at ERROR and the audit log
   gets an ``update_quarantined`` / ``expert_quarantined`` event. With a shared manifest (PostgreSQL)
   the replica refuses to start instead (``RecoveryRefused``), naming it and the admin command that sets it
   aside for every replica, ``run_coordinator.py --quarantine NAME`` (coordinator/quarantine.py);
5. re-runs aggregation over each expert's pending updates, so nothing acknowledged is lost.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.access import audit
from coordinator.checks.adapters import check_update
from coordinator.errors import REFUSALS
from coordinator.storage.expert_store import ExpertStore
from coordinator.storage.manifest_schema import ExpertRow, UpdateRow
from protocol.errors import NotFound
from protocol.streaming import check_file, read_header
from protocol.tensors import manifest_from_json

log = logging.getLogger(__name__)

SHOWN = 4  # blobs or problems named in a one-line refusal; the rest are counted
ADMIN_COMMAND = "run_coordinator.py --quarantine NAME (with this coordinator's --data-dir, --manifest and --blobs)"


class RecoveryRefused(ValueError):
    """Start-up found something this process may not decide alone: it does not start (one line, exit 2)."""


class StoreMismatch(RecoveryRefused):
    """Blobs the manifest needs are not in the blob store (a wrong location, or a store that lost its data)."""


@dataclass
class Problems:
    """What cannot be used of one expert: its current weights (``expert``), or some pending updates."""

    name: str
    expert: str | None = None
    updates: list[tuple[UpdateRow, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.expert is not None or bool(self.updates)

    def describe(self) -> str:
        if self.expert is not None:
            return f"expert {self.name!r}: {self.expert}"
        return "; ".join(f"pending update {u.update_id!r} of {self.name!r}: {why}" for u, why in self.updates)


def recover(store: ExpertStore, aggregate: Callable[[str], None]) -> None:
    """Repair, check, set aside what is unusable (or refuse to start), then ``aggregate`` each expert."""
    store.repair()
    check_blobs(store)
    orphans = store.remove_orphans()  # blobs written just before a crash, never recorded
    if orphans:
        log.info("removed %d unrecorded blob(s) left by an interrupted write", orphans)
    found = [p for p in (examine(store, expert) for expert in store.rows.experts()) if p]
    if found and store.rows_shared:
        raise RecoveryRefused(refusal(found))
    for problems in found:
        set_aside(store, problems)
    for expert in store.rows.experts():
        aggregate(expert.name)


def needed_blobs(store: ExpertStore) -> dict[str, str]:
    """{digest: what needs it} for every expert's current weights and every pending update's payload."""
    needed: dict[str, str] = {}
    for expert in store.rows.experts():
        needed[store.weights(expert.name).digest] = f"version {expert.version} of {expert.name!r}"
        for update in store.rows.pending_updates(expert.name):
            if update.blob is not None:
                needed.setdefault(update.blob, f"pending update {update.update_id!r} of {expert.name!r}")
    return needed


def check_blobs(store: ExpertStore) -> None:
    """StoreMismatch naming the missing blobs and the store, if any blob ``needed_blobs`` names is not there."""
    needed = needed_blobs(store)
    missing = sorted(store.blobs.missing(needed), key=needed.__getitem__)
    if not missing:
        return
    shown = ", ".join(f"{needed[d]} ({d[:19]}...)" for d in missing[:SHOWN])
    more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    where = store.blobs.location
    if len(missing) == len(needed):
        what = (f"the blob store {where} holds none of the {len(needed)} blob(s) the manifest needs: {shown}{more}. "
                "It looks empty or belongs to another federation: check the URL or path (a typo?), or whether "
                "the store lost its data")
    else:
        what = f"the blob store {where} is missing {len(missing)} of the {len(needed)} blob(s) the manifest needs: " \
               f"{shown}{more}"
    raise StoreMismatch(f"{what}. Nothing was changed. A replica that still holds them in its --data-dir uploads "
                        f"them again when it starts; to give up on an expert for good instead: {ADMIN_COMMAND}")


def refusal(found: list[Problems]) -> str:
    """The one line a replica on a shared manifest stops with when some experts or updates are unusable."""
    shown = "; ".join(p.describe() for p in found[:SHOWN])
    more = f"; and {len(found) - SHOWN} more expert(s)" if len(found) > SHOWN else ""
    names = ",".join(p.name for p in found)
    return (f"unusable data in the shared manifest: {shown}{more}. Nothing was changed: other replicas share it, "
            f"so one replica does not set it aside alone. To set it aside for every replica: "
            f"{ADMIN_COMMAND.replace('NAME', names)}")


def examine(store: ExpertStore, expert: ExpertRow) -> Problems:
    """What of ``expert`` cannot be used: its current weights, else each pending update that cannot."""
    problems = Problems(expert.name, expert=expert_problem(store, expert))
    if problems.expert is None:
        for update in store.rows.pending_updates(expert.name):
            reason = update_problem(store, expert, update)
            if reason is not None:
                problems.updates.append((update, reason))
    return problems


def set_aside(store: ExpertStore, problems: Problems) -> str:
    """Quarantine what ``problems`` names (the whole expert, or its unusable pending updates); what was done."""
    expert = store.require_expert(problems.name)
    if problems.expert is not None:
        kept = quarantine_expert(store, expert, problems.expert)
        return f"expert {expert.name!r} set aside ({problems.expert}); {len(kept)} blob(s) kept in " \
               f"{store.blobs.quarantine_location}"
    quarantine_updates(store, expert.name, [u for u, _ in problems.updates],
                       "; ".join(sorted({why for _, why in problems.updates})))
    return f"{len(problems.updates)} pending update(s) of {expert.name!r} set aside: " \
           + ", ".join(u.update_id for u, _ in problems.updates)


def expert_problem(store: ExpertStore, expert: ExpertRow) -> str | None:
    """Why the expert's current weights cannot be used (missing, unreadable, other tensors, NaN/Inf), or None."""
    manifest = manifest_from_json(expert.manifest)
    try:
        with store.local_file(store.weights(expert.name).digest) as path:
            if read_header(path).manifest != sorted(manifest):
                return "its weights do not hold the tensors its manifest names"
            check_file(path, manifest)  # chunked: bounded memory; finiteness too
    except REFUSALS + (OSError,) as exc:
        return _reason(exc)
    return None


def update_problem(store: ExpertStore, expert: ExpertRow, update: UpdateRow) -> str | None:
    """Why a pending update cannot be applied to its expert, or None."""
    if update.blob is None:
        return "its payload is missing"
    try:
        with store.local_file(update.blob) as path:
            check_update(path, update.meta["codec"], update.meta.get("codec_config") or {},
                         manifest_from_json(expert.manifest))
    except REFUSALS + (OSError, KeyError) as exc:
        return _reason(exc)
    return None


def quarantine_updates(store: ExpertStore, name: str, updates: list[UpdateRow], reason: str) -> None:
    """Set pending updates aside for good (never applied); keep a copy of their payloads."""
    def event(u: UpdateRow, kept: str | None) -> audit.Event:
        return audit.update_quarantined(name, u.update_id, u.worker_id, reason, kept)

    if store.quarantine_updates(name, updates, reason, event):
        log.error("pending update(s) %s of expert %s quarantined: %s", [u.update_id for u in updates], name, reason)


def quarantine_expert(store: ExpertStore, expert: ExpertRow, reason: str) -> list[str]:
    """Remove an expert whose weights cannot be used; keep copies of all its blobs. Returns the copies' names."""
    kept = store.remove_expert(expert, reason,
                               lambda kept: audit.expert_quarantined(expert.name, expert.version, reason, kept))
    log.error("expert %s quarantined: %s; %d blob(s) kept in %s; the next worker of %s creates it again",
              expert.name, reason, len(kept), store.blobs.quarantine_location, expert.name)
    return kept


def _reason(exc: BaseException) -> str:
    if isinstance(exc, NotFound):
        return exc.message
    if isinstance(exc, FileNotFoundError):
        return "its blob is missing"
    return str(getattr(exc, "message", exc))
