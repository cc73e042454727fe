"""Logging set-up shared by the three scripts: readable lines, or one JSON object per line.

``--log-format json`` is for machines (log shippers, jq): every record becomes one JSON object
with its time, level, logger and message, plus any structured fields the caller passed with
``extra={...}`` (the worker's per-sync line carries its whole metrics record that way).

Colour: some libraries colour their lines (werkzeug's request log under ``--debug``); the codes are
kept only when the stream is a terminal, so log files and pipes get plain text. Libraries that add
their own stderr handler and still propagate (huggingface_hub) would print every line twice: their
handler is taken off, and their records come out once, through ours, in our format.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
OWN_HANDLER_LIBRARIES = ("huggingface_hub",)
"""Loggers whose library adds a handler of its own on import while still propagating to the root."""


class PlainFormatter(logging.Formatter):
    """Text lines without terminal colour codes (for files and pipes)."""

    def format(self, record: logging.LogRecord) -> str:
        return _ANSI.sub("", super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line; fields from ``extra=`` are kept as they are."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": round(record.created, 3), "level": record.levelname,
                                 "logger": record.name, "message": _ANSI.sub("", record.getMessage())}
        entry |= {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is when the record is emitted, as logging's own last-resort
    handler does, not to the stream stderr was at set-up: a program (or a test harness) that swaps stderr later
    gets the lines, and a background thread never writes to a stream closed since (a "--- Logging error ---")."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr


def configure_logging(log_format: str = "text", level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Send the root logger's records to ``stream`` (default: stderr, whatever it is at each record) as text lines
    or JSON objects."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream) if stream is not None else StderrHandler()
    stream = stream or sys.stderr
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT) if _is_terminal(stream) else PlainFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    _adopt_library_loggers()


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _adopt_library_loggers() -> None:
    """Take off the handlers libraries add themselves, so their records are printed once, by ours."""
    try:  # imported now (cheap) so that its import-time handler exists to be taken off
        import huggingface_hub.utils.logging  # noqa: F401
    except ImportError:
        pass
    for name in OWN_HANDLER_LIBRARIES:
        library = logging.getLogger(name)
        for own in list(library.handlers):
            library.removeHandler(own)
        library.propagate = True
