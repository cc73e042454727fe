"""Judging a request from its head alone, in a Flask app's own words (the front's ``Admission``).

The front (coordinator/http/front.py) asks before it reads a body it would spool, one over the limit, or one the client
waits to send (Expect: 100-continue). ``check`` runs in the app's request context with the head only (an empty
body); whatever it raises is turned into the answer the app itself would give (its error handlers: the
coordinator's JSON errors, serve.py's OpenAI-shaped ones), which the front sends instead of reading the body.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import Flask, request

from coordinator.http.wsgi import Answer


@dataclass(frozen=True)
class FlaskAdmission:
    app: Flask
    check: Callable[[], None]
    """Raises what the app would answer from the head (an exception its error handlers turn into a 4xx)."""

    def admit(self, environ: dict[str, Any]) -> Answer | None:
        with self.app.request_context(environ):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - an error without a handler is re-raised: a bug, the front's 500
                response = self.app.make_response(self.app.handle_user_exception(exc))
                return Answer(response.status, list(response.headers.items()), [response.get_data()])
        return None


def route_exists() -> None:
    """The request's route and method exist (else the app's own 404 or 405, with no body read)."""
    if request.routing_exception is not None:
        raise request.routing_exception
