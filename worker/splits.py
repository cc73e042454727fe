"""What a worker trains on and what it judges itself on: --dataset split by hash or --split-key
group, or --eval-dataset; a warning when near-duplicates straddle the two; the data fingerprint."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from worker.choices import DATASET_FORMATS
from worker.data import Example, dataset_sha256, load_examples, split_examples
from worker.datasets.overlap import near_duplicates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSettings:
    dataset_format: str = "auto"
    """How the rows are laid out (worker.datasets.FORMATS), or auto to detect it from the first rows."""
    split_key: str | None = None
    """A field whose value groups rows (e.g. DS-1000's perturbation_origin_id): a group is never split."""
    eval_dataset: Path | None = None
    """A held-out file of the user's own: then all of --dataset trains and this is what is scored."""
    heldout_fraction: float = 0.1
    """Share of --dataset's rows (or --split-key groups) held out when there is no eval_dataset."""

    def __post_init__(self) -> None:
        if self.dataset_format not in DATASET_FORMATS:
            raise ValueError(f"--dataset-format must be one of {', '.join(DATASET_FORMATS)}, "
                             f"got {self.dataset_format!r}")
        if self.split_key is not None and not self.split_key.strip():
            raise ValueError("--split-key needs a field name, e.g. perturbation_origin_id")
        if self.split_key is not None and self.eval_dataset is not None:
            raise ValueError("--split-key groups the split of --dataset, and --eval-dataset replaces that split; "
                             "pass one of them")


def training_data(dataset: Path, settings: DataSettings) -> tuple[list[Example], list[Example]]:
    """(train, heldout) examples; logs a warning when held-out prompts have near-copies in training."""
    examples = load_examples(dataset, settings.dataset_format, settings.split_key)
    if settings.eval_dataset is None:
        train, heldout = split_examples(examples, settings.heldout_fraction)
        source = f"the held-out {settings.heldout_fraction:.0%} of {dataset}"
    else:
        train, heldout = examples, load_examples(settings.eval_dataset, settings.dataset_format)
        source = f"--eval-dataset {settings.eval_dataset}"
    warn_near_duplicates(train, heldout, source)
    return train, heldout


def warn_near_duplicates(train: list[Example], heldout: list[Example], source: str) -> int:
    """Log one warning if held-out examples have near-copies among the training ones; how many do."""
    found = near_duplicates(train, heldout)
    if found:
        first = found[0]
        log.warning("%d of %d examples in %s have a near-duplicate prompt in training (e.g. %r ~ %r, similarity "
                    "%.2f): the held-out loss will flatter the model; group related rows with --split-key FIELD "
                    "or hold out a file of your own with --eval-dataset", len(found), len(heldout), source,
                    _snippet(heldout[first.heldout]), _snippet(train[first.train]), first.similarity)
    return len(found)


def _snippet(example: Example) -> str:
    text = " ".join((example.prompt or example.reference_code).split())
    return text if len(text) <= 60 else text[:57] + "..."


def data_fingerprint(dataset: Path, settings: DataSettings, *, packed: bool, max_seq_len: int) -> str:
    """What a checkpoint records to refuse resuming on other data.

    With the default settings it is the dataset's sha256, as checkpoints have always recorded. Settings
    that change what is trained (a forced format, a split key or fraction, an eval file, and for packed
    plain text the window length) are hashed in with it.
    """
    content = dataset_sha256(dataset)
    extra = {name: getattr(settings, name) for name in ("dataset_format", "split_key", "heldout_fraction")
             if getattr(settings, name) != getattr(DataSettings(), name)}
    if settings.eval_dataset is not None:
        extra["eval_dataset"] = dataset_sha256(settings.eval_dataset)
    if packed:
        extra["max_seq_len"] = max_seq_len  # documents are packed into windows of this many tokens
    if not extra:
        return content
    return hashlib.sha256(json.dumps({"sha256": content, **extra}, sort_keys=True).encode("utf-8")).hexdigest()
