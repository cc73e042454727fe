"""Stanford Alpaca's format: `instruction`, an optional `input`, and the `output` to learn.

The user turn is the instruction, then a blank line and the input when there is one. As in
LLaMA-Factory's Alpaca files, an optional `system` string and an optional `history` of
[user, assistant] pairs before the instruction are understood too (earlier answers are learnt as well).
"""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import DatasetFormat, Example, Turn, text_field


def history_turns(history: Any) -> tuple[Turn, ...]:
    if history is None:
        return ()
    if not isinstance(history, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history):
        raise ValueError('"history" must be a list of [user, assistant] string pairs')
    return tuple(Turn(role, text) for pair in history for role, text in zip(("user", "assistant"), pair))


def parse(row: Mapping[str, Any]) -> Example:
    instruction = text_field(row, "instruction")
    extra = text_field(row, "input", required=False)
    system = text_field(row, "system", required=False)
    context = ((Turn("system", system),) if system.strip() else ()) + history_turns(row.get("history"))
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return Example(prompt=prompt, reference_code=text_field(row, "output"), context=context)


FORMAT = DatasetFormat("alpaca", ("instruction", "output"), parse)
