"""The operator's command that sets unusable experts aside: ``run_coordinator.py --quarantine NAME[,NAME]``.

Start-up recovery (coordinator/recovery.py) sets nothing aside by itself when the manifest is shared
(PostgreSQL) or when a blob is missing: it refuses to start and names this command. The command opens
the store as the coordinator would (the same --data-dir, --manifest and --blobs), first uploads again any
lost blob this data dir still holds, then for each named expert, under the expert's lock (held across
replicas), re-checks it and:

- if its current weights are missing or unusable, removes the expert (its versions and routing
  profiles) and quarantines its pending updates; the update rows stay, so their ids keep answering
  (status ``quarantined``) and are never taken as new, and the next worker of that specialty creates
  the expert again;
- else quarantines those of its pending updates that cannot be applied;
- refuses an expert with nothing unusable (a typo in NAME must not cost an expert).

A copy of every blob still readable is kept in ``<data dir>/quarantine``; the audit log records each
change (``expert_quarantined`` / ``update_quarantined``). Running replicas see the change at once.
"""
from __future__ import annotations

from collections.abc import Sequence

from coordinator.config import CoordinatorConfig
from coordinator.storage.expert_store import ExpertStore
from coordinator.recovery import Problems, examine, set_aside
from coordinator.service import open_store

BY_ADMIN = "set aside by run_coordinator.py --quarantine"


def quarantine_command(config: CoordinatorConfig, names: Sequence[str]) -> list[str]:
    """Set aside what is unusable of each expert in ``names``; one line per expert saying what was done.

    ValueError (nothing changed) if a name is no expert or names an expert with nothing unusable."""
    store = open_store(config)
    try:
        store.repair()
        for name in names:  # every name checked before anything is changed
            _require_problems(store, name)
        done = []
        for name in names:
            with store.expert_lock(name):  # re-checked under the lock: a replica may have repaired it meanwhile
                problems = _require_problems(store, name)
                done.append(set_aside(store, _by_admin(problems)))
        return done
    finally:
        store.close()


def _require_problems(store: ExpertStore, name: str) -> Problems:
    expert = store.rows.expert(name)
    if expert is None:
        raise ValueError(f"--quarantine {name!r}: no expert of that name; known experts: "
                         f"{[e.name for e in store.rows.experts()]}")
    problems = examine(store, expert)
    if not problems:
        raise ValueError(f"--quarantine {name!r}: its weights and pending updates are all there and usable "
                         f"in {store.blobs.location}; nothing to set aside, nothing was changed")
    return problems


def _by_admin(problems: Problems) -> Problems:
    """The same problems, their reasons saying who set them aside (audit log)."""
    return Problems(problems.name, None if problems.expert is None else f"{problems.expert} ({BY_ADMIN})",
                    [(update, f"{why} ({BY_ADMIN})") for update, why in problems.updates])
