"""One request on its way through the engine: its tokens in, its text out, as events.

The engine thread calls ``accept`` with each new token; the HTTP thread reads ``events``.
Text is decoded from all tokens so far (a token can end in the middle of a UTF-8 character, and
a stop sequence can span tokens), and only the part that can no longer change is sent: an
incomplete character or the start of a possible stop sequence is held back until it resolves.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from serving.adapters import LoadedAdapter
from serving.schema import CompletionRequest

START, TEXT, END, BUSY, FAILED = "start", "text", "end", "busy", "failed"


@dataclass(eq=False)
class Job:
    request: CompletionRequest
    prompt_ids: list[int]
    adapter: LoadedAdapter
    deadline: float
    """time.monotonic() after which generation stops (finish_reason "length")."""
    route: dict[str, Any] = field(default_factory=dict)
    """How "auto" chose the adapter: confidence and routing time (empty for a named model)."""
    mixture: tuple[tuple[LoadedAdapter, float], ...] = ()
    """A soft mixture: (adapter, weight) pairs whose low-rank terms all answer, weighted; empty: ``adapter``
    alone. ``adapter`` is then the mixture's heaviest member (what the response names)."""
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    """time.monotonic() of the first generated token (time to first token = this - submitted_at)."""
    events: "queue.Queue[tuple[str, Any]]" = field(default_factory=queue.Queue)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    """Set by the HTTP thread when the client went away; the row stops at its next token."""
    _text: str = ""
    _sent: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mixture_weights(self) -> tuple[tuple[LoadedAdapter, float], ...]:
        """The adapters that answer and their weights: the mixture, or ``adapter`` at weight 1."""
        return self.mixture or ((self.adapter, 1.0),)

    @property
    def pinned(self) -> list[LoadedAdapter]:
        """Every adapter this job holds in the registry (each released once when it ends)."""
        return [a for a, _ in self.mixture] or [self.adapter]

    def accept(self, token: int, tokenizer: PreTrainedTokenizerBase, stop_ids: frozenset[int]) -> None:
        """Take the next generated token (engine thread); sends what text became final."""
        if self.finished:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.cancelled:
            return self._finish("cancelled")
        if token in stop_ids:
            return self._finish("stop")
        self.tokens.append(token)
        self._text = str(tokenizer.decode(self.tokens, skip_special_tokens=True))  # one sequence: a str
        cut = self._stop_at()
        if cut is not None:
            self._text = self._text[:max(cut, self._sent)]
            return self._finish("stop")
        if len(self.tokens) >= self.request.max_tokens or time.monotonic() > self.deadline:
            return self._finish("length")
        self._send(self._stable_end())

    def close(self, reason: str = "length") -> None:
        """Generation ended without this row deciding to stop (engine thread)."""
        if not self.finished:
            self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._send(len(self._text))
        self.events.put((END, reason))

    def _send(self, end: int) -> None:
        if end > self._sent:
            self.events.put((TEXT, self._text[self._sent:end]))
            self._sent = end

    def _stop_at(self) -> int | None:
        """Index where the first stop sequence starts, searching only text not yet sent."""
        hits = [i for s in self.request.stop
                if (i := self._text.find(s, max(0, self._sent - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _stable_end(self) -> int:
        """How much of the text can be sent: not a trailing half character, nor a stop sequence's start."""
        end = len(self._text)
        if self._text.endswith("\ufffd"):
            end -= 1
        for s in self.request.stop:
            for n in range(min(len(s) - 1, len(self._text)), 0, -1):
                if self._text.endswith(s[:n]):
                    end = min(end, len(self._text) - n)
                    break
        return max(end, self._sent)
