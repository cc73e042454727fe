"""Plain text for continued pre-training: `text`. No chat template; the loss is on every token,
and documents are packed end to end (each closed by the end-of-sequence token) into windows of
--max-seq-len tokens (worker.data.encode_examples)."""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import DatasetFormat, Example, text_field


def parse(row: Mapping[str, Any]) -> Example:
    return Example(prompt="", reference_code=text_field(row, "text"), plain_text=True)


FORMAT = DatasetFormat("text", ("text",), parse)
