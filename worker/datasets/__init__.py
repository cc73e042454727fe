"""Dataset formats: one reader per row layout, chosen by name or detected from the first rows.

    prompt-reference   {"prompt", "reference_code"}               FedMoE's own, one turn
    prompt-completion  {"prompt", "completion"}                   TRL; strings or message lists
    messages           {"messages": [{"role", "content"}]}        OpenAI chat, multi-turn
    alpaca             {"instruction", "input"?, "output"}        Stanford Alpaca
    sharegpt           {"conversations": [{"from", "value"}]}     ShareGPT, multi-turn
    text               {"text"}                                   continued pre-training, packed

`load_examples` reads any file or directory worker.datasets.files understands and returns one
Example per row. Tokenisation (chat template, labels, packing) is worker.data's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from worker.choices import DATASET_FORMATS
from worker.datasets import alpaca, messages, prompt_completion, prompt_reference, sharegpt, text
from worker.datasets.base import DatasetError, DatasetFormat, Example, Turn
from worker.datasets.files import Row, read_rows

__all__ = ["FORMATS", "DatasetError", "DatasetFormat", "Example", "Turn", "detect_format", "load_examples"]

FORMATS: dict[str, DatasetFormat] = {f.name: f for f in (
    messages.FORMAT, sharegpt.FORMAT, alpaca.FORMAT, prompt_reference.FORMAT, prompt_completion.FORMAT, text.FORMAT)}
"""By name, in detection order: the first whose keys every sampled row has wins."""
DETECTION_ROWS = 8
"""Rows looked at to detect the format."""
ACCEPTED = "; ".join(f"{name} ({' + '.join(f.keys)})" for name, f in FORMATS.items())


def load_examples(path: str | os.PathLike, dataset_format: str = "auto", split_key: str | None = None) -> list[Example]:
    """Every row of the dataset as an Example; DatasetError (one line naming the file and row) otherwise.

    dataset_format "auto" detects the format from the first rows. split_key names a field whose value
    groups rows for the held-out split (worker.data.split_examples).
    """
    path = Path(path)
    rows = read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: no examples (the file is empty); expected rows in one of these formats: "
                           f"{ACCEPTED}")
    chosen = detect_format(path, rows) if dataset_format == "auto" else _named(dataset_format)
    return [_example(chosen, row, split_key) for row in rows]


def detect_format(path: Path, rows: Sequence[Row]) -> DatasetFormat:
    """The format whose keys most of the first DETECTION_ROWS rows have (the first listed on a tie).

    Most, not all: one broken row among the first should get its own message ("line 3: missing
    ...") from the format the others show, not a verdict that the file has no format.
    """
    sample = rows[:DETECTION_ROWS]
    fits = {name: sum(all(key in row.values for key in f.keys) for row in sample) for name, f in FORMATS.items()}
    best = max(fits, key=lambda name: fits[name])  # max keeps the first of equals: FORMATS is in priority order
    if fits[best]:
        return FORMATS[best]
    found = sorted({key for row in sample for key in row.values})
    raise DatasetError(f"{path}: no known dataset format fits its first rows (keys found: "
                       f"{', '.join(found) or 'none'}); accepted: {ACCEPTED}; or force one with --dataset-format")


def _named(name: str) -> DatasetFormat:
    if name not in FORMATS:
        raise DatasetError(f"--dataset-format must be one of {', '.join(DATASET_FORMATS)}, got {name!r}")
    return FORMATS[name]


def _example(chosen: DatasetFormat, row: Row, split_key: str | None) -> Example:
    try:
        example = chosen.parse(row.values)
    except ValueError as exc:
        raise DatasetError(f"{row.where}: {exc} (reading it as {chosen.name})") from None
    if split_key is None:
        return example
    return Example(example.prompt, example.reference_code, example.context, example.plain_text,
                   group=_group(row, split_key))


def _group(row: Row, split_key: str) -> str:
    value: Any = row.values.get(split_key)
    if value is None:
        raise DatasetError(f'{row.where}: no "{split_key}" (--split-key); every row needs the field it is grouped by')
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


