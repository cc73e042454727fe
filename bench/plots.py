"""PNG plots next to the JSON results: train loss per expert over time, bytes per sync per codec.

Shared by ``scripts/demo.py`` (the per-sync ``*.results.jsonl`` of its workers) and the benchmarks
(``bench/compression.py``'s records). matplotlib runs on its Agg backend (no display needed) and
each file is written atomically. The data each plot shows is computed by a pure function
(``loss_series``, ``codec_bytes``) so it can be tested without looking at pixels.
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files, never to a window
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from protocol.files import write_atomically

DPI = 120


def read_results(path: Path) -> list[dict[str, Any]]:
    """The records of one worker's ``--results`` file (one JSON object per line)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def loss_series(records: Iterable[Mapping[str, Any]], start: float) -> tuple[list[float], list[float]]:
    """(minutes since ``start``, train loss) of every sync that trained; syncs without a loss are skipped."""
    points = [(r["time"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    return [(t - start) / 60 for t, _ in points], [loss for _, loss in points]


def plot_expert_losses(results: Mapping[str, Sequence[Mapping[str, Any]]], path: Path,
                       title: str = "train loss per expert") -> Path:
    """One line per expert: each sync's mean train loss over the interval it closed, against time."""
    start = min((r["time"] for records in results.values() for r in records), default=0.0)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for expert, records in sorted(results.items()):
        minutes, losses = loss_series(records, start)
        ax.plot(minutes, losses, marker="o", markersize=3, linewidth=1.5, label=expert)
    ax.set(title=title, xlabel="minutes since the first sync", ylabel="train loss (mean over the sync interval)")
    ax.grid(True, alpha=0.3)
    if results:
        ax.legend()
    return _save(fig, path)


@dataclass(frozen=True)
class CodecBytes:
    label: str
    """The configuration's label, e.g. 'topk+int8 ratio=0.03,scale_dtype=fp16'."""
    bytes_per_sync: float
    """Mean body bytes of one pushed update (all suites and workers of the run)."""
    ratio: float
    """fp32 bytes / bytes sent."""


def codec_bytes(records: Iterable[Mapping[str, Any]]) -> list[CodecBytes]:
    """Bytes per pushed update of each configuration (pooled over suites), largest first; failed jobs skipped."""
    totals: dict[str, tuple[int, int, int]] = {}  # label -> (bytes sent, fp32 bytes, updates)
    for r in records:
        if r.get("error") or not r.get("updates"):
            continue
        sent, raw, updates = totals.get(r["label"], (0, 0, 0))
        totals[r["label"]] = (sent + r["bytes_sent"], raw + r["bytes_raw"], updates + r["updates"])
    rows = [CodecBytes(label, sent / updates, raw / sent) for label, (sent, raw, updates) in totals.items()]
    return sorted(rows, key=lambda row: -row.bytes_per_sync)


def plot_codec_bytes(records: Iterable[Mapping[str, Any]], path: Path,
                     title: str = "bytes per sync per codec (one pushed update; ratio to fp32)") -> Path:
    """Horizontal bars on a log axis, one per codec configuration, each labelled with its ratio to fp32."""
    rows = codec_bytes(records)
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.6))
    positions = range(len(rows))
    ax.barh(positions, [r.bytes_per_sync for r in rows], color="#1f5fbf")
    ax.set_yticks(list(positions), [r.label for r in rows], fontsize=8)
    ax.invert_yaxis()  # largest at the top
    ax.set_xscale("log")
    for y, r in zip(positions, rows):
        ax.annotate(f" {_size(r.bytes_per_sync)}, {r.ratio:.3g}x", (r.bytes_per_sync, y), va="center", fontsize=8)
    right = max((r.bytes_per_sync for r in rows), default=1.0)
    ax.set_xlim(right=right * 8)  # room for the labels
    ax.set(title=title, xlabel="bytes per pushed update (log scale)")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def _size(nbytes: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, buffer.getvalue())
    return path
