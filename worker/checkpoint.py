"""A worker's local checkpoint: what it needs to resume where it stopped, safe against kill -9.

Layout of a state dir (one per worker id, ``worker-state/<worker_id>`` by default):

    checkpoint.json          the manifest: identity, counters, outbox metadata, and which
                             directory holds the tensors; replaced atomically, written LAST
    ckpt-000042/             the tensors of sync 42 (safetensors) and the outbox bodies
        adapter.safetensors     local adapter at the sync point
        reference.safetensors   weights the next delta is measured from (usually absent: see below)
        pulled.safetensors      weights of the last pull (diff pulls decode against them)
        residual.safetensors    error-feedback residual (absent without a lossy codec)
        optimizer.safetensors   AdamW moments and step counts, flattened (see flatten_optimizer)
        outbox-0.bin ...        queued update bodies, byte for byte as they will be pushed

A save writes a fresh ``ckpt-<n>`` directory (every file fsynced), then swaps the manifest with
``protocol.files.write_atomically``, then deletes older directories. A kill at any point leaves
either the old manifest and its complete directory or the new ones; a half-written directory is
never referenced and is swept by the next save. No pickle anywhere: tensors are safetensors,
everything else JSON.

A checkpoint is written at every sync, so it writes as little as it can (``CheckpointWriter``):

- tensors go from memory straight into the file (``write_safetensors``), not through a bytes copy;
- a set that *is* another set of the same checkpoint is recorded as an alias in the manifest,
  not written twice: at a sync point the reference is the adapter's snapshot (worker.federation
  measures the next delta from it), and after a pull without residual it is the pulled weights;
- a set that is the very object the previous save wrote (the pulled weights between two pulls)
  and outbox bodies already on disk are hard-linked into the next directory instead of
  rewritten, so a long outage (a growing outbox) does not make every checkpoint rewrite all of it.

Format 1 (every set in its own file, no aliases) is still read.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.errors import InvalidPayload
from protocol.files import fsync_dir, write_atomically
from protocol.tensors import StateDict, load_file
from worker.errors import WorkerError

log = logging.getLogger(__name__)

FORMAT = 2
READABLE_FORMATS = (1, 2)
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

class CheckpointWriter:
    """Saves a state dir's checkpoints one after another, remembering what the last one wrote.

    Tensor sets are never mutated once captured (WorkerCheckpoint), so a set that is the same
    object as one the previous save wrote has the same bytes: its file is linked, not rewritten.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self._written: list[tuple[StateDict, Path]] = []
        """(tensor set, its file) of the last save, for linking."""
        self._sequence: int | None = None
        """The manifest sequence the last save wrote (links only from that checkpoint)."""

    def remember(self, checkpoint: WorkerCheckpoint) -> None:
        """After a resume: the tensor sets ``load_checkpoint`` returned are the files of the manifest on disk."""
        manifest = _read_manifest(self.state_dir)
        if manifest is None or manifest["progress"] != checkpoint.progress:
            return
        directory = self.state_dir / manifest["directory"]
        files = _set_files(manifest)
        sets = {"adapter": checkpoint.adapter, "reference": checkpoint.reference, "pulled": checkpoint.pulled,
                "residual": checkpoint.residual}
        self._written = [(tensors, directory / files[name]) for name, tensors in sets.items() if name in files]
        self._sequence = manifest["sequence"]

    def save(self, checkpoint: WorkerCheckpoint) -> Path:
        """Write ``checkpoint`` durably; returns its tensor directory. Old checkpoints go once it is in place."""
        state_dir = self.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        previous = _read_manifest(state_dir)
        number = (previous["sequence"] + 1) if previous else 0
        target = state_dir / f"ckpt-{number:06d}"
        if target.exists():  # left by a save that was killed before its manifest
            shutil.rmtree(target)
        target.mkdir()
        reusable = self._written if previous and previous["sequence"] == self._sequence else []
        optimizer_tensors, optimizer_meta = flatten_optimizer(checkpoint.optimizer)
        written: list[str] = []
        aliases: dict[str, str] = {}
        files: list[tuple[StateDict, Path]] = []
        for name, tensors in (("adapter", checkpoint.adapter), ("reference", checkpoint.reference),
                              ("pulled", checkpoint.pulled), ("residual", checkpoint.residual),
                              ("optimizer", optimizer_tensors)):
            if not tensors:  # safetensors 0.x writes an unreadable header for an empty dict: an absent file means {}
                continue
            same = next((other for other, (t, _) in zip(written, files) if t is tensors), None)
            if same is not None:
                aliases[name] = same
                continue
            path = target / f"{name}.safetensors"
            source = next((p for t, p in reusable if t is tensors), None)
            if not (source is not None and _link(source, path)):
                write_safetensors(path, tensors)
            written.append(name)
            files.append((tensors, path))
        linked = _outbox_files(state_dir, previous)
        outbox = []
        for i, (body, meta) in enumerate(checkpoint.outbox):
            path = target / f"outbox-{i}.bin"
            source = linked.get(meta["update_id"])
            if not (source is not None and source.stat().st_size == len(body) and _link(source, path)):
                _write_durably(path, body)
            outbox.append({"file": path.name, "meta": meta})
        fsync_dir(target)
        manifest = {"format": FORMAT, "sequence": number, "directory": target.name, "tensors": written,
                    "aliases": aliases, "identity": checkpoint.identity, "progress": checkpoint.progress,
                    "optimizer": optimizer_meta, "outbox": outbox}
        write_atomically(state_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())  # fsyncs state_dir
        # the optimizer's tensors are flattened afresh at every save: never linked, and not kept alive here
        self._written = [(t, p) for name, (t, p) in zip(written, files) if name != "optimizer"]
        self._sequence = number
        for old in state_dir.glob("ckpt-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        return target


def save_checkpoint(state_dir: Path, checkpoint: WorkerCheckpoint) -> Path:
    """Write ``checkpoint`` durably (one save, nothing remembered for the next); its tensor directory."""
    return CheckpointWriter(state_dir).save(checkpoint)


def _set_files(manifest: dict[str, Any]) -> dict[str, str]:
    """Tensor set name -> the file holding it in the manifest's directory (aliases resolved)."""
    files = {name: f"{name}.safetensors" for name in manifest["tensors"]}
    for name, same in manifest.get("aliases", {}).items():
        if same not in files:
            raise KeyError(f"alias {name!r} -> {same!r} names no file")
        files[name] = files[same]
    return files


def _outbox_files(state_dir: Path, manifest: dict[str, Any] | None) -> dict[str, Path]:
    if not manifest:
        return {}
    directory = state_dir / manifest["directory"]
    return {e["meta"]["update_id"]: directory / e["file"] for e in manifest["outbox"]
            if (directory / e["file"]).is_file()}


def _link(source: Path, path: Path) -> bool:
    """Hard-link a file of the previous checkpoint (already durable); False if it is gone or cannot be linked."""
    try:
        os.link(source, path)
    except OSError:
        return False
    return True


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: StateDict) -> None:
    """Write ``tensors`` as a safetensors file straight from their memory, then fsync it.

    ``safetensors.torch.save`` first builds the whole file as one bytes object (a copy of every
    tensor); this writes the header, then each CPU tensor's own buffer. The layout is the format's
    (https://github.com/huggingface/safetensors: 8-byte little-endian header size, a JSON header
    padded with spaces to 8 bytes, the data in header order), so ``load_file`` reads it back.
    """
    header: dict[str, Any] = {}
    views = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"cannot checkpoint tensor {name!r} of dtype {tensor.dtype}")
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + flat.numel()]}
        views.append(flat.numpy())
        offset += flat.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    if sys.byteorder != "little":  # the format is little-endian; tensors in memory here are not
        raise ValueError("checkpoints are written on little-endian machines only")
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for view in views:
            f.write(view)  # type: ignore[arg-type]  # a numpy array is a bytes-like buffer
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
        files = _set_files(manifest)
        loaded = {file: load_file(directory / file) for file in set(files.values())}
        tensors = {name: loaded[files[name]] if name in files else {} for name in TENSOR_FILES}
        outbox = [((directory / e["file"]).read_bytes(), e["meta"]) for e in manifest["outbox"]]
        optimizer = unflatten_optimizer(tensors["optimizer"], manifest["optimizer"])
    except (InvalidPayload, OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
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
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"--state-dir {state_dir}: {MANIFEST} is not a worker checkpoint of format "
                              f"{' or '.join(map(str, READABLE_FORMATS))}; pass --fresh to discard it")
    if problem := _manifest_problem(manifest):
        raise CheckpointError(f"--state-dir {state_dir}: {MANIFEST} is damaged ({problem}); pass --fresh to "
                              "discard it")
    return manifest


# What resuming reads from a manifest, and the JSON types it must have (a hand-edited or foreign manifest was a
# KeyError / TypeError traceback: audit, tests/worker/test_audit_checkpoint.py).
PROGRESS_TYPES: dict[str, type | tuple[type, ...]] = {
    "syncs": int, "base_version": int, "pulls": int, "global_step": int, "data_position": dict,
    "etag": (str, type(None))}


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the manifest's shape, or None."""
    for key, kind in (("identity", dict), ("progress", dict), ("tensors", list), ("outbox", list),
                      ("optimizer", dict), ("directory", str), ("aliases", dict)):
        if key == "aliases" and key not in manifest:
            continue  # format 1
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} must be a JSON {'object' if kind is dict else kind.__name__}, got {manifest.get(key)!r}"[:200]
    directory = manifest["directory"]
    if not directory or directory != Path(directory).name or directory in (".", ".."):
        return f"'directory' must name a directory inside the state dir, got {directory!r}"
    if not all(isinstance(name, str) for name in manifest["tensors"]) or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest.get("aliases", {}).items()):
        return "'tensors' and 'aliases' must hold tensor set names"
    for entry in manifest["outbox"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("meta"), dict)
                and entry["file"] == Path(entry["file"]).name and isinstance(entry["meta"].get("update_id"), str)):
            return f"an outbox entry must be {{'file': name, 'meta': {{'update_id': ...}}}}, got {entry!r}"[:200]
    progress = manifest["progress"]
    for key, expected in PROGRESS_TYPES.items():
        if key in progress and (not isinstance(progress[key], expected) or isinstance(progress[key], bool)):
            return f"progress.{key} has the wrong type: {progress[key]!r}"[:200]
    position = progress.get("data_position", {"epoch": 0, "index": 0})
    if not all(isinstance(position.get(k), int) for k in ("epoch", "index")):
        return f"progress.data_position must hold integers 'epoch' and 'index', got {position!r}"[:200]
    return None


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
