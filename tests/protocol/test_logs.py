"""--log-format json: one parseable object per record, with extras and exceptions kept."""
import io
import json
import logging
import sys

import pytest

from protocol.logs import configure_logging


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


def test_json_lines_parse_and_keep_fields(root_logging):
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    log = logging.getLogger("fedmoe.test")
    log.info("pushed %d bytes", 42, extra={"expert": "sql_expert"})
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first | {"time": 0} == {"time": 0, "level": "INFO", "logger": "fedmoe.test", "message": "pushed 42 bytes",
                                   "expert": "sql_expert"}
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def test_text_format_and_bad_format(root_logging):
    stream = io.StringIO()
    configure_logging("text", stream=stream)
    logging.getLogger("fedmoe.test").warning("careful")
    assert stream.getvalue().rstrip().endswith("WARNING fedmoe.test: careful")
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("xml")


def test_colour_codes_are_kept_only_on_a_terminal(root_logging):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    coloured = "\x1b[1m\x1b[31mGET /api/v1/experts HTTP/1.1\x1b[0m"  # werkzeug's request line for a 4xx
    for stream, kept in ((io.StringIO(), False), (Terminal(), True)):
        configure_logging("text", stream=stream)
        logging.getLogger("werkzeug").warning(coloured)
        assert ("\x1b[" in stream.getvalue()) is kept
        assert stream.getvalue().rstrip().endswith("GET /api/v1/experts HTTP/1.1" + ("\x1b[0m" if kept else ""))
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    logging.getLogger("werkzeug").warning(coloured)
    assert json.loads(stream.getvalue())["message"] == "GET /api/v1/experts HTTP/1.1"


def test_hugging_face_warnings_are_printed_once_in_our_format(root_logging, capfd):
    from huggingface_hub.utils import logging as hub_logging

    stream = io.StringIO()
    configure_logging("text", stream=stream)
    hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    assert stream.getvalue().count("Retrying in 1s") == 1
    assert "WARNING huggingface_hub.utils._http: Retrying in 1s" in stream.getvalue()
    assert "Retrying" not in capfd.readouterr().err  # the library's own stderr handler is gone


def test_by_default_lines_go_to_stderr_as_it_is_when_each_is_written(root_logging, monkeypatch):
    """A handler bound to the stderr of its set-up wrote to a closed stream once that stderr was swapped and closed
    (a test's capture; a program that redirects stderr): "--- Logging error --- I/O operation on closed file"."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("text")
    logging.getLogger("fedmoe.test").warning("one")
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    logging.getLogger("fedmoe.test").warning("two")
    assert second.getvalue().rstrip().endswith("WARNING fedmoe.test: two")
