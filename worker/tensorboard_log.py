"""--tensorboard DIR: per-step and per-sync scalars with torch's standard SummaryWriter (needs `tensorboard`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

STEP_SCALARS = ("loss", "tokens_per_s", "step_ms", "peak_memory_mb", "bytes_sent", "bytes_raw", "ratio", "density",
                "comm_ms", "compress_ms", "grad_rel_error", "grad_cosine")
SYNC_SCALARS = ("train_loss", "bytes_sent", "bytes_raw", "ratio", "tokens_per_s", "samples", "seconds")


def check_tensorboard() -> None:
    """Refuse --tensorboard now, in one line, when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard==2.21.0") from None


class TensorBoardLog:
    """Writes step records under step/<name> and sync records under sync/<name>; other keys are ignored."""

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def step(self, record: dict[str, Any]) -> None:
        self._write("step", record, STEP_SCALARS, record["step"])

    def sync(self, record: dict[str, Any]) -> None:
        self._write("sync", record, SYNC_SCALARS, record.get("sync", 0))

    def _write(self, group: str, record: dict[str, Any], names: tuple[str, ...], index: int) -> None:
        for name in names:
            value = record.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{group}/{name}", value, index)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
