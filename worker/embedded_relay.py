"""--can-relay: this worker also runs a relay, which the root may pick for the workers near it (docs/wan.md).

The relay is the relay every operator runs, ``run_coordinator.py --upstream <root>``, started as a child process:
the same code, durability and exactly-once, its own data dir, and the worker's training is not slowed by its
requests beyond the CPU they take. It registers at the root with the relay join token (``--relay-join-token-file``
or ``$FEDMOE_RELAY_JOIN_TOKEN``: a worker's join token cannot make it a relay) under the id ``<worker id>-relay``,
and publishes ``http://<host>:<port>``, ``host`` being the address this machine reaches the root from (what other
machines of its site can reach it at) unless ``--relay-host`` says otherwise. Until the root assigns it workers it
holds nothing and forwards nothing. It stops with the worker, after the worker's final push: it stops taking
requests, then forwards its queue (``--forward-on-exit``); what the root does not take then stays durable in its data
dir and goes when it starts again.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
ROOT_DIR = Path(__file__).resolve().parents[1]


class RelayStartError(RuntimeError):
    """The embedded relay did not come up; the message says why (the worker goes on without it)."""


@dataclass(frozen=True)
class RelaySettings:
    upstream: str
    """The root's URL."""
    relay_id: str
    data_dir: Path
    host: str | None = None
    """Address other workers reach this machine at (None: the one it reaches the root from)."""
    port: int = 0
    """Port to listen on (0: a free one)."""
    join_token: str | None = None
    relay_join_token_file: Path | None = None
    extra: tuple[str, ...] = ()
    """More run_coordinator.py flags (e.g. --forward-compression int8)."""


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (no packet is sent: a UDP socket's connect only routes)."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return str(sock.getsockname()[0])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


class EmbeddedRelay:
    """The child relay process; ``url`` is what it publishes at the root."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        port = settings.port or free_port()
        self.url = f"http://{settings.host or address_towards(settings.upstream)}:{port}"
        self._port = port
        self._proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        s = self.settings
        argv = [sys.executable, str(ROOT_DIR / "run_coordinator.py"), "--upstream", s.upstream, "--host", "0.0.0.0",
                "--port", str(self._port), "--data-dir", str(s.data_dir), "--relay-id", s.relay_id,
                "--advertise-url", self.url, "--forward-on-exit", *s.extra]
        if s.relay_join_token_file is not None:
            argv += ["--relay-join-token-file", str(s.relay_join_token_file)]
        return argv

    @property
    def log_path(self) -> Path:
        return self.settings.data_dir / "relay.log"

    def launch(self) -> None:
        """Start it and return at once: it registers at the root by itself once up, and only then does the root list
        it to workers, so the worker need not wait (a coordinator took minutes to import on a loaded machine)."""
        env = dict(os.environ)
        if self.settings.join_token:
            env["FEDMOE_JOIN_TOKEN"] = self.settings.join_token  # its own workers join it with the root's join token
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(self.command(), cwd=ROOT_DIR, env=env, stdout=out, stderr=subprocess.STDOUT)

    def exited(self) -> str | None:
        """Why the relay is gone (its exit code and last log line), or None while it runs (or before launch)."""
        if self._proc is None or self._proc.poll() is None:
            return None
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
        return f"the embedded relay exited {self._proc.returncode}: {' '.join(tail)} (log: {self.log_path})"

    def start(self, timeout: float = 120.0) -> None:
        """Launch it and wait until it listens (it has registered at the root by then)."""
        self.launch()
        assert self._proc is not None  # launched
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (reason := self.exited()) is not None:
                raise RelayStartError(reason)
            try:
                socket.create_connection(("127.0.0.1", self._port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RelayStartError(f"the embedded relay did not listen on port {self._port} within {timeout:.0f} s")

    def stop(self) -> None:
        if (reason := self.exited()) is not None:
            log.warning("--can-relay: %s", reason)
        if self._proc is None or self._proc.poll() is not None:
            return
        # SIGTERM: the relay stops taking requests, then forwards everything it acknowledged (--forward-on-exit), so
        # an update of its group does not wait in its data dir for this worker's return.
        self._proc.terminate()
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
