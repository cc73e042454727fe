"""Exception tree for the compression package.

Every error carries a short machine-readable ``code`` so the HTTP layer can
map it to a status in one place.
"""
from typing import ClassVar


class CompressionError(ValueError):
    """A codec was misconfigured or misused (bad name, bad config, bad input)."""

    code: ClassVar[str] = "compression_error"


class PayloadError(CompressionError):
    """Bytes handed to a decoder are malformed, truncated, padded or hostile."""

    code: ClassVar[str] = "bad_payload"
