"""Rows out of a dataset file or directory, each with the place a message should name.

JSON Lines (.jsonl, .ndjson) is read here, strictly, line by line: it is the format FedMoE ships
and most people hand a worker, and a parser of its own names the bad line (pyarrow's reader names
a 0-based row, after an Arrow copy of the file) and costs no import. Everything else goes through
Hugging Face `datasets`, offline: .json (an array or JSON Lines), .csv, .tsv, .parquet, .arrow,
.txt (one `text` row per blank-line-separated paragraph, as `load_dataset("text",
sample_by="paragraph")` gives), a directory written by `Dataset.save_to_disk`, or a directory of
such files (`load_dataset(DIR)`). `datasets` prepares an Arrow copy in a cache directory; a
temporary one is used and removed, so a worker leaves nothing behind and never reads a stale copy.
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from worker.datasets.base import DatasetError

log = logging.getLogger(__name__)

JSON_LINES = (".jsonl", ".ndjson")
BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".json": ("json", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"sep": "\t"}), ".parquet": ("parquet", {}),
    ".arrow": ("arrow", {}), ".txt": ("text", {"sample_by": "paragraph"}),
}
"""File suffix -> the `datasets` builder that reads it, and its options."""
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `save_to_disk` writes: a directory holding one is read with `load_from_disk`."""
ACCEPTED = ", ".join(JSON_LINES + tuple(BUILDERS)) + " files, or a directory (save_to_disk or data files)"


@dataclass(frozen=True)
class Row:
    where: str
    """The row's place for messages: "data.jsonl line 3", "data.csv row 3"."""
    values: Mapping[str, Any]


def read_rows(path: Path) -> list[Row]:
    """Every row of the dataset at path; DatasetError (one line) if it cannot be read."""
    if path.is_dir():
        return _directory_rows(path)
    if not path.is_file():
        raise DatasetError(f"{path}: cannot read dataset (no such file or directory)")
    suffix = path.suffix.lower()
    if suffix in JSON_LINES:
        return _json_lines(path)
    if suffix in BUILDERS:
        builder, options = BUILDERS[suffix]
        return _builder_rows(path, lambda cache: _datasets().load_dataset(
            builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True, **options))
    raise DatasetError(f"{path}: cannot tell the file type from {suffix or 'a name without a suffix'!r}; "
                       f"FedMoE reads {ACCEPTED}")


def _json_lines(path: Path) -> list[Row]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read dataset ({exc})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):  # physical lines, as an editor numbers them
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            values = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(values, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(values).__name__}")
        rows.append(Row(where, values))
    return rows


def _directory_rows(path: Path) -> list[Row]:
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        return _builder_rows(path, lambda cache: _train_split(path, _datasets().load_from_disk(str(path),
                                                                                                 keep_in_memory=True)))
    return _builder_rows(path, lambda cache: _datasets().load_dataset(str(path), split="train", cache_dir=cache,
                                                                      keep_in_memory=True))


def _train_split(path: Path, loaded: Any) -> Any:
    """A save_to_disk DatasetDict's "train" split (or its only one); a Dataset as it is."""
    if not hasattr(loaded, "keys"):
        return loaded
    splits = list(loaded.keys())
    if "train" in splits or len(splits) == 1:
        return loaded["train" if "train" in splits else splits[0]]
    raise DatasetError(f"{path}: a dataset with splits {', '.join(splits)} and none named train; "
                       "save the split to train on by itself")


def _builder_rows(path: Path, load: Any) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="fedmoe-datasets-") as cache:
        try:
            dataset = load(cache)
        except DatasetError:
            raise
        except Exception as exc:  # datasets wraps pyarrow, pandas and its own errors in several types
            raise DatasetError(f"{path}: cannot read it with the datasets library ({_root_cause(exc)})") from None
        label = "row" if path.is_dir() or path.suffix.lower() != ".txt" else "paragraph"
        return [Row(f"{path} {label} {number}", values) for number, values in enumerate(dataset.to_list(), start=1)]


def _root_cause(exc: BaseException) -> str:
    """The innermost error's message on one line: datasets' own says only that generation failed."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _datasets() -> Any:
    """The `datasets` module, quiet (no progress bars, warnings only), imported on first use (~3 s)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets
