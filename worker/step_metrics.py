"""Per-step metrics of a worker's training: peak memory, and the JSONL lines --results gets for each step."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_mb(device: str | torch.device) -> float:
    """Peak memory of this process so far: allocated CUDA memory on a GPU, resident set size otherwise."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


class StepLog:
    """Appends one JSON line per optimiser step to a --results file (sync lines have no "event" key)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
