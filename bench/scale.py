#!/usr/bin/env python3
"""Scale benchmark: coordinator replicas on one real PostgreSQL 15 and one S3-compatible server (moto).

Three measurements, each against a baseline taken in the same run (this machine has 2 cores shared
with other work, so ratios and CPU seconds per push mean more than absolute rates):

1. throughput: the closed-loop load of bench.load (its generator in its own process, pre-encoded
   int8 bodies) spread round-robin over 1 replica, then over 2; pushes/s, p99 latency and the
   coordinators' CPU seconds per push (all replicas together), lost and duplicated checked after.
2. pulls: coordinator bytes sent per weights pull, served by the coordinator vs answered with a
   presigned redirect to the object store (--blobs s3://, X-FedMoE-Accept-Redirect).
3. crashes: ``--crash-rounds`` rounds of kill -9 of a random replica while both take pushes, then its
   restart; at the end every acknowledged update is known, nothing is applied twice (each push
   carries one sample, so samples_seen must equal updates_applied) and every S3 blob matches its id.

    python -m bench.scale                          # ~10 min on a quiet machine
    python -m bench.scale --quick                  # the smoke test: tiny shapes, 2 crash rounds

Table on stdout, progress on stderr, results in bench/results/scale.json. Needs the PostgreSQL 15
server binaries and moto[server] (requirements.txt); says so in one line if either cannot start.
"""
from __future__ import annotations

import logging
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from bench.common import CoordinatorProcess, format_table
from bench.harness import Bench, Run
from bench.load import Pushed, Settings, create_experts, load_plan, process_cpu_seconds, summarise, verify
from bench.loadgen import run_in_process
from bench.servers import s3_env, start_postgres, start_s3
from protocol.cli import option
from protocol.integrity import algorithm_of, hash_bytes
from protocol.schemas import API_PREFIX, REDIRECT_HEADER

log = logging.getLogger("bench.scale")


class Federation:
    """N replicas of run_coordinator.py on one PostgreSQL database and one bucket prefix."""

    def __init__(self, root: Path, pg_url: str, replicas: int, settings: Settings) -> None:
        self.token_file = root / "admin_token"
        self.prefix = f"fedmoe-bench/{uuid.uuid4().hex}"
        flags = ("--manifest", pg_url, "--blobs", f"s3://{self.prefix}", "--admin-token-file", str(self.token_file),
                 "--aggregation", settings.aggregation, "--buffer-size", str(settings.buffer_size),
                 "--threads", str(settings.threads), "--redirect-pulls-mb", "0.01", "--gateway-interval", "3600")
        self.servers = [CoordinatorProcess(root / f"replica{i}", *flags, new_session=True) for i in range(replicas)]

    def __enter__(self) -> Federation:
        for server in self.servers:
            server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for server in self.servers:
            server.stop()

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(s.pid) for s in self.servers)


def reset_database(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("DROP SCHEMA public CASCADE")
        db.execute("CREATE SCHEMA public")


def throughput(root: Path, pg_url: str, replicas: int, settings: Settings) -> dict[str, Any]:
    reset_database(pg_url)
    experts = [f"scale_expert_{i}" for i in range(settings.experts)]
    with Federation(root / f"tp{replicas}", pg_url, replicas, settings) as fed:
        urls = [s.url for s in fed.servers]
        create_experts(urls[0], settings, experts, fed.token)
        before = fed.cpu_seconds()
        load = run_in_process(load_plan(urls, fed.token, settings, experts))
        cpu = fed.cpu_seconds() - before
        results = [Pushed(**{k: r[k] for k in ("update_id", "expert", "num_samples", "seconds", "status")})
                   for r in load["results"]]
        checked = verify(urls[-1], results, experts)
    report = summarise(settings, load, checked)
    report["coordinator_cpu_s_per_push"] = round(cpu / max(1, len(results)), 4)
    report["replicas"] = replicas
    return report


def pull_bytes(root: Path, pg_url: str, settings: Settings) -> dict[str, Any]:
    """Bytes the coordinator sends for one weights pull, served itself vs redirected (and what the client got)."""
    reset_database(pg_url)
    with Federation(root / "pull", pg_url, 1, settings) as fed:
        url = fed.servers[0].url
        create_experts(url, settings, ["pull_expert"], fed.token)
        auth = {"Authorization": f"Bearer {fed.token}"}
        weights = f"{url}{API_PREFIX}/experts/pull_expert/weights"
        served = requests.get(weights, headers=auth, timeout=60)
        redirected = requests.get(weights, headers=auth | {REDIRECT_HEADER: "1"}, allow_redirects=False, timeout=60)
        followed = requests.get(redirected.headers["Location"], timeout=60)
    head = sum(len(k) + len(v) + 4 for k, v in redirected.headers.items()) + 20
    assert followed.content == served.content, "the object store's bytes differ from the coordinator's"
    return {"weights_bytes": len(served.content), "coordinator_bytes_served": len(served.content),
            "coordinator_bytes_redirected": head + len(redirected.content), "redirect_status": redirected.status_code,
            "bytes_saved_ratio": round(len(served.content) / (head + len(redirected.content)), 1)}


def crash_rounds(root: Path, pg_url: str, rounds: int, settings: Settings, rng: random.Random) -> dict[str, Any]:
    """kill -9 a random replica while both take pushes (one sample each), restart it; check after."""
    import boto3

    from bench.shapes import lora_manifest, random_tensors
    from compression import make_codec
    from compression.wire import encode_update

    reset_database(pg_url)
    manifest = lora_manifest("tiny-qwen2", 4)
    bodies = [encode_update(random_tensors(manifest, i, 1e-3), manifest, make_codec("int8", {}), seed=1)
              for i in range(4)]
    acked: set[str] = set()
    attempted: set[str] = set()  # acknowledged or not: a push cut off by the kill may still be recorded
    lock = threading.Lock()
    with Federation(root / "crash", pg_url, 2, Settings(**{**settings.__dict__, "buffer_size": 2})) as fed:
        tiny = Settings(**{**settings.__dict__, "model": "tiny-qwen2", "rank": 4})
        create_experts(fed.servers[0].url, tiny, ["crash_expert"], fed.token)
        joined = requests.post(f"{fed.servers[0].url}{API_PREFIX}/workers", timeout=30,
                               headers={"Authorization": f"Bearer {fed.token}"},
                               json={"worker_id": "crash-worker", "specialty": "crash_expert",
                                     "base_model": {"id": "tiny-qwen2", "fingerprint": "10ad" * 16}})
        worker_token = joined.json()["token"]
        stop = threading.Event()

        def pusher(index: int) -> None:
            n = 0
            while not stop.is_set():
                server = fed.servers[index]
                if server.proc is None or server.proc.poll() is not None or not server.url:
                    time.sleep(0.05)
                    continue
                update_id = f"crash-{index}-{n}"
                with lock:
                    attempted.add(update_id)
                ok = _push(server.url, worker_token, update_id, bodies[n % len(bodies)])
                if ok:
                    with lock:
                        acked.add(update_id)
                    n += 1
                else:
                    time.sleep(0.1)  # retried with the same update_id, as a worker does
        threads = [threading.Thread(target=pusher, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        kills = 0
        for r in range(rounds):
            time.sleep(rng.uniform(0.5, 2.0))
            victim = rng.choice(fed.servers)
            victim.kill()
            kills += 1
            log.info("crash round %d/%d: killed a replica; %d acknowledged so far", r + 1, rounds, len(acked))
            victim.start()
        stop.set()
        for t in threads:
            t.join(timeout=120)
        url = fed.servers[0].url
        auth = {"Authorization": f"Bearer {fed.token}"}
        known = {u for u in sorted(attempted)
                 if requests.get(f"{url}{API_PREFIX}/updates/{u}", headers=auth, timeout=30).status_code == 200}
        lost = len(acked - known)
        info = requests.get(f"{url}{API_PREFIX}/experts/crash_expert", headers=auth, timeout=30).json()
        bucket, _, prefix = fed.prefix.partition("/")
        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        bad_blobs = blobs = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for item in page.get("Contents", []):
                name = item["Key"].rsplit("/", 1)[1]
                data = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                blobs += 1
                bad_blobs += hash_bytes(data, algorithm_of(name)) != name
    counted = info["updates_applied"] + info["pending_updates"]
    return {"rounds": kills, "acknowledged": len(acked), "lost": lost,
            # rows counted beyond the ids the server knows, or samples (one per push) beyond the updates applied
            "applied_twice": max(0, counted - len(known)) + abs(info["samples_seen"] - info["updates_applied"]),
            "recorded_not_acknowledged": len(known - acked),
            "updates_applied": info["updates_applied"], "pending": info["pending_updates"],
            "s3_blobs": blobs, "bad_blobs": bad_blobs}


def _push(url: str, token: str, update_id: str, body: bytes) -> bool:
    import json

    from protocol.integrity import DIGEST_HEADER, digest_header
    from protocol.schemas import UPDATE_HEADER

    meta = {"update_id": update_id, "base_version": 0, "num_samples": 1, "codec": "int8", "codec_config": {},
            "worker_id": "crash-worker"}
    try:
        r = requests.post(f"{url}{API_PREFIX}/experts/crash_expert/updates", data=body, timeout=30, headers={
            "Authorization": f"Bearer {token}", UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body),
            "Content-Type": "application/octet-stream"})
    except requests.RequestException:
        return False
    return r.status_code in (200, 202)


@dataclass(frozen=True)
class ScaleSettings:
    workers: int = option(100, "simulated workers")
    rounds: int = option(2, "pushes per worker")
    crash_rounds: int = option(20, "kill -9 rounds")
    seed: int = option(0, "seed of the kills")
    model: str = "qwen2-0.5b"
    buffer_size: int = 10

    def __post_init__(self) -> None:
        if min(self.workers, self.rounds, self.crash_rounds) < 1:
            raise ValueError("--workers, --rounds and --crash-rounds must be at least 1")


def run(s: ScaleSettings, ctx: Run) -> int:
    settings = Settings(workers=s.workers, rounds=s.rounds, model=s.model, buffer_size=s.buffer_size)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="fedmoe-scale-") as tmp:
        pg = start_postgres()
        if isinstance(pg, str):
            print(f"bench.scale: PostgreSQL cannot start: {pg}")
            return 1
        stack.callback(pg.stop)
        s3 = start_s3()
        if isinstance(s3, str):
            print(f"bench.scale: S3-compatible server cannot start: {s3}")
            return 1
        stack.callback(s3.stop)
        os.environ.update(s3_env(s3))
        root = Path(tmp)
        runs = [throughput(root, pg.url, n, settings) for n in (1, 2)]
        pulls = pull_bytes(root, pg.url, settings)
        crashes = crash_rounds(root, pg.url, s.crash_rounds, settings, random.Random(s.seed))
    one, two = runs
    report = {"settings": settings.__dict__, "throughput": runs, "pulls": pulls, "crashes": crashes,
              "two_vs_one_replica_pushes_per_s": round(two["pushes_per_s"] / one["pushes_per_s"], 2),
              "cpu_s_per_push_two_vs_one": round(two["coordinator_cpu_s_per_push"] / one["coordinator_cpu_s_per_push"],
                                                 2)}
    ctx.write(report)
    print(format_table(["replicas", "pushes", "lost", "dup", "p50 s", "p99 s", "pushes/s", "CPU s/push"],
                       [[r["replicas"], r["pushes"], r["lost"], r["duplicated"], r["latency_s"]["p50"],
                         r["latency_s"]["p99"], r["pushes_per_s"], r["coordinator_cpu_s_per_push"]] for r in runs]))
    print(format_table(["weights bytes", "coordinator bytes, served", "coordinator bytes, redirected"],
                       [[pulls["weights_bytes"], pulls["coordinator_bytes_served"],
                         pulls["coordinator_bytes_redirected"]]]))
    print(format_table(["kill -9 rounds", "acknowledged", "lost", "applied twice", "S3 blobs", "bad blobs"],
                       [[crashes["rounds"], crashes["acknowledged"], crashes["lost"], crashes["applied_twice"],
                         crashes["s3_blobs"], crashes["bad_blobs"]]]))
    bad = any(r["lost"] or r["duplicated"] for r in runs) or crashes["lost"] or crashes["applied_twice"] \
        or crashes["bad_blobs"]
    return 1 if bad else 0


BENCH = Bench("scale", tags=("scale", "durability"), settings=ScaleSettings, run=run,
              quick={"workers": 16, "crash_rounds": 2, "model": "tiny-qwen2", "buffer_size": 2})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
