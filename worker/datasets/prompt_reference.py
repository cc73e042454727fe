"""FedMoE's own format: `prompt` (the user turn) and `reference_code` (the answer), one turn."""
from __future__ import annotations

from typing import Any, Mapping

from worker.datasets.base import DatasetFormat, Example, text_field


def parse(row: Mapping[str, Any]) -> Example:
    return Example(prompt=text_field(row, "prompt"), reference_code=text_field(row, "reference_code"))


FORMAT = DatasetFormat("prompt-reference", ("prompt", "reference_code"), parse)
