"""OpenAI's chat format: `messages`, a list of {"role": system|user|assistant, "content": ...}.

As in OpenAI's fine-tuning files, `content` may be a list of {"type": "text", "text": ...} parts
and an assistant message may carry `"weight": 0` to keep it out of the loss. Multi-turn chats are
learnt on every (weighted) assistant turn and nothing else.
"""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import ROLES, DatasetFormat, Example, Turn, conversation_example


def message_content(message: Mapping[str, Any], where: str) -> str:
    """A message's text: a string, or the text parts of a list joined."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ValueError(f'{where}: only text parts ({{"type": "text", "text": ...}}) can be trained on')
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError(f'{where} "content" must be a string, got {type(content).__name__}')
    return content


def chat_turns(messages: Any, key: str) -> list[Turn]:
    """The turns of an OpenAI-style message list found under row[key]."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{key}" must be a non-empty list of messages')
    turns = []
    for number, message in enumerate(messages, start=1):
        where = f'"{key}" message {number}'
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f'{where} has role {role!r}; FedMoE trains on {", ".join(ROLES)} messages')
        weight = message.get("weight")
        weight = 1 if weight is None else weight  # None: absent (Arrow gives every struct every key)
        if weight not in (0, 1):
            raise ValueError(f'{where} has weight {weight!r}; OpenAI\'s format allows 0 or 1')
        turns.append(Turn(role, message_content(message, where), trained=weight == 1))
    return turns


def parse(row: Mapping[str, Any]) -> Example:
    return conversation_example(chat_turns(row.get("messages"), "messages"))


FORMAT = DatasetFormat("messages", ("messages",), parse)
