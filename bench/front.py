#!/usr/bin/env python3
"""Front benchmark: the coordinator's HTTP front alone (coordinator/http/front.py), receiving large pushes.

A ``BufferingFront`` serves a trivial app (it answers with the spooled body's digest) in a process of its
own, spool dir on disk, as the coordinator runs it; client threads in this process push the same body
over ``--connections`` keep-alive connections. Per request: the server's CPU (user + system, from
/proc), the CPU of its event-loop thread (the process's main thread) and the context switches of all its
threads. With ``--server-root`` the front of another checkout runs too, alternately, so the ratios come
from one window (docs/history/scale.md, sixth round).

    python -m bench.front                                  # 100 connections x 6 pushes of 4.7 MB, 3 runs
    python -m bench.front --server-root /work/main         # A/B against another checkout
    python -m bench.front --connections 2 --requests 2 --runs 1 --size-mb 2   # smoke test

Table on stdout, results in bench/results/front.json.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, format_table
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.integrity import content_id, new_hasher

SERVER = r"""
import json, socket, sys
from dataclasses import dataclass
from pathlib import Path
try:  # in coordinator/http/ since issue 31; before, all in coordinator/front.py (an A/B against an older checkout)
    from coordinator.http.front import BufferingFront
    from coordinator.http.options import FrontOptions
    from coordinator.http.wsgi import SPOOLED_BODY
except ImportError:
    from coordinator.front import SPOOLED_BODY, BufferingFront, FrontOptions

def app(environ, start_response):
    spooled = environ.get(SPOOLED_BODY)
    answer = json.dumps({"digest": spooled.digest if spooled is not None else None}).encode()
    start_response("202 Accepted", [("Content-Type", "application/json")])
    return [answer]

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(1024)
Path(sys.argv[1]).write_text(str(sock.getsockname()[1]))
BufferingFront(app, sock, FrontOptions(threads=16, spool_dir=Path(sys.argv[1]).parent)).run()
"""


def thread_stats(pid: int) -> tuple[float, float, int]:
    """(process CPU s, main thread CPU s, context switches of all threads) of a live process."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            switches += sum(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                            if "ctxt_switches" in line)
        except OSError:
            pass  # a thread that ended meanwhile
    return cpu(Path(f"/proc/{pid}/stat")), cpu(Path(f"/proc/{pid}/task/{pid}/stat")), switches


def push_all(port: int, body: bytes, digest: str, connections: int, requests: int) -> list[str]:
    """Each connection pushes ``body`` ``requests`` times; the digests the server answered, wrong ones kept."""
    head = (f"POST /x HTTP/1.1\r\nHost: bench\r\nContent-Length: {len(body)}\r\n"
            f"X-FedMoE-Digest: blake3={digest[3:]}\r\n\r\n").encode()
    answers: list[str] = []

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s, s.makefile("rb") as f:
            for _ in range(requests):
                s.sendall(head)
                s.sendall(body)
                status = f.readline()
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                text = f.read(length).decode()
                answers.append(text if status.startswith(b"HTTP/1.1 202") else status.decode() + text)

    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def measure(root: Path, body: bytes, digest: str, connections: int, requests: int) -> dict[str, Any]:
    """One run against the front of checkout ``root``."""
    with tempfile.TemporaryDirectory(prefix="fedmoe-front-") as directory:
        port_file = Path(directory) / "port"
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port_file)], cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)})
        try:
            while not (port_file.exists() and port_file.read_text()):
                if proc.poll() is not None:
                    raise RuntimeError(f"the front of {root} exited before listening")
                time.sleep(0.02)
            cpu0, loop0, switches0 = thread_stats(proc.pid)
            started = time.perf_counter()
            answers = push_all(int(port_file.read_text()), body, digest, connections, requests)
            seconds = time.perf_counter() - started
            cpu1, loop1, switches1 = thread_stats(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    n = len(answers)
    wrong = [a for a in answers if digest not in a]
    return {"root": str(root), "requests": n, "wrong_answers": wrong[:5], "requests_per_s": round(n / seconds, 1),
            "cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / n, 2),
            "loop_cpu_ms_per_request": round(1000 * (loop1 - loop0) / n, 2),
            "context_switches_per_request": round((switches1 - switches0) / n, 1),
            "load_average": os.getloadavg()[0]}


@dataclass(frozen=True)
class Settings:
    connections: int = option(100, "keep-alive client connections")
    requests: int = option(6, "pushes per connection per run")
    size_mb: float = option(4.675401, "body size in MB (default: a Qwen2-0.5B int8 update)")
    runs: int = option(3, "runs per front, alternated")
    server_root: Path | None = option(None, "another checkout whose front runs too (A/B)", type=Path)

    def __post_init__(self) -> None:
        if min(self.connections, self.requests, self.runs) < 1 or not self.size_mb > 0:
            raise ValueError("--connections, --requests, --runs and --size-mb must be positive")
        if self.server_root is not None and not any((self.server_root / "coordinator" / where).is_file()
                                                    for where in ("http/front.py", "front.py")):
            raise ValueError(f"--server-root {self.server_root}: no coordinator/http/front.py (or "
                             "coordinator/front.py) there")


def run(s: Settings, ctx: Run) -> int:
    body = os.urandom(int(s.size_mb * 1e6))
    hasher = new_hasher("blake3", len(body))
    hasher.update(body)
    digest = content_id("blake3", hasher.hexdigest())
    roots = [ROOT] + ([s.server_root.resolve()] if s.server_root else [])
    runs = [measure(root, body, digest, s.connections, s.requests) for _ in range(s.runs) for root in roots]
    means = {str(root): {k: round(statistics.mean(r[k] for r in runs if r["root"] == str(root)), 2)
                         for k in ("requests_per_s", "cpu_ms_per_request", "loop_cpu_ms_per_request",
                                   "context_switches_per_request")} for root in roots}
    report: dict[str, Any] = {"body_bytes": len(body), "runs": runs, "means": means}
    if s.server_root:
        this, other = means[str(roots[0])], means[str(roots[1])]
        report["ratios_this_over_other"] = {k: round(this[k] / other[k], 3) for k in this if other[k]}
    ctx.write(report)
    print(format_table(["front", "runs", "requests", "req/s", "CPU ms/req", "loop CPU ms/req", "switches/req"],
                       [[root, s.runs, s.runs * s.connections * s.requests, m["requests_per_s"],
                         m["cpu_ms_per_request"], m["loop_cpu_ms_per_request"], m["context_switches_per_request"]]
                        for root, m in means.items()]))
    wrong = [a for r in runs for a in r["wrong_answers"]]
    for answer in wrong:
        print("ERROR: answer without the body's digest:", answer[:200])
    return 1 if wrong else 0


BENCH = Bench("front", tags=("http", "a-b"), settings=Settings, run=run,
              quick={"connections": 20, "requests": 2, "runs": 1}, torch_threads=None)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
