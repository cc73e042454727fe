"""The federated loop's settings (worker.federation): how long to train, how often to sync, where to checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SyncSettings:
    specialty: str
    """Expert this worker trains."""
    worker_id: str
    duration: float = 3600.0
    """Seconds to run before the final push."""
    max_steps: int | None = None
    """Optimiser steps to train before the final push (Hugging Face Trainer's ``max_steps``), counted over the
    whole run, a resumed checkpoint's steps included; the run ends at ``max_steps`` or ``duration``, whichever
    comes first. None: ``duration`` alone decides."""
    sync_interval: float = 10.0
    """Seconds of training between syncs."""
    speed_factor: float = 1.0
    """Relative speed in (0, 1]: 0.5 sleeps as long as each step took, simulating a slower machine."""
    steps_per_check: int = 1
    """Training steps between clock checks."""
    results_path: Path | None = None
    """Append one JSON line per sync here."""
    state_dir: Path | None = None
    """Checkpoint here at every sync and resume from here (None: no checkpoints)."""
    resume: bool = True
    """Resume from the checkpoint in state_dir if there is one; False discards it (--fresh)."""
    overlap: bool = True
    """Push and pull on a background thread while training goes on (False: training waits)."""
    comm_share: float | None = None
    """Stretch the sync interval so that pushing and pulling take at most this share of the worker's time
    (worker.adaptive.SyncPacing; None: sync every ``sync_interval``)."""
    secure_aggregation: bool = False
    """Push through secure-aggregation cohorts, masked (worker.secure_push); the coordinator sees only sums."""
    min_dp_noise: float | None = None
    """--min-dp-noise: push only to an expert (and, with secure aggregation, a cohort) whose coordinator announces
    worker-level DP noise of at least this multiplier (worker.privacy_floor); None: no floor."""

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        if not self.sync_interval > 0:
            raise ValueError(f"--sync-interval must be > 0 seconds, got {self.sync_interval}")
        if not 0 < self.speed_factor <= 1:
            raise ValueError(f"--speed-factor must be in (0, 1] (1 = full speed), got {self.speed_factor}")
        if self.comm_share is not None and not 0 < self.comm_share < 1:
            raise ValueError(f"--comm-share must be in (0, 1), got {self.comm_share}")
