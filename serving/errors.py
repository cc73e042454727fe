"""Errors the API answers with, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

One small tree; the HTTP layer turns any ``ApiError`` into its status and JSON in one place
(serving/app.py), so a view only raises.
"""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses; ``status`` is always a 4xx."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    """Malformed JSON, a missing or mistyped field, or a value out of range."""


class ContextTooLong(ApiError):
    code = "context_length_exceeded"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(ApiError):
    status = 404
    code = "model_not_found"


class NotFoundError(ApiError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"


class BodyTooLarge(ApiError):
    status = 413
    code = "request_too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    code = "unsupported_media_type"


class Busy(ApiError):
    """Too many requests are waiting for the model (or one waited past its timeout)."""

    status = 429
    type = "rate_limit_error"
    code = "server_busy"
