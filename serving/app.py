"""The HTTP layer: OpenAI's /v1 endpoints over ServingService, every refusal as OpenAI error JSON.

Flask app factory, as the coordinator; views parse, admit and format, nothing else. Streaming
responses are server-sent events: ``data: {chunk}`` per piece of text, then ``data: [DONE]``.
"""
from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from serving.adapters import GATEWAY, ROUTED_NAMES
from serving.auth import ApiKeys
from serving.errors import ApiError, BodyTooLarge, Busy, InvalidRequest, MethodNotAllowed, ModelNotFound, \
    NotFoundError
from serving.jobs import BUSY, END, FAILED, START, TEXT, Job
from serving.responses import chunk, completion, headers, model_entry, model_list, new_id, sse, usage_chunk
from serving.schema import CompletionRequest, parse_chat, parse_json_body, parse_text
from serving.service import ServingService

log = logging.getLogger(__name__)

WAIT_MARGIN = 30.0  # seconds past a request's own timeout before its HTTP thread gives up on the engine


class GenerationFailed(Exception):
    """The engine failed on a batch: a bug, answered with a 500."""


def create_app(service: ServingService, keys: ApiKeys | None) -> Flask:
    """The serving app. ``keys`` None: no authentication (only for a loopback-bound server)."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = service.limits.max_body_bytes
    app.extensions["fedmoe_serving"] = service
    app.extensions["fedmoe_keys"] = keys

    app.before_request(_authenticate)
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(GenerationFailed, _generation_failed)
    app.add_url_rule("/health", view_func=health)
    app.add_url_rule("/v1/models", view_func=list_models)
    app.add_url_rule("/v1/models/<path:name>", view_func=get_model)
    app.add_url_rule("/v1/chat/completions", view_func=chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", view_func=completions, methods=["POST"])
    return app


def service() -> ServingService:
    return current_app.extensions["fedmoe_serving"]


def _authenticate() -> None:
    keys: ApiKeys | None = current_app.extensions["fedmoe_keys"]
    if keys is not None and request.endpoint not in ("health", None):
        keys.check(request.headers.get("Authorization"))


def check_head() -> None:
    """What this app answers from a request's head alone, raised as its own error (the HTTP front asks this before
    it reads a body over the limit, or one the client holds back with Expect: 100-continue): route, key, body size."""
    if request.routing_exception is not None:
        raise request.routing_exception
    _authenticate()
    length = request.content_length
    if length is not None and length > service().limits.max_body_bytes:
        raise _too_large()


# views ----------------------------------------------------------------------------

def health() -> Response:
    s = service()
    return jsonify({"status": "ok", "base_model": s.base_model_id, "models": [a.model for a in s.models()],
                    "adapter_generation": s.registry.generation,
                    "batches": {str(size): n for size, n in sorted(s.engine.batches.items())},
                    "last_swap_ms": _ms(getattr(s.federation, "last_swap_seconds", None))})


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def list_models() -> Response:
    s = service()
    return jsonify(model_list(s.models(), s.registry.get(GATEWAY) is not None))


def get_model(name: str) -> Response:
    s = service()
    if name in ROUTED_NAMES and s.registry.get(GATEWAY) is not None:
        return jsonify(model_entry(name, int(time.time()), {"kind": "router"}))
    adapter = s.registry.get(name)
    if adapter is None:
        raise ModelNotFound(f"the model {name!r} does not exist; GET /v1/models lists them", param="model")
    return jsonify(model_list([adapter], False)["data"][0])


def chat_completions() -> Response:
    return _complete(parse_chat(_body(), service().limits))


def completions() -> Response:
    return _complete(parse_text(_body(), service().limits))


def _body() -> dict[str, Any]:
    length = request.content_length
    if length is not None and length > service().limits.max_body_bytes:
        raise _too_large()
    return parse_json_body(request.get_data(cache=False))


def _complete(req: CompletionRequest) -> Response:
    job = service().admit(req)
    response_id, created = new_id(req.kind), int(time.time())
    if req.stream:
        _wait_for_start(job)
        wait = service().limits.timeout + WAIT_MARGIN  # read here: the stream runs outside the app context
        return Response(_stream(job, response_id, created, wait), mimetype="text/event-stream",
                        headers=headers(job) | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text = "".join(_texts(job))
    return Response(_json(completion(job, response_id, created, text)), mimetype="application/json",
                    headers=headers(job))


def _next_event(job: Job) -> tuple[str, Any]:
    try:
        return job.events.get(timeout=service().limits.timeout + WAIT_MARGIN)
    except queue.Empty:
        job.cancelled = True
        raise Busy("the model did not get to this request in time; retry later",
                   headers={"Retry-After": "5"}) from None


def _wait_for_start(job: Job) -> None:
    kind, value = _next_event(job)
    if kind == BUSY:
        raise Busy(value, headers={"Retry-After": "5"})
    assert kind == START, kind


def _texts(job: Job) -> Iterator[str]:
    """The text pieces of a job until it ends (non-streaming: the caller joins them)."""
    while True:
        kind, value = _next_event(job)
        if kind == BUSY:
            raise Busy(value, headers={"Retry-After": "5"})
        if kind == FAILED:
            raise GenerationFailed(value)
        if kind == TEXT:
            yield value
        if kind == END:
            return


def _stream(job: Job, response_id: str, created: int, wait: float) -> Iterator[bytes]:
    try:
        yield sse(chunk(job, response_id, created, "", None, first=True))
        while True:
            kind, value = job.events.get(timeout=wait)
            if kind == TEXT:
                yield sse(chunk(job, response_id, created, value, None))
            elif kind == FAILED:
                yield sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
                return
            elif kind == END:
                yield sse(chunk(job, response_id, created, None, job.finish_reason))
                if job.request.include_usage:
                    yield sse(usage_chunk(job, response_id, created))
                yield sse("[DONE]")
                return
    except queue.Empty:
        yield sse({"error": {"message": "generation stalled", "type": "server_error", "param": None, "code": None}})
    finally:  # the client went away mid-stream (GeneratorExit) or we are done: stop its row either way
        if not job.finished:
            job.cancelled = True


# errors ---------------------------------------------------------------------------

def _api_error(exc: ApiError) -> Response:
    response = Response(_json(exc.body()), status=exc.status, mimetype="application/json")
    response.headers.update(exc.headers)
    return response


def _too_large() -> BodyTooLarge:
    return BodyTooLarge(f"the request body is larger than {service().limits.max_body_bytes} bytes "
                        "(--max-body-bytes)")


def _http_error(exc: HTTPException) -> Response:
    """Werkzeug's own refusals (unknown path, wrong method, body too large) in OpenAI's shape."""
    if isinstance(exc, RequestEntityTooLarge):
        return _api_error(_too_large())
    if exc.code == 404:
        return _api_error(NotFoundError(f"no such endpoint: {request.method} {request.path}; this server has "
                                        "/v1/chat/completions, /v1/completions and /v1/models"))
    if exc.code == 405:
        return _api_error(MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))
    status = exc.code if exc.code and 400 <= exc.code < 500 else 400
    error = InvalidRequest(exc.description or exc.name)
    error.status = status
    return _api_error(error)


def _generation_failed(exc: GenerationFailed) -> Response:
    body = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
    return Response(_json(body), status=500, mimetype="application/json")


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))
