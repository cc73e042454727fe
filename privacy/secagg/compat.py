"""Which update codecs secure aggregation composes with.

Masking works on integers modulo 2^32, over every coordinate: a masked input is dense whatever
the delta was. A dense quantizer (fp16, int8 blocks, ...) composes: the member applies it to its
delta before the cohort's fixed-point quantisation, as it would on the wire. A sparsifier or a
low-rank codec does not: its saving is lost under the masks (every coordinate is sent), and its
selection (which coordinates, which factors) would differ per member, so the sum would not be the
sum of the members' updates. Those combinations are refused in one line, at the worker's flag
check and at the aggregator.
"""
from __future__ import annotations

from compression.registry import make_codec
from privacy.secagg.errors import BadSecAggMessage


def check_codec(spec: str) -> None:
    """Refuse a codec that cannot run under secure aggregation (a one-line message naming the flag)."""
    kind = make_codec(spec).kind
    if kind != "quantizer":
        raise BadSecAggMessage(f"--secure-aggregation composes with dense quantizers (none, fp16, int8, ...), "
                               f"not with the {kind} codec {spec!r}: masks make every update dense; "
                               "drop --compression or pick a quantizer")
