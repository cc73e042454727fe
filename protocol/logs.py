"""Logging set-up shared by the three scripts: readable lines, or one JSON object per line.

``--log-format json`` is for machines (log shippers, jq): every record becomes one JSON object
with its time, level, logger and message, plus any structured fields the caller passed with
``extra={...}`` (the worker's per-sync line carries its whole metrics record that way).
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line; fields from ``extra=`` are kept as they are."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": round(record.created, 3), "level": record.levelname,
                                 "logger": record.name, "message": record.getMessage()}
        entry |= {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str = "text", level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Send the root logger's records to ``stream`` (stderr) as text lines or JSON objects."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
