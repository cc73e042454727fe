"""Shamir secret sharing of the mask secrets (t of n), on pycryptodome's audited implementation.

``Crypto.Protocol.SecretSharing.Shamir`` works over GF(2^128) and shares 16-byte secrets. A
32-byte secret (an X25519 private key) is shared as its two 16-byte halves, each with its own
random polynomial and the same holder indices; a share is then the two 16-byte halves joined.
Holders are numbered 1..n (x = 0 would be the secret itself).
"""
from __future__ import annotations

from Crypto.Protocol.SecretSharing import Shamir

from privacy.secagg.errors import BadSecAggMessage

BLOCK = 16
"""pycryptodome's Shamir shares exactly 16-byte secrets."""


def split_secret(secret: bytes, threshold: int, holders: int) -> dict[int, bytes]:
    """Shares of ``secret`` (16 or 32 bytes) for holders 1..``holders``; any ``threshold`` of them rebuild it."""
    if len(secret) not in (BLOCK, 2 * BLOCK):
        raise BadSecAggMessage(f"a shared secret is 16 or 32 bytes, got {len(secret)}")
    if not 1 <= threshold <= holders:
        raise BadSecAggMessage(f"threshold must be in 1..{holders}, got {threshold}")
    shares: dict[int, bytes] = {index: b"" for index in range(1, holders + 1)}
    for start in range(0, len(secret), BLOCK):
        for index, share in Shamir.split(threshold, holders, secret[start:start + BLOCK], ssss=False):
            shares[index] += share
    return shares


def combine_shares(shares: dict[int, bytes], threshold: int) -> bytes:
    """The secret behind ``threshold`` of ``shares`` (the lowest indices; pycryptodome wants exactly t).

    Shamir alone cannot tell a wrong share: callers check the result against a public key or a
    commitment (``privacy.secagg.cohort``) and try another subset if it does not match.
    """
    if len(shares) < threshold:
        raise BadSecAggMessage(f"{len(shares)} shares cannot rebuild a secret of threshold {threshold}")
    chosen = sorted(shares.items())[:threshold]
    width = {len(share) for _, share in chosen}
    if len(width) != 1 or width.pop() not in (BLOCK, 2 * BLOCK):
        raise BadSecAggMessage("shares of one secret must all be 16 or all be 32 bytes")
    size = len(chosen[0][1])
    return b"".join(
        Shamir.combine([(index, share[start:start + BLOCK]) for index, share in chosen], ssss=False)
        for start in range(0, size, BLOCK)
    )
