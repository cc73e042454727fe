"""The secure-aggregation errors, inside the project's one exception tree.

Each carries a stable ``code`` and the HTTP status the API answers with (``protocol.errors``).
"""
from __future__ import annotations

from protocol.errors import BadRequest, Conflict, FedMoEError


class SecAggError(FedMoEError):
    """Base of every secure-aggregation error."""

    code, status = "secagg_error", 400


class BadSecAggMessage(SecAggError, BadRequest):
    """A key, share, masked input or request is malformed (wrong length, unknown member, bad base64)."""

    code, status = "secagg_bad_message", 400


class SecAggRefused(SecAggError):
    """A member refuses a request that would let the coordinator see an individual update."""

    code, status = "secagg_refused", 403


class CohortStateError(SecAggError, Conflict):
    """The cohort is not in the phase this message belongs to (late keys, a second masked input, ...)."""

    code, status = "secagg_wrong_phase", 409


class ReconstructionError(SecAggError):
    """Shares did not reconstruct a secret that matches its public key or commitment."""

    code, status = "secagg_reconstruction_failed", 422
