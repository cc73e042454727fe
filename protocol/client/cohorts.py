"""The worker's side of the secure-aggregation routes: a ``privacy.secagg.session.CohortTransport`` over HTTP.

Each method is one request through the client's ``Transport`` (its token, retries, timeouts and failover),
answering the JSON the coordinator's (or a relay's) ``SecureAggregator`` answered. Every request names
the worker; with auth on, a worker token may only name its own id.

    POST /experts/<expert>/cohorts         {"worker_id"}                    join the expert's forming cohort
    GET  /cohorts/<id>?worker_id=W                                          the cohort's phase, roster, request
    POST /cohorts/<id>/keys                {"worker_id", "cipher", "mask"}  round 0: two X25519 public keys
    POST /cohorts/<id>/shares              {"worker_id", "sealed", "commitment"}   round 1
    GET  /cohorts/<id>/shares?worker_id=W                                   the shares sealed to W
    POST /cohorts/<id>/inputs              raw uint32 body, meta in X-FedMoE-Update    round 2
    POST /cohorts/<id>/answers             {"worker_id", "seeds", "keys"}   round 3: unmasking shares
"""
from __future__ import annotations

import json
from typing import Any

from protocol.client.transport import Transport
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import UPDATE_HEADER


class Cohorts:
    """Secure-aggregation calls of a worker (``client.cohorts``), each naming the worker it is made for."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def _json(self, method: str, path: str, worker: str, **kwargs: Any) -> dict[str, Any]:
        answer = self.transport.json(method, path, worker=worker, **kwargs)
        if not isinstance(answer, dict):
            raise ValueError(f"{method} {path} answered {type(answer).__name__}, not a JSON object")
        return answer

    def join(self, expert: str, worker: str) -> dict[str, Any]:
        return self._json("POST", f"/experts/{expert}/cohorts", worker, json={"worker_id": worker})

    def status(self, cohort_id: str, worker: str) -> dict[str, Any]:
        return self._json("GET", f"/cohorts/{cohort_id}", worker, params={"worker_id": worker})

    def post_keys(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._json("POST", f"/cohorts/{cohort_id}/keys", worker, json={"worker_id": worker, **body})

    def post_shares(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._json("POST", f"/cohorts/{cohort_id}/shares", worker, json={"worker_id": worker, **body})

    def shares_for(self, cohort_id: str, worker: str) -> dict[str, Any]:
        return self._json("GET", f"/cohorts/{cohort_id}/shares", worker, params={"worker_id": worker})

    def post_masked(self, cohort_id: str, worker: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        headers = {UPDATE_HEADER: json.dumps({"worker_id": worker, **meta}), DIGEST_HEADER: digest_header(body),
                   "Content-Type": "application/octet-stream"}
        return self._json("POST", f"/cohorts/{cohort_id}/inputs", worker, data=body, headers=headers)

    def post_answer(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._json("POST", f"/cohorts/{cohort_id}/answers", worker, json={"worker_id": worker, **body})
