"""Key agreement and share encryption for secure aggregation (Bonawitz et al., CCS 2017, section 4).

Each member makes two X25519 key pairs per cohort: ``c`` encrypts the Shamir shares it sends to
its peers (through the coordinator, which must not read them), ``s`` derives the pairwise masks.
A shared secret from X25519 is never used raw: HKDF-SHA256 turns it into a key bound to the cohort
and to its purpose, so the share key and the mask seed of one pair never coincide.
Shares travel sealed with ChaCha20-Poly1305; the associated data names the cohort, the sender and
the receiver, so the coordinator cannot replay a share to another member or cohort.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.secagg.errors import BadSecAggMessage

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16

# HKDF "info" labels: one derived key per purpose (RFC 5869 section 3.2).
SHARE_KEY_PURPOSE = b"fedmoe-secagg share key v1"
MASK_SEED_PURPOSE = b"fedmoe-secagg pairwise mask v1"


@dataclass(frozen=True)
class KeyPair:
    """One X25519 key pair, private part as raw 32 bytes."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        return cls.from_private(X25519PrivateKey.generate().private_bytes_raw())

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        key = X25519PrivateKey.from_private_bytes(check_key(private, "private key"))
        return cls(private=private, public=key.public_key().public_bytes_raw())


def check_key(key: bytes, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise BadSecAggMessage(f"an X25519 {what} must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise BadSecAggMessage(f"an X25519 {what} is {KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def public_of(private: bytes) -> bytes:
    """The public key of a raw X25519 private key (to check a reconstructed key against its advertisement)."""
    return KeyPair.from_private(private).public


def raw_agreement(private: bytes, peer_public: bytes) -> bytes:
    """The X25519 shared secret (RFC 7748 section 6.1); refuses a low-order peer key (all-zero secret)."""
    key = X25519PrivateKey.from_private_bytes(check_key(private, "private key"))
    try:
        return key.exchange(X25519PublicKey.from_public_bytes(check_key(peer_public, "public key")))
    except ValueError as exc:  # cryptography raises on an all-zero shared secret
        raise BadSecAggMessage(f"a peer's public key is not usable for X25519: {exc}") from None


def derive_key(private: bytes, peer_public: bytes, purpose: bytes, context: bytes) -> bytes:
    """A 32-byte key both ends derive alike: HKDF-SHA256 over the X25519 secret, info = purpose + context."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose + b"|" + context)
    return hkdf.derive(raw_agreement(private, peer_public))


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """nonce || ChaCha20-Poly1305(plaintext); a fresh random nonce per message."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of ``seal``; a tampered, replayed or misaddressed message raises BadSecAggMessage."""
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise BadSecAggMessage(f"a sealed share is at least {NONCE_BYTES + TAG_BYTES} bytes, got {len(sealed)}")
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise BadSecAggMessage("a sealed share failed authentication (tampered or not addressed to this member)") from None
