"""The load generator of bench.load and bench.scale: its own process, pre-encoded bodies, raw HTTP/1.1.

Why not the workers' client in threads of the benchmark process (bench.load before issue 18):
requests' per-push overhead, the digest and the encoding ran on the same two cores as the
coordinator, so the benchmark measured itself. Here a spawned process owns the load: bodies are
encoded once into a small pool before the clock starts, and each push copies one (a memcpy) and
stamps a counter into its last int8 codes (so every push is a distinct, valid body with its own
blob, as in real life), hashes it (BLAKE3, what the client sends) and writes it on a socket from
one asyncio loop. Worker tokens come from real registrations.

Two modes:
- closed: ``connections`` simulated workers each push ``rounds`` updates back to back on a kept-alive
  connection (throughput: as fast as the coordinator takes them).
- open: ``workers`` simulated workers each push every ``interval`` seconds from a random phase,
  whether or not the coordinator kept up, until ``pushes`` have been sent; latency counts from the
  scheduled moment, so a coordinator that falls behind shows it (no coordinated omission).

A 503/429 or a dropped connection is retried with the same update_id (as workers do); the latency
then includes the retries, and the result says how many there were.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from protocol.integrity import DIGEST_HEADER, new_hasher
from protocol.schemas import API_PREFIX, UPDATE_HEADER

MAX_ATTEMPTS = 8


@dataclass(frozen=True)
class LoadPlan:
    urls: list[str]
    """Coordinators to spread the load over (round robin by worker): one, or each replica."""
    admin_token: str
    experts: list[str]
    model: str
    rank: int
    codec: str
    mode: str = "closed"
    workers: int = 100
    rounds: int = 2
    """closed mode: pushes per worker."""
    interval: float = 30.0
    """open mode: seconds between one worker's pushes."""
    pushes: int = 1000
    """open mode: pushes in all."""
    pool: int = 8
    """distinct encoded bodies the pushes are stamped from."""
    seed: int = 0
    fingerprint: str = "10ad" * 16
    digest: str = "blake3"
    """Body digest algorithm: sha256 for a coordinator before 0.7 (the A/B baseline)."""


@dataclass
class PushResult:
    update_id: str
    expert: str
    num_samples: int
    seconds: float
    status: str  # "accepted" (202), "duplicate" (200), or the last error
    attempts: int = 1


@dataclass
class LoadReport:
    results: list[PushResult] = field(default_factory=list)
    seconds: float = 0.0
    body_bytes: int = 0
    encode_seconds: float = 0.0
    late_starts: int = 0
    """open mode: pushes sent more than 1 s after their scheduled moment (the generator fell behind)."""
    cpu_seconds: float = 0.0
    """The generator's own CPU (user + system, all its threads) while it pushed: what the load cost the machine."""


def encode_pool(plan: LoadPlan) -> list[bytes]:
    import torch

    from bench.shapes import lora_manifest, random_tensors
    from compression import make_codec
    from compression.wire import encode_update

    torch.set_num_threads(1)
    manifest = lora_manifest(plan.model, plan.rank)
    codec = make_codec(plan.codec, {})
    rng = random.Random(plan.seed)
    return [encode_update(random_tensors(manifest, rng.randrange(2**31), 1e-3), manifest, codec, seed=i + 1)
            for i in range(plan.pool)]


STAMP_BYTES = 4


def stamped(body: bytes, counter: int, codec: str) -> bytes:
    """A distinct valid body: the last four int8 codes (of the last tensor) carry ``counter`` in base 100.
    Other codecs' bodies are sent as they are (pushes then share blobs: say so when reporting)."""
    if codec != "int8":
        return body
    return body[:-STAMP_BYTES] + _stamp(counter)


def _stamp(counter: int) -> bytes:
    return bytes((counter // 100 ** i) % 100 for i in reversed(range(STAMP_BYTES)))  # 0..99: valid int8 codes


class PoolBody:
    """One pre-encoded body, sent as ``stamped`` would make it without copying it: the part before the stamp
    goes out as a view of the pool's bytes, and its digest state is computed once and copied per push. A copy
    of the 4.7 MB body and a hash of all of it per push were ~6.5 ms of the generator's CPU (on the two cores
    the coordinator runs on)."""

    def __init__(self, body: bytes, codec: str, algorithm: str) -> None:
        self.stamps = codec == "int8"
        cut = len(body) - STAMP_BYTES if self.stamps else len(body)
        self.head, self.tail, self.size = memoryview(body)[:cut], body[cut:], len(body)
        self.algorithm = algorithm
        self._hashed = new_hasher(algorithm, len(body))
        self._hashed.update(self.head)

    def parts(self, counter: int) -> tuple[list[bytes | memoryview], str]:
        """(the body's pieces in order, its digest header value) for push number ``counter``."""
        tail = _stamp(counter) if self.stamps else self.tail
        hasher = self._hashed.copy()
        hasher.update(tail)
        return [self.head, tail], f"{self.algorithm}={hasher.hexdigest()}"


class Http:
    """One kept-alive HTTP/1.1 connection to a coordinator."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, headers: dict[str, str],
                      body: bytes | list[bytes | memoryview] = b"") -> tuple[int, dict, bytes]:
        """One exchange; ``body`` may come in pieces (written in order, none copied here)."""
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        reader, writer = self.reader, self.writer
        parts = body if isinstance(body, list) else [body]
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {sum(len(p) for p in parts)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        try:
            writer.write(head.encode("latin-1"))
            for part in parts:
                writer.write(part)
            await writer.drain()
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            answer = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            data = await reader.readexactly(int(answer.get("content-length", "0")))
        except BaseException:
            self.close()
            raise
        if answer.get("connection", "").lower() == "close":
            self.close()
        return status, answer, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Generator:
    def __init__(self, plan: LoadPlan, pool: list[bytes]) -> None:
        self.plan, self.pool = plan, [PoolBody(body, plan.codec, plan.digest) for body in pool]
        self.report = LoadReport()
        self.tokens: dict[int, str] = {}
        self.versions: dict[int, int] = {}
        self.counter = 0

    def url(self, worker: int) -> str:
        return self.plan.urls[worker % len(self.plan.urls)]

    def expert(self, worker: int) -> str:
        return self.plan.experts[worker % len(self.plan.experts)]

    async def register_all(self) -> None:
        """Register every simulated worker (20 at a time), keeping its token and the expert's version."""
        limit = asyncio.Semaphore(20)

        async def one(i: int) -> None:
            async with limit:
                http = Http(self.url(i))
                body = json.dumps({"worker_id": f"load-worker-{i}", "specialty": self.expert(i),
                                   "base_model": {"id": self.plan.model, "fingerprint": self.plan.fingerprint},
                                   "sync_interval": self.plan.interval}).encode()
                status, _, data = await http.request("POST", f"{API_PREFIX}/workers", {
                    "Authorization": f"Bearer {self.plan.admin_token}", "Content-Type": "application/json"}, body)
                http.close()
                if status != 200:
                    raise RuntimeError(f"registering worker {i}: HTTP {status} {data[:200]!r}")
                info = json.loads(data)
                self.tokens[i] = info.get("token") or self.plan.admin_token
                self.versions[i] = info["expert"]["version"]

        await asyncio.gather(*(one(i) for i in range(self.plan.workers)))

    async def push(self, http: Http, worker: int, n: int, scheduled: float) -> None:
        self.counter += 1
        pooled = self.pool[(worker + n) % len(self.pool)]
        body, digest = pooled.parts(self.counter)
        update_id, num_samples = f"load-worker-{worker}:{n}", 1 + (worker * 7 + n) % 50
        meta = {"update_id": update_id, "base_version": self.versions[worker],
                "num_samples": num_samples, "codec": self.plan.codec, "codec_config": {},
                "worker_id": f"load-worker-{worker}", "train_loss": 1.0}
        headers = {"Authorization": f"Bearer {self.tokens[worker]}", UPDATE_HEADER: json.dumps(meta),
                   "Content-Type": "application/octet-stream", DIGEST_HEADER: digest}
        status, attempts = "not sent", 0
        while attempts < MAX_ATTEMPTS:
            attempts += 1
            try:
                code, answer, data = await http.request("POST", f"{API_PREFIX}/experts/{self.expert(worker)}/updates",
                                                        headers, body)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                status = f"connection: {exc.__class__.__name__}"
                await asyncio.sleep(min(2.0, 0.1 * 2 ** attempts))
                continue
            if code in (200, 202):
                status = "accepted" if code == 202 else "duplicate"
                self.versions[worker] = max(self.versions[worker], json.loads(data).get("expert_version", 0))
                break
            status = f"HTTP {code}: {data[:200].decode('utf-8', 'replace')}"
            if code not in (429, 503):
                break
            await asyncio.sleep(min(5.0, float(answer.get("retry-after", "1") or 1)))
        self.report.body_bytes += pooled.size
        self.report.results.append(PushResult(update_id, self.expert(worker), num_samples,
                                              time.perf_counter() - scheduled, status, attempts))

    async def closed(self) -> None:
        async def worker(i: int) -> None:
            http = Http(self.url(i))
            for n in range(self.plan.rounds):
                await self.push(http, i, n, time.perf_counter())
            http.close()

        await asyncio.gather(*(worker(i) for i in range(self.plan.workers)))

    async def open(self) -> None:
        rng = random.Random(self.plan.seed + 1)
        plan, start = self.plan, time.perf_counter() + 0.5
        schedule = sorted((start + rng.uniform(0, plan.interval) + k * plan.interval, i, k)
                          for i in range(plan.workers) for k in range(-(-plan.pushes // plan.workers)))[:plan.pushes]
        tasks = []
        for at, i, k in schedule:
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                self.report.late_starts += 1
            tasks.append(asyncio.create_task(self._open_push(i, k, at)))
        await asyncio.gather(*tasks)

    async def _open_push(self, worker: int, n: int, scheduled: float) -> None:
        http = Http(self.url(worker))  # a worker that synced 30 s ago has no connection left open
        try:
            await self.push(http, worker, n, scheduled)
        finally:
            http.close()


def run_load(plan: LoadPlan) -> dict[str, Any]:
    """In the generator process: encode the pool, register, push; a picklable summary of every push."""
    started = time.perf_counter()
    pool = encode_pool(plan)
    gen = Generator(plan, pool)
    gen.report.encode_seconds = time.perf_counter() - started

    async def main() -> None:
        await gen.register_all()
        began, cpu = time.perf_counter(), time.process_time()
        await (gen.open() if plan.mode == "open" else gen.closed())
        gen.report.seconds = time.perf_counter() - began
        gen.report.cpu_seconds = time.process_time() - cpu

    asyncio.run(main())
    report = gen.report
    return {"results": [asdict(r) for r in report.results], "seconds": report.seconds,
            "body_bytes": report.body_bytes, "encode_seconds": report.encode_seconds,
            "late_starts": report.late_starts, "pool_body_bytes": len(pool[0]), "cpu_seconds": report.cpu_seconds}


def run_in_process(plan: LoadPlan) -> dict[str, Any]:
    """``run_load`` in a spawned process (so its CPU is not the benchmark's, and torch starts fresh)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_load, plan).result()
