"""Checkpoints of the federated loop: what a sync point saves, and restoring it into a new process.

worker.checkpoint stores and loads the files; this module decides what goes in (the trainer's
adapter and optimiser, the encoder's residual, the ExpertState) and puts it back.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from compression.errors import CompressionError
from protocol.tensors import StateDict
from worker.checkpoint import CheckpointError, CheckpointWriter, WorkerCheckpoint, clone_optimizer_state
from worker.data import StreamPosition
from worker.encoding import UpdateEncoder
from worker.sync_state import ExpertState

log = logging.getLogger(__name__)


class Resumable(Protocol):
    """What a checkpoint needs from the trainer (``worker.trainer.LoraTrainer``)."""

    global_step: int

    def load_adapter_state(self, state: StateDict) -> None: ...
    @property
    def data_position(self) -> StreamPosition: ...
    def seek(self, position: StreamPosition) -> None: ...
    def optimizer_state(self) -> dict: ...
    def load_optimizer_state(self, state: dict) -> None: ...


def restore(checkpoint: WorkerCheckpoint, trainer: Resumable, encoder: UpdateEncoder, state_dir: Path,
            state: ExpertState) -> None:
    """Put a checkpoint's adapter, optimiser, data position, residual and ExpertState back."""
    progress = checkpoint.progress
    optimizer = checkpoint.optimizer
    current = trainer.optimizer_state()["param_groups"]  # today's --lr etc. win over the saved ones
    optimizer["param_groups"] = [{**now, "params": saved["params"]}
                                 for now, saved in zip(current, optimizer["param_groups"], strict=True)]
    try:
        trainer.load_adapter_state(checkpoint.adapter)
        trainer.load_optimizer_state(optimizer)
        trainer.seek(StreamPosition.from_dict(progress["data_position"]))
        encoder.load_state_dict(checkpoint.residual)
    except (ValueError, KeyError, CompressionError) as exc:
        raise CheckpointError(f"--state-dir {state_dir}: cannot resume this checkpoint ({exc}); "
                              "pass --fresh to discard it") from None
    trainer.global_step = progress["global_step"]
    state.load(checkpoint)


def codec_change(saved: dict[str, Any] | None, encoder: UpdateEncoder) -> str:
    """', trained with another codec ...' when the checkpoint's codec differs from today's (allowed)."""
    now = encoder.codec_meta
    if saved is None or saved == now:
        return ""
    carried = encoder.residual_norm()
    return (f", trained with --compression {saved['codec']} {json.dumps(saved['codec_config'])}, now "
            f"{now['codec']} {json.dumps(now['codec_config'])}"
            + (f"; its residual (norm {carried:.3g}) goes into the next update" if carried else ""))


def capture(identity: dict[str, Any], state: ExpertState, trainer: Resumable, encoder: UpdateEncoder,
            snapshot: StateDict, dataset: dict[str, str] | None, keep_pulled: bool = True) -> WorkerCheckpoint:
    """The checkpoint of a sync point; ``save`` adds the residual and outbox after encoding.

    ``keep_pulled=False`` (a worker that never pulls diffs) leaves the pulled weights out: they are
    only a diff's base, and a restored worker without them pulls in full, as it would anyway.
    """
    progress = {**state.progress(), "global_step": trainer.global_step,
                "data_position": trainer.data_position.to_dict(), "time": time.time(), "codec": encoder.codec_meta,
                "dataset": dataset["path"] if dataset else None}
    return WorkerCheckpoint(identity, progress, adapter=snapshot, reference=state.reference,
                            pulled=state.pulled if keep_pulled else {},
                            residual={}, optimizer=clone_optimizer_state(trainer.optimizer_state()))


def save(writer: CheckpointWriter, checkpoint: WorkerCheckpoint, encoder: UpdateEncoder, state: ExpertState) -> float:
    """Write the checkpoint with the current residual and outbox; the seconds it took.

    The residual is not copied: the encoder replaces its residual tensors at each encode and never
    mutates them, and this runs on the thread that encodes, before the next encode.
    """
    started = time.perf_counter()
    checkpoint.residual = encoder.carried()
    checkpoint.outbox = [(o.body, o.meta) for o in state.outbox]
    try:
        writer.save(checkpoint)
    except OSError as exc:  # never push what we could not checkpoint: a restart would send it twice
        raise CheckpointError(f"cannot write a checkpoint to --state-dir {writer.state_dir}: {exc}") from None
    return round(time.perf_counter() - started, 4)
