"""Worker-side data: JSONL examples, the held-out split, chat encoding with answer-only labels, batches.

A dataset is JSONL with one object per line holding a non-empty string `prompt` and a non-empty
string `reference_code` (the answer). Other keys are ignored. The loss is taken on answer tokens
only: every prompt token is labelled IGNORE_INDEX.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from worker.errors import WorkerError

IGNORE_INDEX = -100
"""Label value that cross-entropy skips (prompt and padding positions)."""

SAMPLE_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
REQUIRED_FIELDS = ("prompt", "reference_code")


class DatasetError(WorkerError):
    """A dataset file that cannot be used; the message names the file and, when known, the line."""


@dataclass(frozen=True)
class Example:
    prompt: str
    """What the user asks (the chat's user turn)."""
    reference_code: str
    """The answer the model should learn to give (the assistant turn)."""


def load_examples(path: str | os.PathLike) -> list[Example]:
    """Read a JSONL dataset; blank lines are skipped, any bad line raises DatasetError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read dataset ({exc})") from exc
    examples = [_parse_line(path, number, line)
                for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not examples:
        raise DatasetError(f"{path}: no examples (the file is empty); expected JSONL with "
                           f'"prompt" and "reference_code" on every line')
    return examples


def dataset_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of the dataset file's bytes: what a checkpoint records to refuse resuming on other data.

    The content, not path + size + mtime: the same file copied, moved or checked out again is the
    same dataset, and an edit that keeps the size and the mtime is not.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset ({exc})") from exc
    return digest.hexdigest()


def _parse_line(path: Path, number: int, line: str) -> Example:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in REQUIRED_FIELDS:
        if key not in record:
            raise DatasetError(f'{where}: missing "{key}"')
        if not isinstance(record[key], str):
            raise DatasetError(f'{where}: "{key}" must be a string, got {type(record[key]).__name__}')
        if not record[key].strip():
            raise DatasetError(f'{where}: "{key}" is empty')
    return Example(prompt=record["prompt"], reference_code=record["reference_code"])


def _unit_hash(prompt: str) -> float:
    """A number in [0, 1) fixed by the prompt's text alone (sha1; same on every machine)."""
    digest = hashlib.sha1(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def split_examples(examples: Sequence[Example], heldout_fraction: float = 0.1) -> tuple[list[Example], list[Example]]:
    """Split into (train, heldout) by a stable hash of each prompt.

    An example is held out when sha1(prompt) maps below heldout_fraction, so the split does not
    depend on file order or machine, and duplicated prompts land on the same side. With two or
    more examples and a positive fraction, at least one is held out and at least one is kept.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    scores = [_unit_hash(ex.prompt) for ex in examples]
    held = [score < heldout_fraction for score in scores]
    if heldout_fraction > 0 and len(examples) >= 2:
        if not any(held):
            held[scores.index(min(scores))] = True
        if all(held):
            held[scores.index(max(scores))] = False
    train = [ex for ex, h in zip(examples, held) if not h]
    heldout = [ex for ex, h in zip(examples, held) if h]
    return train, heldout


def sample_dataset_path(specialty: str) -> Path | None:
    """The shipped sample dataset data/<specialty>.jsonl, or None if there is none."""
    if not specialty or os.sep in specialty or "/" in specialty or specialty.startswith("."):
        return None
    path = SAMPLE_DATA_DIR / f"{specialty}.jsonl"
    return path if path.is_file() else None


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The tokens that precede the answer: the chat-formatted user turn plus the assistant header."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt + "\n")["input_ids"]


def encode_example(tokenizer: PreTrainedTokenizerBase, example: Example, max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels for one example; labels are IGNORE_INDEX on every prompt token.

    The answer ends with the tokenizer's end-of-sequence token (`<|im_end|>` for ChatML models)
    so the model learns to stop. When the pair is longer than max_seq_len, the prompt keeps its
    tail and the answer its head; the prompt gets at most max(max_seq_len - len(answer),
    max_seq_len // 2) tokens, so at least half the window (or the whole answer) stays answer.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    prompt_ids = prompt_token_ids(tokenizer, example.prompt)
    answer_ids = tokenizer(example.reference_code, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    if len(prompt_ids) + len(answer_ids) > max_seq_len:
        keep_prompt = min(len(prompt_ids), max(max_seq_len - len(answer_ids), max_seq_len // 2))
        prompt_ids = prompt_ids[len(prompt_ids) - keep_prompt:]
        answer_ids = answer_ids[:max_seq_len - keep_prompt]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id used for padding: the pad token, else end-of-sequence, else 0 (masked out anyway)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    """[batch, length] token ids, right-padded."""
    attention_mask: torch.Tensor
    """[batch, length] 1 for real tokens, 0 for padding."""
    labels: torch.Tensor
    """[batch, length] targets aligned with input_ids; IGNORE_INDEX on prompt and padding."""

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


def collate(encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-pad encoded examples into one batch (labels padded with IGNORE_INDEX)."""
    if not encoded:
        raise ValueError("cannot collate an empty batch")
    length = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    for row, (ids, labs) in enumerate(encoded):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, :len(labs)] = torch.tensor(labs, dtype=torch.long)
        attention_mask[row, :len(ids)] = 1
    return Batch(input_ids, attention_mask, labels)


@dataclass(frozen=True)
class StreamPosition:
    """Where a BatchStream stands: the epoch and the offset into that epoch's shuffled order."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, data: dict) -> StreamPosition:
        return cls(epoch=int(data["epoch"]), index=int(data["index"]))


class BatchStream:
    """An endless, seeded stream of batches over epochs, resumable from a StreamPosition.

    Each epoch visits every example once in an order fixed by (seed, epoch); a batch never spans
    two epochs, so the last batch of an epoch may be smaller. Restarting from `position` with the
    same examples and seed yields exactly the batches the original stream would have yielded.
    """

    def __init__(self, encoded: Sequence[tuple[list[int], list[int]]], batch_size: int, *, seed: int,
                 pad_id: int, position: StreamPosition = StreamPosition()):
        if not encoded:
            raise ValueError("BatchStream needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._encoded = list(encoded)
        self._batch_size = batch_size
        self._seed = seed
        self._pad_id = pad_id
        self._order_epoch: int | None = None
        self._order: list[int] = []
        self.seek(position)

    @property
    def position(self) -> StreamPosition:
        return StreamPosition(self._epoch, self._index)

    def seek(self, position: StreamPosition) -> None:
        if position.epoch < 0 or not 0 <= position.index < len(self._encoded):
            raise ValueError(f"position {position} is outside this stream of {len(self._encoded)} examples")
        self._epoch, self._index = position.epoch, position.index

    def epoch_order(self, epoch: int) -> list[int]:
        """The example indices in the order epoch `epoch` visits them."""
        if self._order_epoch != epoch:
            order = list(range(len(self._encoded)))
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        chosen = self.epoch_order(self._epoch)[self._index:self._index + self._batch_size]
        self._index += len(chosen)
        if self._index >= len(self._encoded):
            self._epoch, self._index = self._epoch + 1, 0
        return collate([self._encoded[i] for i in chosen], self._pad_id)
