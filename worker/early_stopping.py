"""Early stopping on the expert's held-out loss, as Hugging Face Trainer's EarlyStoppingCallback does it.

Late in a run the workers of one expert overfit their small shards: the expert's held-out loss, which fell,
rises again (issue 32: 1.81 -> 1.46 by 144 s, 1.56 by 319 s). With ``--early-stopping-patience N`` the worker
scores each expert version it pulls on its own held-out split and remembers the best; after N pulled versions
in a row that did not lower the best loss by more than ``--early-stopping-threshold``, it stops training and
makes its final push, as at the end of ``--duration``. Its log names the best version it saw, which
``GET /api/v1/experts/<name>/weights?version=N`` still serves while the coordinator keeps it
(``--keep-versions``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EarlyStoppingSettings:
    patience: int
    """Scored versions in a row without improvement after which the worker stops."""
    threshold: float = 0.0
    """How much a version must lower the best held-out loss to count as an improvement."""

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"--early-stopping-patience must be at least 1, got {self.patience}")
        if not self.threshold >= 0:
            raise ValueError(f"--early-stopping-threshold must be >= 0, got {self.threshold}")


@dataclass
class BestVersion:
    """The best expert version scored so far, and how many scored since without improving on it."""

    settings: EarlyStoppingSettings
    version: int | None = None
    loss: float = math.inf
    since_best: int = 0

    def observe(self, version: int, loss: float) -> bool:
        """Record a pulled version's held-out loss; True when patience has run out (time to stop)."""
        if loss < self.loss - self.settings.threshold:
            self.version, self.loss, self.since_best = version, loss, 0
        else:
            self.since_best += 1
        stop = self.since_best >= self.settings.patience
        if stop:
            log.info("early stopping: %d pulled version(s) did not improve on version %s (held-out loss %.4f)",
                     self.since_best, self.version, self.loss)
        return stop

    def record(self) -> dict[str, float | int | None]:
        """What the sync's --results line says about it."""
        return {"best_version": self.version, "best_heldout_loss": None if math.isinf(self.loss) else self.loss,
                "versions_since_best": self.since_best}
