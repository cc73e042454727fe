"""A worker's local checkpoint: what it needs to resume where it stopped, safe against kill -9.

Layout of a state dir (one per worker id, ``worker-state/<worker_id>`` by default):

    checkpoint.json          the manifest: identity, counters, outbox metadata, and which
                             directory holds the tensors; replaced atomically, written LAST
    ckpt-000042/             the tensors of sync 42 (safetensors) and the outbox bodies
        adapter.safetensors     local adapter at the sync point
        reference.safetensors   weights the next delta is measured from
        pulled.safetensors      weights of the last pull (diff pulls decode against them)
        residual.safetensors    error-feedback residual (empty without a lossy codec)
        optimizer.safetensors   AdamW moments and step counts, flattened (see flatten_optimizer)
        outbox-0.bin ...        queued update bodies, byte for byte as they will be pushed

A save writes a fresh ``ckpt-<n>`` directory (every file fsynced), then swaps the manifest with
``protocol.files.write_atomically``, then deletes older directories. A kill at any point leaves
either the old manifest and its complete directory or the new ones; a half-written directory is
never referenced and is swept by the next save. No pickle anywhere: tensors are safetensors,
everything else JSON.

Outbox bodies already on disk are hard-linked into the next directory instead of rewritten, so
a long outage (a growing outbox) does not make every checkpoint rewrite all of it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.errors import InvalidPayload
from protocol.files import fsync_dir, write_atomically
from protocol.tensors import StateDict, dumps, load_file
from worker.errors import WorkerError

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "checkpoint.json"
TENSOR_FILES = ("adapter", "reference", "pulled", "residual", "optimizer")


class CheckpointError(WorkerError, ValueError):
    """A checkpoint that cannot be used here; the message says which flag to change."""


@dataclass
class WorkerCheckpoint:
    """Everything a worker resumes from; all tensors are CPU copies nobody mutates."""

    identity: dict[str, Any]
    """What must match to resume: specialty, worker_id, base model id + fingerprint, LoRA setup."""
    progress: dict[str, Any]
    """JSON scalars: sync count, base_version, etag, pulls, global_step, data_position, ..."""
    adapter: StateDict
    reference: StateDict
    pulled: StateDict
    residual: StateDict
    optimizer: dict[str, Any]
    """A torch optimizer state_dict (tensors already cloned)."""
    outbox: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)
    """Undelivered updates: (body, meta with its update_id), oldest first."""


# optimizer <-> tensors + JSON ------------------------------------------------------------------

def clone_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``optimizer.state_dict()``; its tensors are the live ones the next step mutates."""
    return {"state": {i: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]]}


def flatten_optimizer(state: dict[str, Any]) -> tuple[StateDict, dict[str, Any]]:
    """Split an optimizer state_dict into tensors ``state.<param>.<name>`` and a JSON-able rest."""
    tensors: StateDict = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: StateDict, meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of flatten_optimizer; tuples (AdamW's betas) come back as tuples."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# saving ------------------------------------------------------------------------------------------

def save_checkpoint(state_dir: Path, checkpoint: WorkerCheckpoint) -> Path:
    """Write ``checkpoint`` durably; returns its tensor directory. Old checkpoints go once it is in place."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    previous = _read_manifest(state_dir)
    number = (previous["sequence"] + 1) if previous else 0
    target = state_dir / f"ckpt-{number:06d}"
    if target.exists():  # left by a save that was killed before its manifest
        shutil.rmtree(target)
    target.mkdir()
    optimizer_tensors, optimizer_meta = flatten_optimizer(checkpoint.optimizer)
    written = []
    for name, tensors in (("adapter", checkpoint.adapter), ("reference", checkpoint.reference),
                          ("pulled", checkpoint.pulled), ("residual", checkpoint.residual),
                          ("optimizer", optimizer_tensors)):
        if tensors:  # safetensors 0.x writes an unreadable header for an empty dict: an absent file means {}
            _write_durably(target / f"{name}.safetensors", dumps(tensors))
            written.append(name)
    linked = _outbox_files(state_dir, previous)
    outbox = []
    for i, (body, meta) in enumerate(checkpoint.outbox):
        path = target / f"outbox-{i}.bin"
        source = linked.get(meta["update_id"])
        if source is not None and source.stat().st_size == len(body):
            os.link(source, path)
        else:
            _write_durably(path, body)
        outbox.append({"file": path.name, "meta": meta})
    fsync_dir(target)
    manifest = {"format": FORMAT, "sequence": number, "directory": target.name, "tensors": written,
                "identity": checkpoint.identity, "progress": checkpoint.progress, "optimizer": optimizer_meta,
                "outbox": outbox}
    write_atomically(state_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())  # fsyncs state_dir
    for old in state_dir.glob("ckpt-*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _outbox_files(state_dir: Path, manifest: dict[str, Any] | None) -> dict[str, Path]:
    if not manifest:
        return {}
    directory = state_dir / manifest["directory"]
    return {e["meta"]["update_id"]: directory / e["file"] for e in manifest["outbox"]
            if (directory / e["file"]).is_file()}


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# loading -----------------------------------------------------------------------------------------

def load_checkpoint(state_dir: Path, identity: dict[str, Any]) -> WorkerCheckpoint | None:
    """The checkpoint in ``state_dir``, or None if there is none.

    Raises CheckpointError (one line naming --fresh and --state-dir) when it belongs to another
    setup (identity differs) or is unreadable, rather than silently mixing two runs.
    """
    state_dir = Path(state_dir)
    manifest = _read_manifest(state_dir)
    if manifest is None:
        return None
    if "dataset" not in manifest["identity"]:  # written before checkpoints recorded their data: not checked
        identity = {k: v for k, v in identity.items() if k != "dataset"}
    differences = identity_differences(manifest["identity"], identity)
    if any(d.startswith("dataset.") for d in differences):  # a hash says nothing to a person: name the file
        trained_on = manifest["progress"].get("dataset") or "another file"
        differences = [d for d in differences if not d.startswith("dataset.")]
        differences.append(f"it was trained on {trained_on}, --dataset now has other content")
    if differences:
        raise CheckpointError(f"--state-dir {state_dir} holds a checkpoint of another setup "
                              f"({'; '.join(differences)}); pass --fresh to discard it, or choose another "
                              "--state-dir or --worker-id")
    directory = state_dir / manifest["directory"]
    try:
        tensors = {name: load_file(directory / f"{name}.safetensors") if name in manifest["tensors"] else {}
                   for name in TENSOR_FILES}
        outbox = [((directory / e["file"]).read_bytes(), e["meta"]) for e in manifest["outbox"]]
        optimizer = unflatten_optimizer(tensors["optimizer"], manifest["optimizer"])
    except (InvalidPayload, OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"--state-dir {state_dir}: checkpoint {directory.name} is damaged ({exc}); "
                              "pass --fresh to discard it") from None
    return WorkerCheckpoint(identity=manifest["identity"], progress=manifest["progress"],
                            adapter=tensors["adapter"], reference=tensors["reference"], pulled=tensors["pulled"],
                            residual=tensors["residual"], optimizer=optimizer, outbox=outbox)


def _read_manifest(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"--state-dir {state_dir}: cannot read {MANIFEST} ({exc}); "
                              "pass --fresh to discard it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"--state-dir {state_dir}: {MANIFEST} is not a format-{FORMAT} worker checkpoint; "
                              "pass --fresh to discard it")
    return manifest


def identity_differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Readable differences between two identities, nested dicts compared field by field."""
    saved, expected = json.loads(json.dumps(saved)), json.loads(json.dumps(expected))  # tuples -> lists
    out = []
    for key in sorted(saved.keys() | expected.keys()):
        a, b = saved.get(key), expected.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{d}" for d in identity_differences(a, b)]
        elif a != b:
            out.append(f"{key} {_short(a)} in the checkpoint, {_short(b)} now")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def discard_checkpoint(state_dir: Path) -> int:
    """Delete the checkpoint in ``state_dir`` (for --fresh); returns how many queued updates it dropped."""
    state_dir = Path(state_dir)
    try:
        manifest = _read_manifest(state_dir)
    except CheckpointError:
        manifest = None
    (state_dir / MANIFEST).unlink(missing_ok=True)
    for old in state_dir.glob("ckpt-*"):
        shutil.rmtree(old, ignore_errors=True)
    return len(manifest["outbox"]) if manifest else 0
