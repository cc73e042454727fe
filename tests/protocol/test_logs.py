"""--log-format json: one parseable object per record, with extras and exceptions kept."""
import io
import json
import logging

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
