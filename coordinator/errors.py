"""The one map from domain errors raised below the HTTP layer to the answers the API gives.

``protocol.errors`` classes carry their own status and code. The compression, gateway and router
trees (``compression.errors``, ``gateway.errors``, ``gateway.router.ProfileError``) know nothing of
HTTP: each is mapped here, most specific class first, to the protocol error a client sees (and
rebuilds with ``protocol.errors.error_from_response``). ``coordinator.api.app`` registers one handler
per root; nothing else translates them.
"""
from __future__ import annotations

from compression.errors import CompressionError, PayloadError
from gateway.errors import GatewayError, MergeError
from gateway.router import ProfileError
from protocol.errors import BadRequest, Conflict, FedMoEError, InvalidPayload

HTTP_ERRORS: dict[type[Exception], type[FedMoEError]] = {
    PayloadError: InvalidPayload,  # 400 invalid_payload: bytes a decoder cannot parse
    CompressionError: BadRequest,  # 400 bad_request: an unknown codec or a bad codec_config
    ProfileError: BadRequest,  # 400 bad_request: a routing profile or threshold that cannot route
    MergeError: Conflict,  # 409 conflict: experts that cannot be merged as the coordinator is set up
    GatewayError: Conflict,  # 409 conflict
}
DOMAIN_ROOTS: tuple[type[Exception], ...] = (CompressionError, GatewayError)
"""Roots of the trees mapped by HTTP_ERRORS (each class in it derives from one)."""
REFUSALS: tuple[type[Exception], ...] = (FedMoEError, *DOMAIN_ROOTS)
"""Every error that refuses a request (a 4xx, or a 5xx that is not a bug)."""


def as_http_error(exc: Exception) -> FedMoEError:
    """The protocol error a refusal is answered with; TypeError for an error that is not one (a bug)."""
    if isinstance(exc, FedMoEError):
        return exc
    for cls in type(exc).__mro__:
        if cls in HTTP_ERRORS:
            return HTTP_ERRORS[cls](str(exc))
    raise TypeError(f"{type(exc).__name__} is not a domain error with an HTTP answer") from exc
