"""Pairwise and self masks in Z_{2^32} (Bonawitz et al., CCS 2017, section 3).

Member u sends ``y_u = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)`` (mod 2^32),
over every peer v that shared keys with it. In the sum over all members the pairwise masks cancel
(u adds what v subtracts); the self masks are removed with the b_u the survivors' shares rebuild;
a member that dropped after the masks were fixed leaves its pairwise masks in its survivors'
inputs, removed with s_uv recomputed from its rebuilt mask key.

The PRG is the ChaCha20 keystream (RFC 8439) under a 32-byte key, nonce zero: each key is used
for exactly one stream, since keys are derived per cohort and purpose (``privacy.secagg.keys``).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.secagg import keys

SELF_MASK_PURPOSE = b"fedmoe-secagg self mask v1"
ZERO_NONCE = bytes(16)
"""cryptography's ChaCha20 takes 16 bytes: a 4-byte block counter (0) then the 12-byte nonce (0)."""


def keystream(key: bytes, count: int) -> np.ndarray:
    """``count`` uint32 values (little-endian) of the ChaCha20 keystream under ``key`` (read-only)."""
    encryptor = Cipher(algorithms.ChaCha20(keys.check_key(key, "mask key"), ZERO_NONCE), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * count)), dtype="<u4")


def self_mask_key(seed: bytes, context: bytes) -> bytes:
    """The ChaCha20 key of a member's self mask, from its 16-byte seed b_u."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=keys.KEY_BYTES, salt=None, info=SELF_MASK_PURPOSE + b"|" + context)
    return hkdf.derive(seed)


def pair_mask_key(private: bytes, peer_public: bytes, context: bytes) -> bytes:
    """s_uv: the same 32 bytes for u (with s_sk_u, s_pk_v) and for v (with s_sk_v, s_pk_u)."""
    return keys.derive_key(private, peer_public, keys.MASK_SEED_PURPOSE, context)


def add_pair_masks(vector: np.ndarray, me: int, peers: Iterable[tuple[int, bytes]], sign: int = 1) -> None:
    """``vector += sign * (sum_{v > me} PRG(s) - sum_{v < me} PRG(s))`` in place, mod 2^32.

    ``peers`` gives (index of v, s_uv) for each peer; indices are the members' 1-based positions.
    """
    for index, key in peers:
        stream = keystream(key, vector.size)
        if (index > me) == (sign > 0):
            vector += stream
        else:
            vector -= stream


def add_self_mask(vector: np.ndarray, seed: bytes, context: bytes, sign: int = 1) -> None:
    stream = keystream(self_mask_key(seed, context), vector.size)
    if sign > 0:
        vector += stream
    else:
        vector -= stream
