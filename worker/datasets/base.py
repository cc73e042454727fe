"""What a dataset row becomes (an Example: one conversation, or one plain document), the shape of a
format reader, and the dataset error."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from worker.errors import WorkerError

ROLES = ("system", "user", "assistant")


class DatasetError(WorkerError):
    """A dataset that cannot be used; the message names the file and, when known, the row."""


@dataclass(frozen=True)
class Turn:
    """One message of a conversation."""

    role: str
    """system, user or assistant."""
    content: str
    """The message text."""
    trained: bool = True
    """For an assistant turn: the loss covers it (OpenAI's fine-tuning `"weight": 0` turns it off)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class Example:
    """One training example: a conversation that ends with the answer to learn, or a plain document.

    Single-turn data fills `prompt` and `reference_code` only. A multi-turn conversation keeps the
    turns before its last user turn in `context`; every trained assistant turn there is learnt too.
    """

    prompt: str
    """The last user turn (what the held-out split hashes and the router reads); "" for plain text."""
    reference_code: str
    """The answer the model learns (the last assistant turn), or the whole document for plain text."""
    context: tuple[Turn, ...] = ()
    """Turns before `prompt`: a system message and earlier user/assistant exchanges."""
    plain_text: bool = False
    """Continued pre-training text: no chat template, the loss on every token, packed to --max-seq-len."""
    group: str = ""
    """The row's --split-key value: every example of one group falls on the same side of the split."""

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The whole conversation: context, the user prompt and the answer (empty for plain text)."""
        if self.plain_text:
            return ()
        return self.context + (Turn("user", self.prompt), Turn("assistant", self.reference_code))

    @property
    def split_text(self) -> str:
        """What decides the example's side of the held-out split: its group, else its prompt (or text)."""
        if self.group:
            return "\0group\0" + self.group
        return self.reference_code if self.plain_text else self.prompt


def conversation_example(turns: list[Turn]) -> Example:
    """The Example of a conversation: trailing turns after the last trained answer carry no loss and go.

    Raises ValueError when there is no trained assistant turn or the last one does not answer a user turn.
    """
    opening = next((i for i, t in enumerate(turns) if t.role == "user"), len(turns))
    # an assistant turn before any user turn (a greeting) has nothing to answer: context, not learnt
    turns = [Turn(t.role, t.content, False) if i < opening and t.role == "assistant" else t
             for i, t in enumerate(turns)]
    last = max((i for i, t in enumerate(turns) if t.role == "assistant" and t.trained), default=None)
    if last is None:
        raise ValueError("no assistant turn to learn from")
    if last == 0 or turns[last - 1].role != "user":
        raise ValueError(f"turn {last + 1}, the last assistant turn, does not follow a user turn")
    return Example(prompt=turns[last - 1].content, reference_code=turns[last].content, context=tuple(turns[:last - 1]))


def text_field(row: Mapping[str, Any], key: str, *, required: bool = True) -> str:
    """row[key] as a non-empty string; ValueError naming the key otherwise ("" when optional and absent)."""
    value = row.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise ValueError(f'missing "{key}"')
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    if required and not value.strip():
        raise ValueError(f'"{key}" is empty')
    return value


@dataclass(frozen=True)
class DatasetFormat:
    """One way of laying out a row (worker.datasets.FORMATS holds them by name)."""

    name: str
    """The --dataset-format value."""
    keys: tuple[str, ...]
    """The keys every row has: a row with all of them is taken to be in this format."""
    parse: Callable[[Mapping[str, Any]], Example]
    """One row -> one Example; ValueError (a message without the row's place) for a bad row."""
