"""The front's side of WSGI: running the application on a request thread and collecting what it answers.

A request thread runs the app only once its request is complete, and returns as soon as the answer is built: a
body the app knows the length of is collected whole; a file (``wsgi.file_wrapper``, e.g. a weights pull) is left for
the event loop to send with sendfile; an iterator of unknown length (serve.py's server-sent events) is pulled chunk
by chunk by the loop, each pull on a request thread (``StreamedBody``).
"""
from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable], Iterable[bytes]]
ADMISSION_MARKS = "fedmoe."
"""environ keys an ``Admission`` sets on the head's environ that the request's own environ gets too (e.g. that its
rate-limit token is taken: coordinator/access/auth.py, RATE_TAKEN); no request header can make such a key."""
SPOOLED_BODY = "fedmoe.spooled_body"
"""environ key of a ``SpooledBody`` (bodies over SPOOL_IN_MEMORY when a spool_dir is set)."""


class FileBody:
    """``wsgi.file_wrapper``: lets the loop send a file (sendfile) instead of a thread iterating it."""

    def __init__(self, filelike: BinaryIO, block_size: int = 8192) -> None:
        self.filelike, self.block_size = filelike, block_size

    def __iter__(self):  # WSGI middleware that iterates still gets the bytes
        while block := self.filelike.read(self.block_size):
            yield block

    def close(self) -> None:
        self.filelike.close()


class StreamedBody:
    """An application's answer iterator whose chunks the loop sends as they come (chunked transfer coding), each
    pulled on a request thread: a thread waits for the application (e.g. for the next generated token), never for
    the client, and the next chunk is pulled only once the last one is written (a slow reader holds it back)."""

    def __init__(self, chunks: Iterator[bytes], result: Iterable[bytes]) -> None:
        self.chunks, self.result = chunks, result

    def next_chunk(self) -> bytes | None:
        """On a request thread: the next non-empty chunk, None at the end."""
        return next((chunk for chunk in self.chunks if chunk), None)

    def close(self) -> None:
        """On a request thread, never while ``next_chunk`` runs: the application's clean-up (a client gone mid-stream
        stops its generation here, GeneratorExit in the app's generator)."""
        if hasattr(self.result, "close"):
            self.result.close()


@dataclass
class Answer:
    status: str
    headers: list[tuple[str, str]]
    chunks: list[bytes]
    file: FileBody | None = None
    stream: StreamedBody | None = None
    """The rest of an answer of unknown length (no Content-Length: server-sent events), pulled chunk by chunk."""


def call_app(app: WsgiApp, environ: dict[str, Any]) -> Answer:
    """In a request thread: run the app and collect its answer (a file or a stream is left for the loop)."""
    answer = Answer("500 Internal Server Error", [], [])

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
        answer.status, answer.headers = status, list(headers)
        return answer.chunks.append

    result = app(environ, start_response)
    if type(result) is FileBody:
        if _has_fileno(result.filelike):
            answer.file = result
            return answer
        try:  # an in-memory file (send_file(io.BytesIO(...))): its bytes, as one chunk (sendfile needs a fd)
            answer.chunks.append(result.filelike.read())
        finally:
            result.close()
        return answer
    chunks, streamed = iter(result), False
    try:
        first = next((chunk for chunk in chunks if chunk), None)  # start_response has been called after it
        if first is not None:
            answer.chunks.append(first)
            if not isinstance(result, (list, tuple)) and _of_unknown_length(answer, environ):
                answer.stream, streamed = StreamedBody(chunks, result), True
                return answer
        answer.chunks.extend(chunk for chunk in chunks if chunk)
    finally:
        if not streamed and hasattr(result, "close"):
            result.close()
    return answer


def close_stream(stream: StreamedBody, pool: ThreadPoolExecutor) -> None:
    """Close ``stream`` on a request thread of ``pool``, or here when the pool is shut down (the server stops)."""
    try:
        pool.submit(close_quietly, stream)
    except RuntimeError:
        close_quietly(stream)


def close_quietly(stream: StreamedBody) -> None:
    try:
        stream.close()
    except Exception:  # noqa: BLE001 - the application's clean-up failed: its bug, logged; the connection is over
        log.exception("closing a streamed answer failed")


def declared_length(headers: list[tuple[str, str]], default: int) -> int:
    for k, v in headers:
        if k.lower() == "content-length" and v.isdigit():
            return int(v)
    return default


def _of_unknown_length(answer: Answer, environ: dict[str, Any]) -> bool:
    """Whether an answer from an iterator (not a list: its chunks are all there) is streamed: a body with no
    Content-Length (an application that knows its length, Flask for bytes, says it), not a HEAD request's and not
    a status that has no body."""
    status = answer.status.split(" ", 1)[0]
    return (environ.get("REQUEST_METHOD") != "HEAD" and status not in ("204", "304") and not status.startswith("1")
            and not any(k.lower() == "content-length" for k, _ in answer.headers))


def _has_fileno(f: BinaryIO) -> bool:
    try:
        f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    return True
