"""Cohorts on disk, so an aggregator killed mid-cohort resumes it and loses no acknowledged input.

One directory per cohort: ``state.json`` (the ``CohortState`` record) and one ``<index>.u32`` file per
masked input. Every write goes to a temp file, is fsynced, renamed over its name and the directory
fsynced, so a crash leaves the old file or the new one, never a torn one. A masked input's file is
durable before the state names it, and the state is durable before the member gets its 202; a
vector the state does not name (a crash in between) is ignored and overwritten by the retry.
Nothing here is pickled: JSON and raw little-endian uint32.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from privacy.secagg.cohort import CohortState
from privacy.secagg.config import CohortConfig, Phase, b64, unb64
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.member import PublicKeys, UnmaskAnswer
from privacy.secagg.unmask import read_masked

STATE_FILE = "state.json"


def to_record(state: CohortState) -> dict[str, Any]:
    return {
        "config": state.config.to_json(), "phase": state.phase.value, "reason": state.reason,
        "keys": {m: {"cipher": b64(k.cipher), "mask": b64(k.mask)} for m, k in state.keys.items()},
        "sealed": {s: {r: b64(box) for r, box in boxes.items()} for s, boxes in state.sealed.items()},
        "commitments": {m: b64(c) for m, c in state.commitments.items()},
        "masked": state.masked,
        "answers": {m: {"seeds": {u: b64(s) for u, s in a.seed_shares.items()},
                        "keys": {v: b64(s) for v, s in a.key_shares.items()}} for m, a in state.answers.items()},
    }


def from_record(record: dict[str, Any]) -> CohortState:
    try:
        return CohortState(
            config=CohortConfig.from_json(record["config"]), phase=Phase(record["phase"]), reason=record["reason"],
            keys={m: PublicKeys(unb64(k["cipher"], "key", 32), unb64(k["mask"], "key", 32))
                  for m, k in record["keys"].items()},
            sealed={s: {r: unb64(box, "share") for r, box in boxes.items()} for s, boxes in record["sealed"].items()},
            commitments={m: unb64(c, "commitment", 32) for m, c in record["commitments"].items()},
            masked=dict(record["masked"]),
            answers={m: UnmaskAnswer({u: unb64(s, "share") for u, s in a["seeds"].items()},
                                     {v: unb64(s, "share") for v, s in a["keys"].items()})
                     for m, a in record["answers"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadSecAggMessage(f"a journalled cohort record is damaged: {exc!r}") from None


def write_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path`` or the old content, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CohortJournal:
    """The durable cohorts of one aggregator (the root or a relay), under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, cohort_id: str) -> Path:
        """A cohort's folder; its id matched COHORT_ID when its config was built, so it is a plain name."""
        return self.root / cohort_id

    def save(self, state: CohortState) -> None:
        folder = self._dir(state.config.cohort_id)
        folder.mkdir(exist_ok=True)
        write_durably(folder / STATE_FILE, json.dumps(to_record(state), sort_keys=True).encode())

    def save_masked(self, state: CohortState, member: str, vector: np.ndarray) -> None:
        """The vector, durable; the caller then records it in the state and saves the state."""
        folder = self._dir(state.config.cohort_id)
        folder.mkdir(exist_ok=True)
        write_durably(folder / f"{state.config.index_of(member)}.u32", vector.astype("<u4").tobytes())

    def load_masked(self, state: CohortState, member: str) -> np.ndarray:
        path = self._dir(state.config.cohort_id) / f"{state.config.index_of(member)}.u32"
        return read_masked(path.read_bytes(), state.config.numel)

    def load_all(self) -> list[CohortState]:
        """Every journalled cohort, oldest directory first (a restart resumes the unfinished ones)."""
        states = []
        for folder in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime_ns):
            if (folder / STATE_FILE).is_file():
                states.append(from_record(json.loads((folder / STATE_FILE).read_bytes())))
        return states

    def forget_inputs(self, state: CohortState) -> None:
        """Drop a finished cohort's masked inputs (its state stays, so a member can learn the outcome)."""
        if not state.finished:
            raise BadSecAggMessage(f"cohort {state.config.cohort_id} is not finished; its inputs are still needed")
        for path in self._dir(state.config.cohort_id).glob("*.u32"):
            path.unlink()

    def remove(self, cohort_id: str) -> None:
        shutil.rmtree(self._dir(cohort_id), ignore_errors=True)
