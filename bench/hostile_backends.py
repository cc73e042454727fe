"""Backend faults against replicas on a real PostgreSQL 15 and moto's S3 server (the ``backend_faults`` part of
``python -m bench.hostile``; not in its default run: it starts both servers, see bench/servers.py).

Two replicas share one database and one bucket prefix while an honest worker pushes to the first (one new
update id after another, each retried on 503 after its Retry-After, as the project's client does) and asks
/health.
The faults, one after another:

- ``mistyped_store``: a third replica is started with a typo in the --blobs prefix;
- ``empty_store``: a third replica is started on an empty bucket (an object store that lost its data);
- ``bucket_loss``: the bucket is deleted while both replicas serve; the second replica is restarted after;
- ``table_lock``: ``LOCK TABLE experts, updates IN ACCESS EXCLUSIVE MODE`` held for ``lock_s`` seconds.

Per fault: requests sent, 503s with Retry-After (the designed answer of a backend that is down or held up),
other 5xx (bugs), requests that got no answer, whether a started replica refused, the honest client's p99 for
pushes and /health; at the end, acknowledged updates lost (no longer answered) and doubled (counted twice).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import attacks
import bench.common
from bench.common import CoordinatorProcess, format_table
from bench.harness import git_head
from bench.shapes import PROJECTIONS, lora_manifest, random_tensors
from bench.servers import s3_env, start_postgres, start_s3
from compression import make_codec
from compression.wire import encode_update
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import API_PREFIX, UPDATE_HEADER

log = logging.getLogger("bench.hostile")

MANIFEST = lora_manifest("tiny-qwen2", 4)
SPEC: dict[str, Any] = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": list(PROJECTIONS)},
                        "base_model": {"id": "tiny-qwen2", "fingerprint": "ab" * 32}}
EXPERT = "sql"
BODY = encode_update(random_tensors(MANIFEST, 1, 1e-3), MANIFEST, make_codec("int8", {}), seed=1)


@dataclass
class HonestWorker:
    """Pushes new updates (retrying each on 503 after Retry-After, as the client does) and asks /health."""

    servers: list[CoordinatorProcess]
    token: str
    sent: list[str] = field(default_factory=list)
    acknowledged: list[str] = field(default_factory=list)
    answers: list[tuple[str, int | None, bool, float]] = field(default_factory=list)
    """(kind, status or None, Retry-After present, seconds) of every request."""

    def run(self, stop: threading.Event, attempts: int = 8) -> None:
        n = len(self.sent)
        while not stop.is_set():
            update_id, server = f"honest:{uuid.uuid4().hex[:12]}", self.servers[n % len(self.servers)]
            self.sent.append(update_id)
            for _ in range(attempts):
                self._ask("health", lambda: requests.get(server.url + f"{API_PREFIX}/health", timeout=30))
                status, retry_after = self._ask("push", lambda: self._push(server, update_id))
                if status in (200, 202):
                    self.acknowledged.append(update_id)
                    break
                time.sleep(float(retry_after or 1))
            n += 1

    def _push(self, server: CoordinatorProcess, update_id: str) -> requests.Response:
        meta = {"update_id": update_id, "base_version": 0, "num_samples": 1, "codec": "int8", "codec_config": {},
                "worker_id": "honest"}
        return requests.post(server.url + f"{API_PREFIX}/experts/{EXPERT}/updates", data=BODY, timeout=60, headers={
            "Authorization": f"Bearer {self.token}", UPDATE_HEADER: json.dumps(meta),
            DIGEST_HEADER: digest_header(BODY), "Content-Type": "application/octet-stream"})

    def _ask(self, kind: str, call: Any) -> tuple[int | None, str | None]:
        started = time.perf_counter()
        try:
            r = call()
        except requests.RequestException:
            self.answers.append((kind, None, False, time.perf_counter() - started))
            return None, None
        self.answers.append((kind, r.status_code, "Retry-After" in r.headers, time.perf_counter() - started))
        return r.status_code, r.headers.get("Retry-After")


def p99(seconds: list[float]) -> float | None:
    ordered = sorted(seconds)
    return round(ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))], 3) if ordered else None


def during(worker: HonestWorker, fault: Any) -> dict[str, Any]:
    """Run ``fault()`` while the honest worker pushes; what the worker saw meanwhile, and what the fault said."""
    first, stop = len(worker.answers), threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        outcome = fault()
    finally:
        stop.set()
        thread.join(600)
    seen = worker.answers[first:]
    return outcome | {
        "requests": len(seen), "status_503_retry_after": sum(s == 503 and ra for _, s, ra, _ in seen),
        "status_5xx_other": sum(s is not None and s >= 500 and not (s == 503 and ra) for _, s, ra, _ in seen),
        "no_answer": sum(s is None for _, s, _, _ in seen),
        "push_p99_s": p99([t for k, s, _, t in seen if k == "push" and s is not None]),
        "health_p99_s": p99([t for k, s, _, t in seen if k == "health" and s is not None])}


def start_refused(server: CoordinatorProcess) -> dict[str, Any]:
    """Start a replica that should refuse; whether it did, and its error line."""
    try:
        server.start()
    except RuntimeError:
        errors = [line.strip() for line in server.log if line.startswith("error: ")]
        return {"refused": True, "error": errors[-1] if errors else None}
    server.stop()
    return {"refused": False, "error": None}


def backend_faults(scratch: Path, lock_s: float = 15.0) -> dict[str, Any]:
    """Every fault above against two replicas; {"skipped": reason} where PostgreSQL or moto cannot start."""
    pg = start_postgres()
    if isinstance(pg, str):
        return {"skipped": pg}
    s3 = start_s3()
    if isinstance(s3, str):
        pg.stop()
        return {"skipped": s3}
    os.environ.update(s3_env(s3))  # the replicas (child processes) and our boto3 client read them
    bucket, prefix = "fedmoe-hostile", uuid.uuid4().hex
    flags = ("--manifest", pg.url, "--admin-token-file", str(scratch / "admin_token"), "--aggregation", "fedbuff",
             "--buffer-size", "4", "--gateway-interval", "3600", "--rate-limit", "0")
    replicas = [CoordinatorProcess(scratch / name, *flags, "--blobs", f"s3://{bucket}/{prefix}", new_session=True)
                for name in ("a", "b")]
    try:
        for server in replicas:
            server.start()
        admin = {"Authorization": f"Bearer {(scratch / 'admin_token').read_text().strip()}"}
        worker = HonestWorker(replicas[:1], _setup(replicas[0], admin))
        third = {name: CoordinatorProcess(scratch / name, *flags, "--blobs", url, new_session=True)
                 for name, url in (("typo", f"s3://{bucket}/{prefix}x"), ("empty", f"s3://{bucket}-empty/{prefix}"))}
        report = {"mistyped_store": during(worker, lambda: start_refused(third["typo"])),
                  "empty_store": during(worker, lambda: start_refused(third["empty"])),
                  "bucket_loss": during(worker, lambda: _lose_bucket(bucket, replicas[1])),
                  "table_lock": during(worker, lambda: _hold_table_lock(pg.url, lock_s))}
        return report | {"acknowledged": len(worker.acknowledged)} | _tally(replicas[0], admin, worker) | _stamp()
    finally:
        for server in replicas:
            server.stop()
        s3.stop()
        pg.stop()


def _setup(server: CoordinatorProcess, admin: dict[str, str]) -> str:
    """The expert and the honest worker's token."""
    from protocol.client import CoordinatorClient

    CoordinatorClient(server.url, token=admin["Authorization"].split()[1]).experts.create(
        EXPERT, random_tensors(MANIFEST, 7, 0.01), SPEC)
    r = requests.post(server.url + f"{API_PREFIX}/workers", headers=admin, timeout=60,
                      json={"worker_id": "honest", "specialty": EXPERT, "base_model": SPEC["base_model"]})
    r.raise_for_status()
    return r.json()["token"]


def _lose_bucket(bucket: str, restart: CoordinatorProcess) -> dict[str, Any]:
    """Delete the bucket while the replicas serve; then restart one (its start checks every blob it needs)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    time.sleep(2)  # some pushes before
    for _ in range(20):  # a push may store a blob between the listing and the bucket's deletion: again
        for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])
        try:
            s3.delete_bucket(Bucket=bucket)
            break
        except s3.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketNotEmpty":
                raise
    time.sleep(10)  # pushes find it gone; a replica makes it again and uploads what it holds
    restart.stop()
    try:
        restart.start()
        return {"restarted": True}
    except RuntimeError:
        return {"restarted": False, "error": next((line.strip() for line in restart.log if line.startswith("error")),
                                                  None)}


def _hold_table_lock(url: str, seconds: float) -> dict[str, Any]:
    import psycopg

    time.sleep(2)
    with psycopg.connect(url) as db:
        db.execute("LOCK TABLE experts, updates IN ACCESS EXCLUSIVE MODE")
        time.sleep(seconds)
    time.sleep(5)  # the pushes held back go through
    return {"lock_s": seconds}


def _tally(server: CoordinatorProcess, headers: dict[str, str], worker: HonestWorker) -> dict[str, int]:
    """Acknowledged updates no longer answered (lost), and updates counted more than once (doubled)."""
    recorded = {u for u in worker.sent
                if requests.get(server.url + f"{API_PREFIX}/updates/{u}", headers=headers, timeout=60).status_code == 200}
    info = requests.get(server.url + f"{API_PREFIX}/experts/{EXPERT}", headers=headers, timeout=60).json()
    return {"acknowledged_lost": len(set(worker.acknowledged) - recorded),
            "doubled": max(0, info["updates_applied"] + info["pending_updates"] - len(recorded))}


def _stamp() -> dict[str, Any]:
    """The commit measured and the machine's load (1, 5, 15 min) at the end of the run."""
    return {"commit": git_head(bench.common.ROOT), "load_average": [round(x, 1) for x in os.getloadavg()]}


def faults_table(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"backend_faults: skipped ({report['skipped']})"
    rows = [[name, part["requests"], part["status_503_retry_after"], part["status_5xx_other"], part["no_answer"],
             part.get("refused", part.get("restarted")), part["push_p99_s"], part["health_p99_s"]]
            for name, part in report.items() if isinstance(part, dict)]
    table = format_table(["backend fault", "requests", "503+Retry-After", "other 5xx", "no answer",
                          "refused / restarted", "push p99 s", "health p99 s"], rows)
    return table + (f"\nacknowledged {report['acknowledged']}, lost {report['acknowledged_lost']}, "
                    f"doubled {report['doubled']}")


@attacks.attack("backend_faults", table=faults_table, by_default=False)  # starts PostgreSQL and moto's S3 server
def backend_faults_attack(directory: Path, s: attacks.Settings) -> dict[str, Any]:
    """Replicas on PostgreSQL + S3: a mistyped and an empty store, the bucket lost, a table lock."""
    log.info("backend faults: replicas on PostgreSQL + S3; mistyped and empty store, bucket loss, table lock")
    return backend_faults(directory, lock_s=s.lock_seconds)
