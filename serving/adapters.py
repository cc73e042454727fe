"""Which adapter answers for each model name, and which old ones may be dropped.

Every version of an expert (or of the gateway) is loaded into the one PEFT model under its own
*slot* name (``slot7``), never overwritten in place. A request pins the slot it was
admitted with; publishing a new version only changes which slot the name points to, and the
old slot is deleted once no request pins it. So a request never sees a half-loaded adapter nor
has its adapter swapped under it mid-generation: it runs to the end on the version it started
with, and the next request gets the new one.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from serving.errors import ModelNotFound

GATEWAY = "gateway"
AUTO = "auto"
ROUTED_NAMES = (AUTO, "routed", "mixture")
"""Model names the router resolves per request (serving/choices.py), besides the experts and the gateway."""


@dataclass(eq=False)
class LoadedAdapter:
    model: str
    """Public name: an expert's name or "gateway"."""
    slot: str
    """PEFT adapter name of this version (unique for the server's lifetime)."""
    version: int
    """The coordinator's version of the expert (or of the gateway)."""
    rank: int
    loaded_at: float = field(default_factory=time.time)
    users: int = 0
    """Requests admitted with this adapter and not finished."""


class AdapterRegistry:
    """Name -> live adapter, plus retired adapters waiting for their last request. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, LoadedAdapter] = {}
        self._retired: list[LoadedAdapter] = []
        self._serial = itertools.count(1)
        self.generation = 0
        """Incremented on every publish: responses and tests can tell adapter sets apart."""

    def new_slot(self) -> str:
        """A fresh PEFT adapter name (torch module names cannot hold the dots expert names may have)."""
        return f"slot{next(self._serial)}"

    def names(self) -> list[LoadedAdapter]:
        with self._lock:
            return sorted(self._live.values(), key=lambda a: (a.model == GATEWAY, a.model))

    def experts(self) -> set[str]:
        with self._lock:
            return {name for name in self._live if name != GATEWAY}

    def get(self, model: str) -> LoadedAdapter | None:
        with self._lock:
            return self._live.get(model)

    def pin(self, model: str) -> LoadedAdapter:
        """The live adapter of ``model``, held until ``unpin``; ModelNotFound if there is none."""
        with self._lock:
            adapter = self._live.get(model)
            if adapter is None:
                known = ", ".join(sorted(self._live) + list(ROUTED_NAMES))
                raise ModelNotFound(f"the model {model!r} does not exist; available: {known}", param="model")
            adapter.users += 1
            return adapter

    def unpin(self, adapter: LoadedAdapter) -> None:
        with self._lock:
            adapter.users -= 1

    def publish(self, adapter: LoadedAdapter) -> None:
        """Make ``adapter`` (fully loaded) the one its name answers with from the next request on."""
        with self._lock:
            old = self._live.get(adapter.model)
            self._live[adapter.model] = adapter
            if old is not None:
                self._retired.append(old)
            self.generation += 1

    def withdraw(self, model: str) -> None:
        """Stop answering for ``model`` (e.g. it became unusable); its requests in flight finish."""
        with self._lock:
            old = self._live.pop(model, None)
            if old is not None:
                self._retired.append(old)
                self.generation += 1

    def reapable(self) -> list[LoadedAdapter]:
        """Retired adapters no request holds any more, removed from the registry: delete their slots."""
        with self._lock:
            done = [a for a in self._retired if a.users == 0]
            self._retired = [a for a in self._retired if a.users > 0]
            return done
