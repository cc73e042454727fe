#!/usr/bin/env python3
"""Transport benchmark: a 1 GiB full-parameter expert pushed and pulled through a real coordinator.

The coordinator runs as users start it (``run_coordinator.py``: one process, a
separate OS process from this one), its data dir in RAM when there is one (durability's fsync
is not what this measures). Every figure is a ratio to a baseline measured in the same run:

- ``pull_vs_socket`` / ``push_vs_socket``: the time to send the same number of bytes over a raw
  loopback TCP socket (sendall into recv_into a preallocated buffer) over the time of
  ``client.experts.pull`` (body into tensors) / ``client.updates.push`` (202 once the update is
  received, hashed, checked and durable; aggregation is deferred with fedbuff). Best of N each.
- ``speedup_vs_base64_json``: the original tool's way, every tensor base64-encoded inside a JSON
  body, decoded by a Flask endpoint, in GB/s, against the push rate. (Measured on a quarter of the
  payload: at 1 GiB its copies alone would need ~8 GiB of RAM.)
- ``rss_growth_per_model_size``: the coordinator process's peak RSS (sampled every 5 ms, and its
  VmHWM) during 8 concurrent pulls of the expert, minus its idle RSS, over the expert's size.

    python -m bench.transport              # 1 GiB, about a minute
    python -m bench.transport --size-mb 16 --repeats 1   # smoke test
    python -m bench.transport --push-only --repeats 3     # pushes only, with CPU per push (A/B: bench.transport_ab)

``--push-only`` also reports, per push, the coordinator's CPU seconds (user+sys of its process, from /proc), the
client's CPU seconds and the load average. ``FEDMOE_BENCH_CLIENT_ROOT`` puts another checkout's ``protocol``
package (the client) first on the import path, as ``FEDMOE_BENCH_SERVER_ROOT`` picks the coordinator's checkout:
an A/B of a change on both ends in one window.

Table on stdout, progress on stderr, results in bench/results/transport.json.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("FEDMOE_BENCH_CLIENT_ROOT"):  # before anything imports protocol (an A/B of the client too)
    sys.path.insert(0, os.environ["FEDMOE_BENCH_CLIENT_ROOT"])

import base64  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from flask import Flask, jsonify, request  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

from bench.common import SCRATCH_DIR, coordinator_process, format_table  # noqa: E402
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.client import CoordinatorClient  # noqa: E402
from protocol.credentials import local_token  # noqa: E402
from protocol.integrity import new_hasher  # noqa: E402
from protocol.tensors import dumps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.transport")
MiB = 1 << 20
TARGETS = {"pull_vs_socket": 0.5, "push_vs_socket": 0.5, "rss_growth_per_model_size": 1.5}
FINGERPRINT = "fe" * 32
TIMELINE = ("open_seconds", "chunk_seconds", "complete_seconds")
"""A resumable push's phases (protocol.uploads.UploadStats; None from a client before them)."""


def expert_tensors(size_mb: int) -> dict[str, torch.Tensor]:
    """``size_mb`` MiB of float32 in 16 tensors, like the layers of a model."""
    per = size_mb * MiB // 4 // 16
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.weight": torch.randn(per, generator=g) * 0.02 for i in range(16)}


def best(times: Sequence[float]) -> float:
    return min(times)


# baselines ------------------------------------------------------------------

def socket_copy_seconds(payload: memoryview) -> float:
    """Loopback TCP: sendall the payload into a preallocated buffer on another thread."""
    server = socket.create_server(("127.0.0.1", 0))
    received = bytearray(len(payload))

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(received), 0
        with conn:
            while got < len(received):
                got += conn.recv_into(view[got:got + 4 * MiB])
            conn.sendall(b"k")

    thread = threading.Thread(target=receive)
    thread.start()
    started = time.perf_counter()
    with socket.create_connection(server.getsockname()) as sock:
        sock.sendall(payload)
        sock.recv(1)
    seconds = time.perf_counter() - started
    thread.join()
    server.close()
    return seconds


def write_seconds(payload: memoryview, path: Path) -> float:
    """Write the payload to a new file in 8 MiB pieces and fsync it (the coordinator's one write of a body)."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        for start in range(0, len(payload), 8 * MiB):
            f.write(payload[start:start + 8 * MiB])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def norm_pass_seconds(path: Path) -> float:
    """Read a file back and take the L2 norm of its float32s (the coordinator's check + norm pass,
    coordinator/checks/fused_check.py raw_update_norm, without the header)."""
    started, squares, chunk = time.perf_counter(), 0.0, bytearray(8 * MiB)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            squares += float(torch.linalg.vector_norm(torch.frombuffer(chunk, dtype=torch.float32, count=n // 4))) ** 2
    return time.perf_counter() - started


def hash_seconds(payload: memoryview) -> float:
    started = time.perf_counter()
    new_hasher("blake3", len(payload)).update(payload)
    return time.perf_counter() - started


def pipeline_seconds(payload: memoryview, path: Path) -> float:
    """The least a durable, digest-checked push does, in one process with nothing else: hash the body (the client,
    before it announces the digest), send it over a raw loopback socket to a thread that writes each 8 MiB piece
    to ``path`` while another thread hashes it (the two overlap each other and the next receive), fsync, then read it
    back once for the check and norm. No HTTP, no chunks, no commit, no Python per request."""
    server = socket.create_server(("127.0.0.1", 0))
    piece = 8 * MiB
    buffers = [bytearray(piece), bytearray(piece)]

    def receive() -> None:
        conn, _ = server.accept()
        hasher = new_hasher("blake3", len(payload))
        with conn, open(path, "wb") as out, ThreadPoolExecutor(2) as pool:
            got, turn = 0, 0
            pending: list[Future[Any]] = []
            while got < len(payload):
                view = memoryview(buffers[turn])[:min(piece, len(payload) - got)]
                filled = 0
                while filled < len(view):
                    filled += conn.recv_into(view[filled:])
                for job in pending:  # the other buffer is free once its write and hash are done
                    job.result()
                pending = [pool.submit(out.write, view), pool.submit(hasher.update, view)]
                got, turn = got + len(view), turn ^ 1
            for job in pending:
                job.result()
            out.flush()
            os.fsync(out.fileno())
            conn.sendall(b"k")

    thread = threading.Thread(target=receive)
    thread.start()
    started = time.perf_counter()
    new_hasher("blake3", len(payload)).update(payload)
    with socket.create_connection(server.getsockname()) as sock:
        sock.sendall(payload)
        sock.recv(1)
    thread.join()
    norm_pass_seconds(path)
    seconds = time.perf_counter() - started
    server.close()
    return seconds


def floor_figures(payload: memoryview, scratch: Path) -> dict[str, float]:
    """Each stage a push cannot avoid, measured on its own (wall and this process's CPU), and ``pipeline_seconds``
    (all of them overlapped as well as two threads per end allow), with the socket copy they are compared to.

    ``cpu_floor_seconds``: the CPU the stages need (the body hashed on both ends, the socket copy's two ends, one
    write, one read for the norm) spread over two perfectly busy cores: no push on this machine can be faster.
    One file in ``scratch``, removed."""
    path = scratch / "floor.bin"
    figures: dict[str, float] = {}

    def stage(name: str, action: Callable[[], float]) -> None:
        cpu = own_cpu_seconds()
        figures[f"{name}_seconds"] = action()
        figures[f"{name}_cpu_seconds"] = own_cpu_seconds() - cpu

    try:
        stage("socket", lambda: socket_copy_seconds(payload))
        stage("hash", lambda: hash_seconds(payload))
        stage("write", lambda: write_seconds(payload, path))
        stage("norm_pass", lambda: norm_pass_seconds(path))
        path.unlink()
        stage("pipeline", lambda: pipeline_seconds(payload, path))
    finally:
        path.unlink(missing_ok=True)
    needed = figures["socket_cpu_seconds"] + 2 * figures["hash_cpu_seconds"] + figures["write_cpu_seconds"] + \
        figures["norm_pass_cpu_seconds"]
    figures["cpu_floor_seconds"] = needed / min(2, os.cpu_count() or 1)
    figures["cpu_floor_vs_socket"] = figures["socket_seconds"] / figures["cpu_floor_seconds"]
    figures["pipeline_vs_socket"] = figures["socket_seconds"] / figures["pipeline_seconds"]
    return figures


def base64_json_seconds(tensors: dict[str, torch.Tensor]) -> float:
    """The original tool's transport: JSON with base64 tensors, POSTed to a Flask endpoint that decodes it."""
    app = Flask("base64_json")

    @app.post("/update")
    def update() -> Any:
        body = request.get_json()
        decoded = {k: np.frombuffer(base64.b64decode(v["data"]), dtype=np.float32).reshape(v["shape"])
                   for k, v in body["weights"].items()}
        return jsonify({"tensors": len(decoded)})

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.perf_counter()
        body: dict[str, Any] = {"weights": {k: {"shape": list(t.shape),
                                                "data": base64.b64encode(t.numpy().tobytes()).decode()}
                                            for k, t in tensors.items()}}
        r = requests.post(f"http://127.0.0.1:{server.port}/update", json=body, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - started
    finally:
        server.shutdown()


# the coordinator ----------------------------------------------------------------

def serving_pid(master: int) -> int:
    """The serving process: the only child of a forking server (gunicorn before issue 13), else the process itself."""
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return int(children[0]) if children else master


def status_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise RuntimeError(f"/proc/{pid}/status has no {field} line")
    return int(match.group(1))


def peak_rss_during(pid: int, action: Callable[[], None]) -> tuple[int, int, int]:
    """(idle VmRSS, peak sampled VmRSS, VmHWM after) in bytes around ``action``."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    idle = status_kib(pid, "VmRSS")
    peak, done = idle, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, status_kib(pid, "VmRSS"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return idle * 1024, peak * 1024, status_kib(pid, "VmHWM") * 1024


def concurrent_pulls(url: str, name: str, n: int, size: int) -> Callable[[], None]:
    """n simultaneous full pulls, each read through a small buffer (the client's RAM is not measured)."""
    def pull() -> None:
        with requests.get(f"{url}/api/v1/experts/{name}/weights", stream=True, timeout=600,
                          headers={"Authorization": f"Bearer {local_token(url)}"}) as r:
            r.raise_for_status()
            got = sum(len(chunk) for chunk in r.iter_content(4 * MiB))
        if got != size:
            raise RuntimeError(f"pulled {got} bytes, expected {size}")

    def run() -> None:
        threads = [threading.Thread(target=pull) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def cpu_seconds(pid: int) -> float:
    """user + sys CPU seconds of a process, all its threads (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_idle(pid: int, limit: float = 120.0) -> float:
    """Wait until the process used under 5% of a core for half a second (the gateway build that creating a 1 GiB
    expert starts takes seconds; pushes measured during it would pay for it); the seconds waited."""
    started = time.perf_counter()
    before = cpu_seconds(pid)
    while time.perf_counter() - started < limit:
        time.sleep(0.5)
        now = cpu_seconds(pid)
        if now - before < 0.025:
            break
        before = now
    return time.perf_counter() - started


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, to the nanosecond: os.times() counts 10 ms clock ticks, so a
    floor stage of an 8 MiB body (a few ms each) read 0 and cpu_floor_vs_socket divided by zero."""
    return time.process_time()


# the benchmark ------------------------------------------------------------------

def measure_pushes(size_mb: int, repeats: int, floor: bool = False) -> dict[str, Any]:
    """Only the push: per repeat a socket copy, then one push; wall, the coordinator's and the client's CPU.
    ``floor``: per repeat also ``floor_figures`` (after the push, the coordinator idle)."""
    tensors = expert_tensors(size_mb)
    body = dumps(tensors)
    nbytes = len(body)
    spec = {"kind": "full", "full": {"num_parameters": sum(t.numel() for t in tensors.values())},
            "base_model": {"id": "bench", "fingerprint": FINGERPRINT}}
    runs: list[dict[str, Any]] = []  # figures, the chunk count, None for a phase a push had not, the floor's dict
    with tempfile.TemporaryDirectory(dir=SCRATCH_DIR) as scratch, \
            coordinator_process(Path(scratch) / "data", "--aggregation", "fedbuff", "--buffer-size", "1000",
                                "--max-body-mb", str(2 * size_mb + 64)) as coordinator:
        pid = serving_pid(coordinator.pid)
        client = CoordinatorClient(coordinator.url, timeout=(5.0, 600.0))
        client.experts.create("big", tensors, spec)
        del tensors
        log.info("expert created; the coordinator was idle after %.1f s more", wait_until_idle(pid))
        pause = float(os.environ.get("FEDMOE_BENCH_PROFILE_PAUSE") or 0)
        if pause:  # time to attach a profiler once the expert's creation (and its gateway build) is over
            log.info("expert created; pushes start in %.0f s (coordinator pid %d)", pause, pid)
            time.sleep(pause)
        for _ in range(repeats):
            socket_s = socket_copy_seconds(memoryview(body))
            meta = {"update_id": uuid.uuid4().hex, "base_version": 0, "num_samples": 1}
            server_cpu, client_cpu, started = cpu_seconds(pid), own_cpu_seconds(), time.perf_counter()
            client.updates.push("big", body, meta)
            wall = time.perf_counter() - started
            client_cpu, answered_cpu = own_cpu_seconds() - client_cpu, cpu_seconds(pid) - server_cpu
            wait_until_idle(pid)  # work the push left behind after its answer (none expected) counts for it
            run: dict[str, Any] = {
                "socket_seconds": socket_s, "push_seconds": wall, "push_vs_socket": socket_s / wall,
                "coordinator_cpu_seconds": cpu_seconds(pid) - server_cpu, "coordinator_cpu_at_answer": answered_cpu,
                "client_cpu_seconds": client_cpu, "load_average": os.getloadavg()[0]}
            stats = client.updates.last_upload  # where the push's time went (None: it went in one request)
            if stats is not None:
                run |= {"chunks": stats.chunks, **{k: getattr(stats, k, None) for k in TIMELINE}}
            log.info("push %.3f s (socket %.3f s: %.3f), coordinator CPU %.2f s, client CPU %.2f s, load %.1f",
                     wall, socket_s, run["push_vs_socket"], run["coordinator_cpu_seconds"],
                     run["client_cpu_seconds"], run["load_average"])
            if floor:
                run["floor"] = floor_figures(memoryview(body), Path(scratch))
                log.info("floor: %s", ", ".join(f"{k} {v:.3f}" for k, v in run["floor"].items()))
            runs.append(run)
    best_push, best_socket = min(r["push_seconds"] for r in runs), min(r["socket_seconds"] for r in runs)
    return {"size_bytes": nbytes, "repeats": repeats, "runs": runs, "push_seconds": best_push,
            "socket_seconds": best_socket, "push_vs_socket": best_socket / best_push,
            "coordinator_cpu_per_push": sum(r["coordinator_cpu_seconds"] for r in runs) / len(runs),
            "client_cpu_per_push": sum(r["client_cpu_seconds"] for r in runs) / len(runs),
            "server_root": os.environ.get("FEDMOE_BENCH_SERVER_ROOT") or str(ROOT),
            "client_root": os.environ.get("FEDMOE_BENCH_CLIENT_ROOT") or str(ROOT), "data_dir": SCRATCH_DIR or "tmp"}


def render_pushes(r: dict[str, Any]) -> str:
    def phase(run: dict[str, Any], key: str) -> str:
        return "-" if run.get(key) is None else f"{run[key]:.3f}"

    rows = [(i + 1, run["socket_seconds"], run["push_seconds"], run["push_vs_socket"], run["coordinator_cpu_seconds"],
             run["client_cpu_seconds"], run["load_average"], str(run.get("chunks", "-")),
             *(phase(run, k) for k in TIMELINE)) for i, run in enumerate(r["runs"])]
    table = format_table(("push", "socket s", "push s", "vs socket", "coordinator CPU s", "client CPU s", "load",
                          "chunks", "digest+open s", "chunks s", "complete s"), rows, align="rrrrrrrrrrr")
    lines = [f"{r['size_bytes'] / MiB:.0f} MiB pushes (server {r['server_root']}, client {r['client_root']})",
             "", table, "", f"best push vs best socket: {r['push_vs_socket']:.3f}"]
    floors = [run["floor"] for run in r["runs"] if "floor" in run]
    if floors:
        stages = ("socket", "hash", "write", "norm_pass", "pipeline")
        rows = [(i + 1, *(f"{f[f'{k}_seconds']:.3f} / {f[f'{k}_cpu_seconds']:.2f}" for k in stages),
                 f["pipeline_vs_socket"], f["cpu_floor_seconds"], f["cpu_floor_vs_socket"]) for i, f in enumerate(floors)]
        lines += ["", "floor: each stage alone, wall s / CPU s (pipeline: all overlapped, raw socket, no HTTP; CPU floor: "
                  "the stages' CPU over two cores)", "",
                  format_table(("run", *stages, "pipeline vs socket", "CPU floor s", "CPU floor vs socket"), rows,
                               align="rrrrrrrrr")]
    return "\n".join(lines)


def measure(size_mb: int, repeats: int, concurrency: int) -> dict[str, Any]:
    tensors = expert_tensors(size_mb)
    body = dumps(tensors)
    nbytes = len(body)
    spec = {"kind": "full", "full": {"num_parameters": sum(t.numel() for t in tensors.values())},
            "base_model": {"id": "bench", "fingerprint": FINGERPRINT}}
    with tempfile.TemporaryDirectory(dir=SCRATCH_DIR) as scratch, \
            coordinator_process(Path(scratch) / "data", "--aggregation", "fedbuff", "--buffer-size", "1000",
                                "--max-body-mb", str(2 * size_mb + 64)) as coordinator:
        url, pid = coordinator.url, serving_pid(coordinator.pid)
        client = CoordinatorClient(url, timeout=(5.0, 600.0))
        client.experts.create("big", tensors, spec)
        del tensors
        sockets, pulls, pushes = [], [], []
        for _ in range(repeats):  # interleaved, so that a change in the machine's load hits all three
            sockets.append(socket_copy_seconds(memoryview(body)))
            started = time.perf_counter()
            pulled = client.experts.pull("big")
            pulls.append(time.perf_counter() - started)
            assert pulled.nbytes == nbytes
            del pulled
            meta = {"update_id": uuid.uuid4().hex, "base_version": 0, "num_samples": 1}
            started = time.perf_counter()
            client.updates.push("big", body, meta)
            pushes.append(time.perf_counter() - started)
        socket_s = best(sockets)
        log.info("socket %.3f s, pull %.3f s, push %.3f s (best of %d)", socket_s, best(pulls), best(pushes),
                 repeats)
        idle, peak, hwm = peak_rss_during(pid, concurrent_pulls(url, "big", concurrency, nbytes))
        log.info("coordinator RSS idle %d MiB, peak %d MiB (VmHWM %d MiB) during %d pulls",
                 idle // MiB, peak // MiB, hwm // MiB, concurrency)
    del body
    small = expert_tensors(max(1, size_mb // 4))
    small_bytes = sum(t.numel() * 4 for t in small.values())
    base64_s = base64_json_seconds(small)
    log.info("base64 JSON: %.3f s for %d MiB", base64_s, small_bytes // MiB)
    push_gbps, base64_gbps = nbytes / best(pushes) / 1e9, small_bytes / base64_s / 1e9
    return {
        "size_bytes": nbytes, "repeats": repeats, "concurrent_pulls": concurrency,
        "socket_seconds": socket_s, "pull_seconds": best(pulls), "push_seconds": best(pushes),
        "socket_runs": sockets, "pull_runs": pulls, "push_runs": pushes,
        "socket_gbps": nbytes / socket_s / 1e9, "pull_gbps": nbytes / best(pulls) / 1e9, "push_gbps": push_gbps,
        "pull_vs_socket": socket_s / best(pulls), "push_vs_socket": socket_s / best(pushes),
        "base64_json_bytes": small_bytes, "base64_json_seconds": base64_s, "base64_json_gbps": base64_gbps,
        "speedup_vs_base64_json": push_gbps / base64_gbps,
        "rss_idle_bytes": idle, "rss_peak_bytes": max(peak, hwm), "rss_peak_sampled_bytes": peak,
        "rss_vmhwm_bytes": hwm, "rss_growth_per_model_size": (max(peak, hwm) - idle) / nbytes,
        "server": "buffering asyncio front (coordinator/http/front.py), 16 request threads, sendfile", "data_dir": SCRATCH_DIR or "tmp",
        "push_aggregation": "deferred (fedbuff, buffer 1000)", "targets": TARGETS,
    }


def render(r: dict[str, Any]) -> str:
    rows = [
        ("raw loopback socket", r["socket_gbps"], 1.0, "-"),
        ("pull (coordinator -> tensors)", r["pull_gbps"], r["pull_vs_socket"], f">= {TARGETS['pull_vs_socket']}"),
        ("push (bytes -> durable 202)", r["push_gbps"], r["push_vs_socket"], f">= {TARGETS['push_vs_socket']}"),
        ("base64 inside JSON (original)", r["base64_json_gbps"], r["base64_json_gbps"] * 1e9 * r["socket_seconds"]
         / r["size_bytes"], "-"),
    ]
    table = format_table(("transfer", "GB/s", "vs socket", "target"), rows, align="lrrl")
    return "\n".join([
        f"transport of a {r['size_bytes'] / MiB:.0f} MiB expert ({r['server']})", "", table, "",
        f"push is {r['speedup_vs_base64_json']:.1f}x faster than base64 inside JSON",
        f"coordinator RSS during {r['concurrent_pulls']} concurrent pulls: idle {r['rss_idle_bytes'] / MiB:.0f} MiB, "
        f"peak {r['rss_peak_bytes'] / MiB:.0f} MiB: growth {r['rss_growth_per_model_size']:.3f} x model size "
        f"(target <= {TARGETS['rss_growth_per_model_size']})",
    ])


@dataclass(frozen=True)
class Settings:
    size_mb: int = option(1024, "expert size in MiB")
    repeats: int = option(3, "timed pulls, pushes and socket copies (best of)")
    concurrency: int = option(8, "simultaneous pulls for the RSS figure")
    push_only: bool = option(False, "pushes only, with the coordinator's and the client's CPU per push (no pulls, "
                             "RSS or base64 figures)")
    floor: bool = option(False, "with --push-only: also each unavoidable stage on its own and a minimal durable, "
                         "digest-checked push over a raw socket (the floor), per push")

    def __post_init__(self) -> None:
        if min(self.size_mb, self.repeats, self.concurrency) < 1:
            raise ValueError("--size-mb, --repeats and --concurrency must be at least 1")


def run(s: Settings, ctx: Run) -> int:
    if s.push_only:
        result = measure_pushes(s.size_mb, s.repeats, s.floor)
    else:
        result = measure(s.size_mb, s.repeats, s.concurrency)
    result["seconds"] = ctx.seconds()
    ctx.write(result)
    print(render_pushes(result) if s.push_only else render(result))
    log.info("wrote %s in %.0f s", ctx.out, result["seconds"])
    return 0


BENCH = Bench("transport", tags=("performance",), settings=Settings, run=run, quick={"size_mb": 64, "repeats": 1})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
