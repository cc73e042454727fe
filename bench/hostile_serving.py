"""serve.py under hostile clients, for bench/hostile.py: slow clients (A/B against another checkout's serve.py in the
same run) and sampling edge values, an honest client's latencies during each (bench/hostile_clients.py)."""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from bench.common import ROOT, CoordinatorProcess
from bench.hostile_clients import Honest, Tally, peak_growth, percentiles, status_of
from bench.slow_clients import KINDS, Attack

if TYPE_CHECKING:
    from bench.serve import ServeProcess

log = logging.getLogger("bench.hostile_serving")
KEY = "sk-bench-hostile"
EXPERT = "python_expert"
MAX_TOKENS = 4
SAMPLING_EDGES: dict[str, dict[str, Any]] = {
    "temperature 1e-300": {"temperature": 1e-300}, "temperature 5e-324": {"temperature": 5e-324},
    "temperature 1e-45": {"temperature": 1e-45}, "temperature 1e-38": {"temperature": 1e-38},
    "temperature 1e-5": {"temperature": 1e-5}, "temperature 2": {"temperature": 2.0},
    "top_p 5e-324": {"temperature": 1.0, "top_p": 5e-324}, "top_p 1e-300 at 1e-45": {"temperature": 1e-45,
                                                                                        "top_p": 1e-300},
    "top_p 1": {"temperature": 1.0, "top_p": 1.0}, "temperature 2, top_p 1e-5": {"temperature": 2.0, "top_p": 1e-5},
    # refused (400): out of range, not numbers
    "temperature -5e-324": {"temperature": -5e-324}, "temperature 2.0000000000000004": {"temperature": 2 + 4e-16},
    "temperature 1e309 (inf)": {"temperature": 1e309}, "temperature true": {"temperature": True},
    "top_p 0": {"top_p": 0}, "top_p -0.0": {"top_p": -0.0}, "top_p 1.0000000000000002": {"top_p": 1 + 2e-16},
}
"""Sampling values at the edges of what serve.py takes: all answered 200 or 400, never a 5xx."""


def seeded_coordinator(directory: Path) -> CoordinatorProcess:
    """A coordinator holding one tiny-qwen2 LoRA expert, EXPERT, for serve.py to load."""
    from bench.serve import lora_adapter
    from protocol.client import CoordinatorClient
    from models.loading import LORA_PROJECTIONS, load_base_model

    coordinator = CoordinatorProcess(directory, "--rate-limit", "0")
    coordinator.start()
    base = load_base_model("tiny-qwen2")
    spec = {"lora": {"rank": 8, "alpha": 16.0, "target_modules": list(LORA_PROJECTIONS)},
            "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    CoordinatorClient(coordinator.url).experts.create(EXPERT, lora_adapter(base.model, 0), spec)
    return coordinator


def start_serve(root: Path, coordinator: CoordinatorProcess, directory: Path) -> ServeProcess:
    keys = directory / f"keys-{os.getpid()}-{time.monotonic_ns()}.txt"
    keys.write_text(KEY + "\n")
    from bench.serve import ServeProcess  # torch and the models: imported only when serve.py is attacked

    return ServeProcess(root, coordinator.url, keys, "--threads", "1", "--max-tokens", "64", "--timeout", "120")


def chat(url: str, timeout: float = 120.0, **sampling: Any) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                         data=json.dumps({"model": EXPERT, "messages": [{"role": "user", "content": "def add(a, b):"}],
                                          "max_tokens": MAX_TOKENS, **sampling}),
                         )


class HonestServeClient:
    """GET /health and short greedy completions, one new connection each, latencies kept."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout

    def run(self, health: int, completions: int) -> dict[str, Any]:
        tally, health_s, chat_s = Tally(), [], []
        for i in range(max(health, completions)):
            if i < health:
                health_s += self._timed(tally, f"health {i}", lambda: requests.get(self.url + "/health",
                                                                                    timeout=self.timeout))
            if i < completions:
                chat_s += self._timed(tally, f"completion {i}", lambda: chat(self.url, self.timeout, temperature=0))
        return tally.summary() | {"health": percentiles(health_s), "completion": percentiles(chat_s),
                                  "health_answered": len(health_s), "completions_answered": len(chat_s)}

    @staticmethod
    def _timed(tally: Tally, name: str, call: Callable[[], requests.Response]) -> list[float]:
        started = time.perf_counter()
        try:
            status: int | None = call().status_code
        except requests.RequestException:
            status = None
        tally.record(name, status)
        return [time.perf_counter() - started] if status is not None and status < 500 else []


def serve_slow_clients(directory: Path, roots: Sequence[Path], connections: int, health: int, completions: int,
                       timeout: float = 120.0) -> dict[str, Any]:
    """serve.py of each checkout in ``roots`` in turn, against one coordinator: an honest client's latencies without,
    then with, ``connections`` slow clients (dripped heads, slow bodies, idle keep-alive; no key needed) holding
    sockets, and serve.py's peak RSS growth meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    coordinator = seeded_coordinator(directory / "coordinator")
    try:
        return {str(root): _serve_under_attack(root, coordinator, directory, connections, health, completions,
                                               timeout) for root in roots}
    finally:
        coordinator.stop()


def _serve_under_attack(root: Path, coordinator: CoordinatorProcess, directory: Path, connections: int, health: int,
                        completions: int, timeout: float) -> dict[str, Any]:
    server = start_serve(root, coordinator, directory)
    try:
        client = HonestServeClient(server.url, timeout)
        client.run(2, 2)  # warm: the first generation's one-time costs are not what this compares
        quiet = client.run(health, completions)
        host, port = server.url.split("://")[1].split(":")
        counts = {kind: connections // 3 + (i < connections % 3) for i, kind in enumerate(KINDS[:3])}
        attack = Attack(host, int(port), False, counts, "/v1/models", KEY, health_path="/health",
                        body_path="/v1/chat/completions", body_size=500_000)

        def under_attack() -> dict[str, Any]:
            all_opened = attack.start()
            loaded = client.run(health, completions)
            still_open = attack.open_now
            attack.stop()
            return loaded | {"all_opened": all_opened, "open_during": still_open}

        loaded, growth = peak_growth(server.proc.pid, under_attack)
    finally:
        server.stop()
    log.info("serve.py of %s: quiet %s, under attack %s", root, quiet["completion"], loaded["completion"])
    return {"server": _server_kind(root), "connections": connections, "opened": dict(attack.opened),
            "failed_to_open": attack.failed_to_open, "closed_by_server_before_end": dict(attack.closed_by_server),
            "quiet": quiet, "under_attack": loaded, "peak_rss_growth_mb": round(growth / (1 << 20), 1)}


def _server_kind(root: Path) -> str:
    text = (root / "serving" / "server.py").read_text()
    return "buffering front" if "serve_http" in text else "werkzeug threaded" if "make_server" in text else "?"


def sampling_edges(directory: Path, rounds: int = 1) -> dict[str, Any]:
    """SAMPLING_EDGES sent to this checkout's serve.py (``rounds`` times each), an honest client asking meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    coordinator = seeded_coordinator(directory / "coordinator")
    try:
        server = start_serve(ROOT, coordinator, directory)
        try:
            tally = Tally()
            honest = [status_of(lambda: requests.get(server.url + "/health", timeout=120)),
                      status_of(lambda: chat(server.url, temperature=0))]
            with Honest(honest) as client:
                for i in range(rounds):
                    for name, sampling in SAMPLING_EDGES.items():
                        try:
                            tally.record(f"{name} #{i + 1}", chat(server.url, **sampling).status_code)
                        except requests.RequestException:
                            tally.record(f"{name} #{i + 1}", None)
            tally.honest_s = client.seconds
        finally:
            server.stop()
    finally:
        coordinator.stop()
    return tally.summary() | {"honest_failed": client.failed}
