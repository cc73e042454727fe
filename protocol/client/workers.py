"""A client's worker calls (register, heartbeat, revoke, list) and the worker tokens it keeps.

Registering a worker returns a token scoped to its specialty; ``Workers`` keeps it and is the
transport's ``Credentials``: that worker's pushes, pulls, heartbeats and profiles carry it, and a
401 to it registers the worker again once (expired). The token is also kept on disk
(``protocol.credentials``): a worker id that holds a valid token can only be registered again with
that token (or by the admin), so registering presents the worker's own token first, the join token
only if that is refused.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from protocol.client.transport import Transport
from protocol.credentials import store_worker_token, stored_worker_token
from protocol.errors import Forbidden, Unauthorized

log = logging.getLogger(__name__)


class Workers:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._tokens: dict[str, tuple[str, str]] = {}  # worker_id -> (token, specialty)
        self._expert_tokens: dict[str, tuple[str, str]] = {}  # specialty -> its latest (token, worker_id)
        self._registrations: dict[str, dict[str, Any]] = {}  # worker_id -> body, to renew its token

    def token_for(self, worker: str | None, expert: str | None) -> tuple[str | None, str | None]:
        """(token, worker it belongs to or None) for a call on behalf of ``worker`` / about ``expert``."""
        if worker in self._tokens:
            token, specialty = self._tokens[worker]
            if None in (expert, specialty) or specialty == expert:  # a heartbeat names no expert: still this worker's
                return token, worker
        if expert is not None and expert in self._expert_tokens:
            return self._expert_tokens[expert]
        return self.transport.token, None

    def renew(self, owner: str) -> bool:
        """Register ``owner`` again with what it registered with last (its token was refused: expired)."""
        if owner not in self._registrations:
            return False
        log.info("worker token of %s rejected; registering again", owner)
        self.register(**self._registrations.pop(owner))
        return True

    def token_of(self, worker_id: str) -> str:
        """The token the coordinator issued ``worker_id`` (KeyError before it registered with auth on)."""
        return self._tokens[worker_id][0]

    def register(self, worker_id: str, specialty: str, base_model: dict[str, str],
                 sync_interval: float | None = None) -> dict[str, Any]:
        """``POST /workers``; from then on this worker's calls carry its own, specialty-scoped token."""
        body: dict[str, Any] = {"worker_id": worker_id, "specialty": specialty, "base_model": base_model}
        if sync_interval is not None:
            body["sync_interval"] = sync_interval  # lets the coordinator tell alive from stale
        info = self._post(worker_id, body)
        token, expires_at = info.pop("token", None), info.get("token_expires_at")
        if token:
            self._keep_on_disk(worker_id, token, expires_at)
            self._tokens[worker_id] = (token, specialty)
            self._expert_tokens[specialty] = (token, worker_id)
            self._registrations[worker_id] = {"worker_id": worker_id, "specialty": specialty,
                                              "base_model": base_model, "sync_interval": sync_interval}
        return info

    def _post(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /workers with the worker's own token (renewal; expired is fine), else with our token."""
        # the token this coordinator issued (kept per URL: after failing back to a relay, its own), else ours
        owns = [stored_worker_token(self.transport.base_url, worker_id),
                self._tokens[worker_id][0] if worker_id in self._tokens else None]
        for own in dict.fromkeys(t for t in owns if t):
            try:
                return self.transport.call_with_token("POST", "/workers", own, json=body).json()
            except (Unauthorized, Forbidden) as exc:  # e.g. a coordinator on a fresh data dir never issued it
                log.info("the coordinator did not renew the token of %s (%s); registering with %s", worker_id,
                         exc, self.transport.token_source)
        return self.transport.json("POST", "/workers", json=body)

    def _keep_on_disk(self, worker_id: str, token: str, expires_at: Any) -> None:
        try:
            store_worker_token(self.transport.base_url, worker_id, token, float(expires_at or time.time()))
        except OSError as exc:  # only a restart within the token's lifetime needs it
            log.warning("cannot keep the token of worker %s on disk (%s); after a restart it needs the admin "
                        "token or another --worker-id", worker_id, exc)

    def heartbeat(self, worker_id: str) -> None:
        self.transport.request("POST", f"/workers/{worker_id}/heartbeat", worker=worker_id)

    def revoke(self, worker_id: str) -> dict[str, Any]:
        """Admin: revoke every token of ``worker_id``; it cannot register again."""
        return self.transport.json("DELETE", f"/workers/{worker_id}")

    def list(self) -> list[dict[str, Any]]:  # last: a method named list would shadow the type in the ones below
        """Every registered worker (``GET /workers``): id, specialty, last seen, pushes."""
        return self.transport.json("GET", "/workers")["workers"]
