"""TRL's prompt-completion format: `prompt` and `completion`, each a string or a list of chat messages.

String pairs are one user turn and its answer, tokenised with the model's chat template like
every other format (TRL would concatenate plain strings without one).
"""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import DatasetFormat, Example, conversation_example, text_field
from worker.datasets.messages import chat_turns


def parse(row: Mapping[str, Any]) -> Example:
    if isinstance(row.get("prompt"), list) or isinstance(row.get("completion"), list):
        prompt = chat_turns(row.get("prompt"), "prompt")
        completion = chat_turns(row.get("completion"), "completion")
        return conversation_example(prompt + completion)
    return Example(prompt=text_field(row, "prompt"), reference_code=text_field(row, "completion"))


FORMAT = DatasetFormat("prompt-completion", ("prompt", "completion"), parse)

