#!/usr/bin/env python3
"""Resumable pushes: what a break at 90% of a large push costs, one-shot versus resumable.

A real coordinator (run_coordinator.py) on loopback; the push goes through a delay proxy (``--rtt-ms``,
bench.wanemu.DelayProxy) and a proxy that paces the upload to ``--rate-mbit`` and breaks the connection
once when 90% of the body has crossed it (bench.wanemu.cut.CutProxy). No root needed. For each mode
(one-shot: the whole body in one request; resumable: chunks, protocol/uploads.py) the same update is
pushed without a break and with one, each to its own fresh expert; reported: bytes that crossed the
link (headers included), bytes sent again because of the break (wire bytes minus the same push's
unbroken wire bytes), the push's time, and the time the break cost. Every push is checked to be
applied exactly once (each expert at version 1, its weights equal to the unbroken one-shot's).

    python -m bench.resume --quick     # 12 MiB update, 20 Mbit/s, 50 ms RTT, ~40 s
    python -m bench.resume             # 64 MiB update

Table on stdout, results in bench/results/resume.json.
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import SCRATCH_DIR, coordinator_process, format_table, pulled_tensors
from bench.harness import Bench, Run
from bench.wanemu import DelayProxy
from bench.wanemu.cut import CutProxy
from protocol.cli import option
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import local_token
from protocol.tensors import dumps
from protocol.uploads import UploadPolicy

log = logging.getLogger("bench.resume")
MiB = 1 << 20
RANK, DIM = 16, 1024  # one LoRA pair of a 1024-wide projection: 128 KiB of float32
RETRY = RetryPolicy(attempts=4, base_delay=0.05)  # the same short backoff for both modes
MODES = {"one-shot": UploadPolicy(threshold=1 << 62), "resumable": UploadPolicy()}
"""mode -> the client's upload policy (one-shot: no body reaches the threshold; resumable: the default)."""


@dataclass(frozen=True)
class Settings:
    size_mb: int = option(64, "size of the pushed update (raw safetensors), MiB (>= 8, the resumable threshold)")
    rate_mbit: float = option(20.0, "upload rate of the link, Mbit/s")
    rtt_ms: float = option(50.0, "round-trip time the delay proxy adds, ms")
    cut_fraction: float = 0.9
    """Where the link breaks, as a fraction of the body."""

    def __post_init__(self) -> None:
        if self.size_mb < 8:
            raise ValueError(f"--size-mb must be >= 8 (the resumable threshold), got {self.size_mb}")
        if not (self.rate_mbit > 0 and self.rtt_ms >= 0):
            raise ValueError("--rate-mbit must be positive and --rtt-ms not negative")


@dataclass(frozen=True)
class Row:
    mode: str
    broken: bool
    body_mib: float
    wire_mib: float
    resent_mib: float
    seconds: float
    break_cost_s: float
    chunks: int
    resumes: int


def adapter(size_mb: int) -> dict[str, torch.Tensor]:
    """A LoRA-shaped state dict of about ``size_mb`` MiB (the expert's shape and the delta's)."""
    g = torch.Generator().manual_seed(0)
    pairs = size_mb * MiB // (2 * RANK * DIM * 4)
    out = {}
    for i in range(pairs):
        key = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        out[f"{key}.lora_A.weight"] = torch.randn(RANK, DIM, generator=g)
        out[f"{key}.lora_B.weight"] = torch.randn(DIM, RANK, generator=g)
    return out


def spec() -> dict[str, Any]:
    return {"lora": {"rank": RANK, "alpha": 2.0 * RANK, "target_modules": ["q_proj"]},
            "base_model": {"id": "bench-resume", "fingerprint": "ab" * 32}}


def push_once(url: str, expert: str, body: bytes, mode: str, settings: Settings, broken: bool) -> dict[str, Any]:
    host, port = url.rsplit("//", 1)[1].split(":")
    cut_at = int(len(body) * settings.cut_fraction) if broken else None
    with CutProxy((host, int(port)), cut_at=cut_at, rate_mbit=settings.rate_mbit) as cut, \
            DelayProxy(cut.address, one_way_s=settings.rtt_ms / 2000) as delay:
        client = CoordinatorClient(delay.url(), token=local_token(url), upload=MODES[mode], retry=RETRY,
                                   timeout=(10.0, 300.0))
        started = time.perf_counter()
        status = client.updates.push(expert, body, {"update_id": f"{expert}-u1", "base_version": 0,
                                                   "num_samples": 1})
        seconds = time.perf_counter() - started
        assert status["status"] in ("applied", "pending"), status
        assert cut.cuts == (1 if broken else 0), "the link did not break where it should"
        stats = client.updates.last_upload
        return {"wire": cut.bytes_to_target, "seconds": seconds, "chunks": stats.chunks if stats else 1,
                "resumes": stats.resumes if stats else int(broken)}


def run(settings: Settings) -> list[Row]:
    base, delta = adapter(settings.size_mb), adapter(settings.size_mb)
    body = dumps({k: v * 0.01 for k, v in delta.items()})
    rows, measured = [], {}
    with tempfile.TemporaryDirectory(prefix="fedmoe-bench-", dir=SCRATCH_DIR) as data_dir, \
            coordinator_process(Path(data_dir) / "data") as server:
        admin = CoordinatorClient(server.url, retry=RETRY)
        for mode in MODES:
            for broken in (False, True):
                expert = f"{mode.replace('-', '')}_{'broken' if broken else 'clean'}"
                admin.experts.create(expert, base, spec())
                log.info("%s push of %.0f MiB%s", mode, len(body) / MiB, ", broken at 90%" if broken else "")
                measured[mode, broken] = push_once(server.url, expert, body, mode, settings, broken)
        check_applied_once(admin, [f"{m.replace('-', '')}_{b}" for m in MODES for b in ("clean", "broken")])
    for (mode, broken), m in measured.items():
        clean = measured[mode, False]
        rows.append(Row(mode, broken, round(len(body) / MiB, 2), round(m["wire"] / MiB, 2),
                        round((m["wire"] - clean["wire"]) / MiB, 2), round(m["seconds"], 2),
                        round(m["seconds"] - clean["seconds"], 2), m["chunks"], m["resumes"]))
    return rows


def check_applied_once(admin: CoordinatorClient, experts: list[str]) -> None:
    reference = pulled_tensors(admin.experts.pull(experts[0]))
    for name in experts:
        info = admin.experts.get(name)
        assert info["updates_applied"] == 1 and info["version"] == 1, (name, info)
        got = pulled_tensors(admin.experts.pull(name))
        assert all(torch.equal(got[k], reference[k]) for k in reference), f"{name} differs from {experts[0]}"


def run_bench(s: Settings, ctx: Run) -> int:
    rows = run(s)
    print(format_table(["mode", "break at 90%", "body MiB", "wire MiB", "re-sent MiB", "push s", "break cost s",
                        "chunks", "resumes"],
                       [(r.mode, "yes" if r.broken else "no", r.body_mib, r.wire_mib, r.resent_mib, r.seconds,
                         r.break_cost_s, r.chunks, r.resumes) for r in rows]))
    ctx.write({"settings": asdict(s), "rows": [asdict(r) for r in rows]})
    return 0


BENCH = Bench("resume", tags=("network",), settings=Settings, run=run_bench, quick={"size_mb": 12})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
