"""One small exception tree shared by the coordinator and its clients.

Each error carries a stable ``code`` (what a program matches on) and the HTTP
``status`` the API answers with. The HTTP layer maps them in one place
(``coordinator.api.routes``); the client maps a JSON error body back to the same class
(``error_from_response``), so both sides raise the same exceptions.
"""
from __future__ import annotations

from typing import Any


class FedMoEError(Exception):
    """Base of every error FedMoE raises on purpose."""

    code = "error"
    status = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class BadRequest(FedMoEError):
    """The request is malformed: a field is missing, has the wrong type or range."""

    code, status = "bad_request", 400


class InvalidPayload(BadRequest):
    """The body is not a tensor payload we can parse (not safetensors, truncated, ...)."""

    code = "invalid_payload"


class Unauthorized(FedMoEError):
    code, status = "unauthorized", 401


class Forbidden(FedMoEError):
    code, status = "forbidden", 403


class NotFound(FedMoEError):
    code, status = "not_found", 404


class Conflict(FedMoEError):
    """The request contradicts stored state (different LoRA config, base model, ...)."""

    code, status = "conflict", 409


class PrivacyBudgetSpent(Conflict):
    """The expert has spent its --dp-budget: no further aggregation step (and so no push) is taken."""

    code = "privacy_budget_spent"


class RequestTimeout(FedMoEError):
    """The client stopped sending mid-request for longer than the coordinator's socket timeout."""

    code, status = "request_timeout", 408


class PayloadTooLarge(FedMoEError):
    code, status = "payload_too_large", 413


class InvalidUpdate(FedMoEError):
    """The payload parsed but its tensors do not fit the expert (names, shapes, NaN)."""

    code, status = "invalid_update", 422


class TLSFailure(FedMoEError):
    """Client side only: the TLS handshake failed (untrusted certificate, TLS vs plain HTTP)."""

    code = "tls"


class Unavailable(FedMoEError):
    """The coordinator cannot be reached or is not answering; worth retrying."""

    code, status = "unavailable", 503


class TooManyRequests(Unavailable):
    """This worker is over the coordinator's --rate-limit; ``details.retry_after`` says when to retry."""

    code, status = "too_many_requests", 429


class InsufficientStorage(Unavailable):
    """The coordinator's disk (or quota) is full: nothing of the request was recorded; retry later."""

    code, status = "insufficient_storage", 507


_BY_CODE: dict[str, type[FedMoEError]] = {
    cls.code: cls
    for cls in (BadRequest, InvalidPayload, Unauthorized, Forbidden, NotFound, RequestTimeout,
                Conflict, PrivacyBudgetSpent, PayloadTooLarge, InvalidUpdate, InsufficientStorage, TooManyRequests,
                Unavailable)
}
_BY_STATUS: dict[int, type[FedMoEError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
    408: RequestTimeout, 409: Conflict, 413: PayloadTooLarge, 422: InvalidUpdate, 429: TooManyRequests,
    503: Unavailable, 507: InsufficientStorage,
}


def error_from_response(status: int, body: Any) -> FedMoEError:
    """Rebuild the server's exception from an HTTP status and its JSON body."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        cls = _BY_CODE.get(str(error.get("code")), _BY_STATUS.get(status, FedMoEError))
        exc = cls(str(error.get("message", "")), **(error.get("details") or {}))
    else:
        cls = _BY_STATUS.get(status, FedMoEError)
        exc = cls(f"HTTP {status}: {str(body)[:200]}")
    exc.status = status
    return exc
