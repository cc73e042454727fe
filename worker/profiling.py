"""--profile DIR --profile-steps N: a torch.profiler trace of N training steps and where their time went.

Each rank writes DIR/rank<R>-trace.json (open it in chrome://tracing or Perfetto) and
DIR/rank<R>-summary.json, and logs the share of step time spent in each collective and how much
of that collective time overlapped compute on the training thread. gloo runs collectives on its own
threads ("gloo:all_reduce", ...), NCCL as "nccl:..." events; the first step is not profiled (DDP
rebuilds its buckets and FSDP lazily initialises there).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from protocol.files import write_atomically

log = logging.getLogger(__name__)

STEP_LABEL = "fedmoe:train_step"
COLLECTIVES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("all_reduce", "allreduce"),
    "reduce_scatter": ("reduce_scatter",),
    "all_gather": ("all_gather", "allgather"),
    "broadcast": ("broadcast",),
}
BACKEND_PREFIXES = ("gloo:", "nccl:")
Interval = tuple[float, float]


@dataclass(frozen=True)
class ProfileSettings:
    directory: Path
    """Where each rank writes its trace and summary."""
    steps: int = 3
    """Training steps to profile (after one warm-up step)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--profile-steps must be at least 1, got {self.steps}")


class StepProfiler:
    """Profiles training steps warmup+1 .. warmup+N of this rank, then writes the trace and summary once."""

    def __init__(self, settings: ProfileSettings, rank: int, warmup: int = 1):
        self.settings = settings
        self.rank = rank
        self.warmup = warmup
        self._seen = 0
        self._profile: Any = None
        self.summary: dict[str, Any] | None = None

    def step(self):
        """Context manager around one optimiser step."""
        import contextlib

        from torch.profiler import record_function

        @contextlib.contextmanager
        def around():
            if self._seen == self.warmup and self.summary is None:
                self._start()
            try:
                if self._profile is None:
                    yield
                else:
                    with record_function(STEP_LABEL):
                        yield
            finally:
                self._seen += 1
                if self._profile is not None and self._seen == self.warmup + self.settings.steps:
                    self._finish()

        return around()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities)
        self._profile.__enter__()

    def _finish(self) -> None:
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        directory = self.settings.directory
        directory.mkdir(parents=True, exist_ok=True)
        trace = directory / f"rank{self.rank}-trace.json"
        partial = directory / f".rank{self.rank}-trace.json.partial"
        prof.export_chrome_trace(str(partial))
        os.replace(partial, trace)  # never leave a half-written trace under the real name
        self.summary = summarize(prof.events())
        write_atomically(directory / f"rank{self.rank}-summary.json",
                         (json.dumps(self.summary, indent=2) + "\n").encode())
        log.info("profile of %d step(s) in %s: %s", self.settings.steps, trace, describe(self.summary))


def summarize(events: Iterable[Any]) -> dict[str, Any]:
    """Step time, and per collective its share of it and the fraction that overlapped compute."""
    events = list(events)
    steps = [_interval(e) for e in events if e.name == STEP_LABEL]
    main_threads = {e.thread for e in events if e.name == STEP_LABEL}
    step_us = sum(end - start for start, end in steps)
    compute = union([_interval(e) for e in events if e.thread in main_threads and e.name.startswith("aten::")])
    result: dict[str, Any] = {"steps": len(steps), "step_ms": round(step_us / 1000, 3), "collectives": {}}
    for kind, names in COLLECTIVES.items():
        busy = intersect(union([_interval(e) for e in events if _is_collective(e, names, main_threads)]), steps)
        busy_us = length(busy)
        if busy_us == 0:
            continue
        result["collectives"][kind] = {
            "ms": round(busy_us / 1000, 3),
            "share_of_step": busy_us / step_us if step_us else 0.0,
            "overlapped_compute": length(intersect(busy, compute)) / busy_us,
        }
    return result


def describe(summary: dict[str, Any]) -> str:
    """One line: '3 steps, 412 ms/step; all_reduce 21% of step time (64% overlapped compute); ...'."""
    parts = [f"{summary['steps']} steps, {summary['step_ms'] / max(summary['steps'], 1):.0f} ms/step"]
    for kind, c in summary["collectives"].items():
        parts.append(f"{kind} {100 * c['share_of_step']:.0f}% of step time "
                     f"({100 * c['overlapped_compute']:.0f}% overlapped compute)")
    return "; ".join(parts) if summary["collectives"] else parts[0] + "; no collectives"


def _is_collective(event: Any, names: tuple[str, ...], main_threads: set[int]) -> bool:
    """A backend's own event for the transfer (on its worker thread for gloo)."""
    name = event.name.lower()
    return name.startswith(BACKEND_PREFIXES) and any(n in name for n in names) and event.thread not in main_threads


def _interval(event: Any) -> Interval:
    return float(event.time_range.start), float(event.time_range.end)


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Points in both (each list made disjoint first)."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)
