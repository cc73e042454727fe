"""Follow the federation: poll the coordinator and install every new expert or gateway version.

Each poll lists the experts (their versions), pulls the weights of those that changed with
``If-None-Match`` (a 304 costs nothing), asks for the gateway (rebuilt by the coordinator when an
expert changed; downloaded only when its digest differs) and refreshes the routing profiles.
Downloads happen on this thread while requests keep being served; the engine then loads each
new version into a fresh slot between batches and publishes it (serving/adapters.py). When the
coordinator is unreachable the server keeps serving what it has and tries again next poll.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError
from protocol.client import CoordinatorClient
from protocol.errors import Conflict, FedMoEError, NotFound
from serving.adapters import GATEWAY
from serving.engine import AdapterWeights, GenerationEngine
from serving.routing import LocalRouter

log = logging.getLogger(__name__)


@dataclass
class FollowState:
    versions: dict[str, int] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    gateway_digest: str | None = None
    skipped: set[str] = field(default_factory=set)
    """Experts that cannot be served (full-parameter, another base model): warned about once."""
    last_swap_seconds: float | None = None
    """Download plus install time of the last new version."""


class FederationFollower:
    def __init__(self, client: CoordinatorClient, engine: GenerationEngine, router: LocalRouter,
                 base_fingerprint: str, poll_interval: float) -> None:
        self.client, self.engine, self.router = client, engine, router
        self.fingerprint = base_fingerprint
        self.poll_interval = poll_interval
        self.state = FollowState()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="federation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.sync()
            except (FedMoEError, GatewayError, ValueError, OSError) as exc:
                log.warning("cannot follow the federation this time (%s); serving what is loaded", exc)

    def sync(self) -> list[str]:
        """One poll; returns what was (re)loaded, e.g. ["python_expert v3", "gateway v7"]."""
        loaded = [f"{e['name']} v{e['version']}" for e in self.client.experts.list() if self._sync_expert(e)]
        if self._sync_gateway():
            loaded.append(f"gateway v{self.state.versions[GATEWAY]}")
        self._sync_profiles()
        return loaded

    def _sync_expert(self, info: dict[str, Any]) -> bool:
        name = info["name"]
        if self.state.versions.get(name) == info["version"] or not self._servable(name, info):
            return False
        started = time.perf_counter()
        pulled = self.client.experts.pull(name, etag=self.state.etags.get(name))
        if pulled.tensors is None:  # 304: what we hold is current
            self.state.versions[name] = pulled.version
            return False
        self.state.versions[name], self.state.etags[name] = pulled.version, pulled.etag or ""
        if not self._install(AdapterWeights(name, pulled.version, pulled.tensors, info["lora"])):
            return False
        self.state.last_swap_seconds = time.perf_counter() - started
        return True

    def _servable(self, name: str, info: dict[str, Any]) -> bool:
        reason = None
        if info.get("kind") == "full" or not info.get("lora"):
            reason = "it is full-parameter (every weight), not a LoRA adapter"
        elif info.get("base_model", {}).get("fingerprint") != self.fingerprint:
            reason = f"it was trained from another base model ({info.get('base_model', {}).get('id')!r})"
        if reason and name not in self.state.skipped:
            self.state.skipped.add(name)
            log.warning("not serving expert %s: %s", name, reason)
        return reason is None

    def _sync_gateway(self) -> bool:
        try:
            info = self.client.gateway.info()
        except NotFound:  # no expert yet
            return False
        except Conflict as exc:  # experts that cannot be merged (e.g. full-parameter and LoRA together)
            log.warning("no gateway to serve: %s", exc)
            return False
        if info.get("digest") == self.state.gateway_digest:
            return False
        if info.get("kind") == "full" or not info.get("lora") or \
                info.get("base_model", {}).get("fingerprint") != self.fingerprint:
            self.state.gateway_digest = info.get("digest")
            log.warning("not serving the gateway: it is not a LoRA adapter of this base model")
            return False
        tensors = self.client.gateway.tensors()
        self.state.gateway_digest, self.state.versions[GATEWAY] = info.get("digest"), int(info["version"])
        return self._install(AdapterWeights(GATEWAY, int(info["version"]), tensors, info["lora"]))

    def _install(self, weights: AdapterWeights) -> bool:
        """Load and publish on the engine thread; a version that does not load is skipped (the old one stays)."""
        try:
            self.engine.install(weights).result()
        except (GatewayError, ValueError, KeyError, RuntimeError) as exc:
            log.warning("cannot serve %s v%d (%s); keeping the version loaded before, if any",
                        weights.model, weights.version, exc)
            return False
        return True

    def _sync_profiles(self) -> None:
        try:
            self.router.update(self.client.gateway.profiles())
        except NotFound:  # a coordinator without GET /profiles: auto always uses the gateway
            log.warning("the coordinator has no GET /api/v1/profiles; 'auto' answers with the gateway")
