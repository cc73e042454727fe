"""The ShareGPT format: `conversations`, a list of {"from": human|gpt|system, "value": ...}.

"user"/"assistant" are accepted as `from` values too (several exporters write them), and an
optional top-level `system` string opens the conversation. Every gpt turn is learnt.
"""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import DatasetFormat, Example, Turn, conversation_example, text_field

ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def parse(row: Mapping[str, Any]) -> Example:
    conversation = row.get("conversations")
    if not isinstance(conversation, list) or not conversation:
        raise ValueError('"conversations" must be a non-empty list of {"from", "value"} turns')
    system = text_field(row, "system", required=False)
    turns = [Turn("system", system)] if system.strip() else []
    for number, turn in enumerate(conversation, start=1):
        where = f'"conversations" turn {number}'
        if not isinstance(turn, Mapping) or not isinstance(turn.get("value"), str):
            raise ValueError(f'{where} must be an object with a string "value"')
        if turn.get("from") not in ROLE_OF:
            raise ValueError(f'{where} is from {turn.get("from")!r}; FedMoE trains on turns from '
                             f'{", ".join(ROLE_OF)}')
        turns.append(Turn(ROLE_OF[turn["from"]], turn["value"]))
    return conversation_example(turns)


FORMAT = DatasetFormat("sharegpt", ("conversations",), parse)
