"""Worker-side data: examples, the held-out split, tokenisation with the model's chat template, batches.

Reading files in every supported format is worker.datasets' (JSONL, JSON, CSV, Parquet,
save_to_disk directories; prompt/reference_code, prompt/completion, OpenAI messages, Alpaca,
ShareGPT, plain text). Here a conversation is tokenised with the model's chat template and the
loss is taken on the assistant turns only: every other token is labelled IGNORE_INDEX. Plain text
is learnt on every token, its documents packed into windows of max_seq_len tokens.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from worker.datasets import DatasetError, Example, Turn, load_examples

__all__ = ["IGNORE_INDEX", "Batch", "BatchStream", "DatasetError", "Example", "StreamPosition", "Turn", "collate",
           "dataset_sha256", "encode_example", "encode_examples", "load_examples", "pad_token_id",
           "prompt_token_ids", "sample_dataset_path", "split_examples"]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value that cross-entropy skips (prompt and padding positions)."""

SAMPLE_DATA_DIR = Path(__file__).resolve().parent.parent / "data"

# For a tokenizer without a chat template: each non-assistant turn is its text and a newline, each
# answer its text and the end-of-sequence token (the single-turn encoding FedMoE always used).
PLAIN_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                  "{{ message['content'] + (eos_token or '') }}{% else %}{{ message['content'] + '\n' }}{% endif %}"
                  "{% endfor %}")
_told_plain: set[str] = set()


def dataset_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of the dataset's bytes: what a checkpoint records to refuse resuming on other data.

    The content, not path + size + mtime: the same file copied, moved or checked out again is the
    same dataset, and an edit that keeps the size and the mtime is not. A directory (save_to_disk,
    or data files) hashes each file's relative path and bytes, in path order.
    """
    path = Path(path)
    digest = hashlib.sha256()
    try:
        if not path.is_dir():
            _hash_file(digest, path)
            return digest.hexdigest()
        for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            digest.update(f"\0{file.relative_to(path).as_posix()}\0".encode("utf-8"))
            _hash_file(digest, file)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset ({exc})") from exc
    return digest.hexdigest()


def _hash_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)


def _unit_hash(text: str) -> float:
    """A number in [0, 1) fixed by the text alone (sha1; same on every machine)."""
    digest = hashlib.sha1(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def split_examples(examples: Sequence[Example], heldout_fraction: float = 0.1) -> tuple[list[Example], list[Example]]:
    """Split into (train, heldout) by a stable hash of each example's prompt, or of its --split-key group.

    An example is held out when sha1(prompt) maps below heldout_fraction, so the split does not
    depend on file order or machine, and duplicated prompts land on the same side. Grouped examples
    (Example.group) hash the group instead, so a whole group falls on one side and the fraction is
    one of groups. With two or more distinct prompts (or groups) and a positive fraction, at least
    one is held out and at least one is kept.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    scores = [_unit_hash(ex.split_text) for ex in examples]
    held = [score < heldout_fraction for score in scores]
    distinct = set(scores)
    if heldout_fraction > 0 and len(distinct) == 1 and examples and examples[0].group and len(examples) > 1:
        raise DatasetError(f"--split-key: all {len(examples)} rows share the value {examples[0].group!r}, so "
                           "nothing can be held out without splitting that group; pass --eval-dataset FILE or "
                           "group by another field")
    if heldout_fraction > 0 and len(distinct) >= 2:
        if not any(held):
            held = [score == min(distinct) for score in scores]
        if all(held):
            held = [score != max(distinct) for score in scores]
    train = [ex for ex, h in zip(examples, held) if not h]
    heldout = [ex for ex, h in zip(examples, held) if h]
    return train, heldout


def sample_dataset_path(specialty: str) -> Path | None:
    """The shipped sample dataset data/<specialty>.jsonl, or None if there is none."""
    if not specialty or os.sep in specialty or "/" in specialty or specialty.startswith("."):
        return None
    path = SAMPLE_DATA_DIR / f"{specialty}.jsonl"
    return path if path.is_file() else None


def chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template, or the plain fallback (said once per tokenizer in the log)."""
    if tokenizer.chat_template:
        return tokenizer.chat_template
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if name not in _told_plain:
        _told_plain.add(name)
        log.warning("the tokenizer of %s has no chat template: turns are joined as plain text (each user or "
                    "system turn and a newline, each answer and the end-of-sequence token)", name)
    return PLAIN_TEMPLATE


def _render(tokenizer: PreTrainedTokenizerBase, template: str, turns: Sequence[Turn], generation: bool) -> str:
    messages = [{"role": t.role, "content": t.content} for t in turns]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation)
    assert isinstance(text, str)  # tokenize=False renders text
    return text


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The tokens that precede the answer: the chat-formatted user turn plus the assistant header."""
    has_template = bool(tokenizer.chat_template)
    text = _render(tokenizer, chat_template(tokenizer), [Turn("user", prompt)], True)
    return tokenizer(text, add_special_tokens=not has_template)["input_ids"]


def chat_pieces(tokenizer: PreTrainedTokenizerBase, turns: Sequence[Turn]) -> list[tuple[str, bool]]:
    """The conversation as the template renders it, cut into alternating (text, learnt) pieces.

    Even pieces are the template's text up to an answer (learnt False); odd pieces are the
    answers, learnt unless the turn says otherwise. Each answer's place is where the template's
    rendering of the turns before it, with the assistant header, ends; the end-of-sequence token
    that closes it is skipped here and added to the answer by the caller.
    """
    template = chat_template(tokenizer)
    full = _render(tokenizer, template, turns, False)
    pieces: list[tuple[str, bool]] = []
    done = 0
    for index, turn in enumerate(turns):
        if turn.role != "assistant" or not turn.trained:
            continue
        head = _render(tokenizer, template, turns[:index], True)
        answer = _answer_at(full, head, turn.content, index)
        pieces += [(full[done:len(head)], False), (answer, True)]
        done = len(head) + len(answer)
        eos = tokenizer.eos_token
        if isinstance(eos, str) and eos and full.startswith(eos, done):
            done += len(eos)
    return pieces


def _answer_at(full: str, head: str, content: str, index: int) -> str:
    """The answer as the template wrote it right after head (as given, or trimmed as some templates do)."""
    if full.startswith(head):
        for candidate in (content, content.strip()):
            if candidate and full.startswith(candidate, len(head)):
                return candidate
    raise DatasetError(f"the model's chat template does not render turn {index + 1} (an answer) right after the "
                       "turns before it, so its tokens cannot be told apart (a template that rewrites earlier "
                       f"turns?); conversation starting {full[:60]!r}: train on single-turn rows instead")


def encode_example(tokenizer: PreTrainedTokenizerBase, example: Example, max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels for one example; labels are IGNORE_INDEX on every token not learnt.

    Each answer ends with the tokenizer's end-of-sequence token (`<|im_end|>` for ChatML models)
    so the model learns to stop. When the example is longer than max_seq_len, what precedes the
    first answer keeps its tail and the rest its head; the part before gets at most
    max(max_seq_len - len(rest), max_seq_len // 2) tokens, so at least half the window (or all
    of the rest) stays. Plain text is its tokens, all learnt, cut to max_seq_len.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    if example.plain_text:
        ids = document_ids(tokenizer, example.reference_code)[:max_seq_len]
        return ids, list(ids)
    ids, labels = _conversation_ids(tokenizer, example.turns)
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    if len(ids) > max_seq_len:
        keep_prompt = min(first, max(max_seq_len - (len(ids) - first), max_seq_len // 2))
        keep = list(range(first - keep_prompt, first)) + list(range(first, first + max_seq_len - keep_prompt))
        ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    return ids, labels


def _conversation_ids(tokenizer: PreTrainedTokenizerBase, turns: Sequence[Turn]) -> tuple[list[int], list[int]]:
    """Each piece tokenised by itself (so a prompt's tokens never merge with its answer's), then joined."""
    plain = not tokenizer.chat_template
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    labels: list[int] = []
    for number, (text, learnt) in enumerate(chat_pieces(tokenizer, turns)):
        if number % 2 == 0:  # the template's text: the first piece gets BOS etc. when there is no template
            piece = tokenizer(text, add_special_tokens=plain and number == 0)["input_ids"] if text or number == 0 else []
            ids, labels = ids + piece, labels + [IGNORE_INDEX] * len(piece)
        else:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] + end
            ids, labels = ids + piece, labels + (piece if learnt else [IGNORE_INDEX] * len(piece))
    return ids, labels


def document_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A plain document's tokens (with the tokenizer's own BOS, if any), closed by end-of-sequence."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids


def encode_examples(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                    max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """What training and held-out loss run on: each conversation encoded by itself (encode_example),
    then the plain documents packed end to end into windows of max_seq_len tokens, every token learnt."""
    encoded = [encode_example(tokenizer, ex, max_seq_len) for ex in examples if not ex.plain_text]
    stream = [token for ex in examples if ex.plain_text for token in document_ids(tokenizer, ex.reference_code)]
    windows = [stream[i:i + max_seq_len] for i in range(0, len(stream), max_seq_len)]
    return encoded + [(window, list(window)) for window in windows if len(window) >= 2]


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
