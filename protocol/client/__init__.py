"""Typed HTTP client for the coordinator API, used by workers, relays and the gateway tool.

``CoordinatorClient`` holds one ``Transport`` (timeouts, retries, fail-over between a root and its
relays, TLS, tokens: transport.py) and groups the API's calls by what they are about, each group
a small class over that transport::

    client = CoordinatorClient("http://127.0.0.1:5000")
    client.workers.register("w1", "python_expert", base_model)    # workers.py: tokens, heartbeats
    client.experts.create("python_expert", adapter, spec)         # experts.py: experts, pulls, profiles
    client.updates.push("python_expert", body, meta)              # updates.py: pushes, resumable uploads
    client.gateway.info()                                         # gateway.py: gateway, routing
    client.placement.plan()                                       # placement.py: relays, link reports
    client.cohorts.join("python_expert", "w1")                    # cohorts.py: secure aggregation rounds

Credentials (README, "Security"): the token given, else ``FEDMOE_TOKEN``, else the one a coordinator on
this machine recorded (``protocol.credentials``); a registered worker's calls carry its own token.

Exception tree (``protocol.errors``; the status each answers with in parentheses)::

    FedMoEError
    ├── BadRequest (400)
    │   └── InvalidPayload (400)
    ├── Unauthorized (401)
    ├── Forbidden (403)
    ├── NotFound (404)
    ├── RequestTimeout (408)
    ├── Conflict (409)
    ├── PayloadTooLarge (413)
    ├── InvalidUpdate (422)
    ├── TLSFailure            (client side only: the handshake failed)
    └── Unavailable (503)     (also: unreachable after the last retry)
        ├── TooManyRequests (429)
        └── InsufficientStorage (507)
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.client.bodies import Chunks
from protocol.client.cohorts import Cohorts
from protocol.client.experts import Experts, Pulled
from protocol.client.gateway import Gateway
from protocol.client.placement import Placement
from protocol.client.transport import RetryPolicy, Transport
from protocol.client.updates import Updates
from protocol.client.workers import Workers
from protocol.errors import FedMoEError, TLSFailure, TooManyRequests, Unavailable
from protocol.probe import LinkEstimate, probe
from protocol.uploads import UploadPolicy


class CoordinatorClient:
    def __init__(self, base_url: str, *, timeout: tuple[float, float] = (5.0, 120.0),
                 retry: RetryPolicy = RetryPolicy(), use_proxy: bool = False, token: str | None = None,
                 ca_cert: str | Path | None = None, upload: UploadPolicy = UploadPolicy(),
                 failback_seconds: float = 300.0, prober: Callable[[str], LinkEstimate] = probe) -> None:
        """``timeout`` is (connect, read) seconds for every call; ``ca_cert`` a PEM file to trust for https;
        ``upload`` when and how pushes go through a resumable upload.

        ``base_url`` may be a comma list (relays and the root): the client probes them and talks to the
        best (protocol/probe.py), fails over to the next best when its coordinator stops answering, and
        re-probes every ``failback_seconds`` to fail back when a better one is up again.
        """
        self.transport = Transport(base_url, timeout=timeout, retry=retry, use_proxy=use_proxy, token=token,
                                   ca_cert=ca_cert, failback_seconds=failback_seconds, prober=prober)
        self.workers = Workers(self.transport)
        self.transport.credentials = self.workers  # a registered worker's calls carry its own token
        self.experts = Experts(self.transport)
        self.updates = Updates(self.transport, upload)
        self.gateway = Gateway(self.transport)
        self.placement = Placement(self.transport)
        self.cohorts = Cohorts(self.transport)

    @property
    def base_url(self) -> str:
        """The coordinator the next call goes to (one of a comma list's, after probing or failing over)."""
        return self.transport.base_url

    def move_to(self, urls: list[str]) -> bool:
        """Sync with ``urls[0]`` from the next call on, the rest as its fail-over (``Transport.move_to``)."""
        return self.transport.move_to(urls)

    def close(self) -> None:
        self.transport.close()

    def health(self) -> dict[str, Any]:
        """``GET /health``: status, role (root or relay), version."""
        return self.transport.json("GET", "/health")

    def events(self, kind: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The audit log, newest first (``GET /api/v1/events``), of one ``kind`` if given."""
        params: dict[str, Any] = {"limit": limit} | ({"kind": kind} if kind else {})
        return self.transport.json("GET", "/events", params=params)["events"]


__all__ = ["Chunks", "CoordinatorClient", "FedMoEError", "Pulled", "RetryPolicy", "TLSFailure", "TooManyRequests",
           "Transport", "Unavailable"]
