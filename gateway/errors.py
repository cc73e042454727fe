"""Exceptions raised by the gateway; each carries a short code for the HTTP layer to map."""


class GatewayError(Exception):
    """Base of every gateway error."""

    code = "gateway_error"


class MergeError(GatewayError, ValueError):
    """Experts, weights or a merge config cannot be merged as asked."""

    code = "merge_error"
