"""The events the coordinator writes to its audit log: one builder per kind, each one human line and its detail.

The log itself (table ``events``, ``Event``, and the norm history) is coordinator/storage/audit_log.py; the
manifest writes an event in the same transaction as the change it records.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from coordinator.storage.audit_log import Event
from protocol.errors import BadRequest
from protocol.schemas import loads_json

if TYPE_CHECKING:
    from coordinator.checks.norm_check import NormVerdict
    from protocol.errors import FedMoEError
    from protocol.schemas import UpdateMeta


# the events the coordinator writes -----------------------------------------------------------


def expert_created(name: str, rank: int | None, base_model: str) -> Event:
    """``rank`` None: a full-parameter expert."""
    kind = "full-parameter" if rank is None else f"LoRA rank {rank}"
    return Event("expert_created", f"expert {name} created ({kind}, base model {base_model})",
                 expert=name, detail={"rank": rank, "base_model": base_model})


def worker_registered(worker_id: str, specialty: str, base_model: str, sync_interval: float | None) -> Event:
    return Event("worker_registered", f"worker {worker_id} registered for {specialty}", expert=specialty,
                 worker_id=worker_id, detail={"base_model": base_model, "sync_interval": sync_interval})


def update_accepted(name: str, meta: "UpdateMeta", verdict: "NormVerdict", size: int) -> tuple[Event, ...]:
    """update_accepted, plus update_clipped when the norm check scaled it down."""
    who = dict(expert=name, worker_id=meta.worker_id, update_id=meta.update_id)
    accepted = Event("update_accepted", f"update {meta.update_id} accepted ({meta.num_samples} samples, "
                     f"base version {meta.base_version}, norm {verdict.norm:.4g})", **who,
                     detail={"norm": verdict.norm, "limit": verdict.limit, "num_samples": meta.num_samples,
                             "base_version": meta.base_version, "codec": meta.codec, "body_bytes": size,
                             "train_loss": meta.train_loss})
    if not verdict.clipped:
        return (accepted,)
    return accepted, Event("update_clipped", f"update {meta.update_id} clipped from norm {verdict.norm:.4g} to "
                           f"{verdict.limit:.4g} (--norm-factor x median of {verdict.history} recent norms)", **who,
                           detail={"norm": verdict.norm, "limit": verdict.limit, "history": verdict.history,
                                   "scale": verdict.scale})


def update_duplicate(name: str, worker_id: str | None, update_id: str, status: str) -> Event:
    return Event("update_duplicate", f"update {update_id} was received before ({status}); not applied again",
                 expert=name, worker_id=worker_id, update_id=update_id, detail={"status": status})


def version_applied(name: str, version: int, update_ids: list[str], staleness: list[int],
                    train_loss: float | None, weighting: Mapping[str, Any] | None = None) -> Event:
    """``weighting``: the step's alpha and staleness grace (and the workers counted for them), when known."""
    return Event("version_applied", f"expert {name} -> version {version} from {len(update_ids)} update(s)",
                 expert=name, detail={"version": version, "num_updates": len(update_ids), "train_loss": train_loss,
                                      "update_ids": update_ids, "staleness": staleness, **(weighting or {})})


def rejection_event(expert: str, status: int, code: str, message: str, details: dict[str, Any],
                    update_header: str | None, worker_header: str | None, remote_addr: str | None,
                    caller: str | None = None) -> Event:
    """The event for a refused push, built from whatever of the request could be read.

    Who: ``caller`` (the worker its token names) if known; else (admin, or auth off) the worker_id
    in the update metadata header if it parses, else the X-FedMoE-Worker header, else the remote
    address (the request may be refused precisely because it is garbage). A claimed worker id that
    is not the caller's stays in the detail as ``claimed_worker_id``.
    """
    claimed, update_id = _ids_from_header(update_header)
    who = caller or claimed or worker_header or remote_addr
    if caller is not None and claimed not in (None, caller):
        details = {**details, "claimed_worker_id": claimed}
    reason = str(details.get("reason", code))
    return Event("update_rejected", f"update {update_id or '(no id)'} from {who or 'unknown'} rejected "
                 f"({status} {reason}): {message}", expert=expert, worker_id=who, update_id=update_id,
                 detail={**details, "reason": reason, "status": status, "error": message[:500],
                         "remote_addr": remote_addr})


def refusal_event(status: int, code: str, message: str, method: str, path: str, expert: str | None,
                  worker_id: str | None, role: str, remote_addr: str | None) -> Event:
    """A request refused by authentication, authorization or the rate limit (401, 403, 429)."""
    who = worker_id or f"{role}@{remote_addr}"
    return Event("request_refused", f"{method} {path} from {who} refused ({status} {code}): {message}",
                 expert=expert, worker_id=worker_id,
                 detail={"status": status, "reason": code, "role": role, "method": method, "path": path[:200],
                         "error": message[:500], "remote_addr": remote_addr})


def _ids_from_header(raw: str | None) -> tuple[str | None, str | None]:
    try:
        meta = loads_json(raw, "update header") if raw else None
    except BadRequest:  # malformed or nested too deep: the refusal is logged without ids
        return None, None
    if not isinstance(meta, dict):
        return None, None
    worker_id, update_id = meta.get("worker_id"), meta.get("update_id")
    return (worker_id if isinstance(worker_id, str) and worker_id else None,
            update_id if isinstance(update_id, str) and update_id else None)


def update_refused_upstream(name: str, update_id: str, worker_id: str | None, batch_id: str,
                            exc: "FedMoEError") -> Event:
    """At a relay: a worker update it had acknowledged that the root refused, alone in batch ``batch_id``."""
    reason = str(exc.details.get("reason", exc.code))
    return Event("update_rejected", f"update {update_id} from {worker_id or 'unknown'} refused upstream "
                 f"({exc.status} {reason}) in batch {batch_id}: {exc.message}", expert=name, worker_id=worker_id,
                 update_id=update_id, detail={"reason": reason, "status": exc.status, "error": exc.message[:500],
                                              "batch": batch_id, "upstream": True})


def update_quarantined(name: str, update_id: str, worker_id: str | None, reason: str, kept: str | None) -> Event:
    return Event("update_quarantined", f"pending update {update_id} of {name} set aside, never applied: {reason}",
                 expert=name, worker_id=worker_id, update_id=update_id, detail={"reason": reason[:500], "kept": kept})


def expert_quarantined(name: str, version: int, reason: str, kept: list[str]) -> Event:
    return Event("expert_quarantined", f"expert {name} (version {version}) set aside: {reason}; its next worker "
                 "creates it again", expert=name, detail={"version": version, "reason": reason[:500], "kept": kept})
