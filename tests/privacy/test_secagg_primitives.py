"""The primitives secure aggregation stands on, against their published test vectors.

X25519: RFC 7748 sections 5.2 and 6.1. ChaCha20 keystream: RFC 8439 appendix A.1 test vector 1 and
A.2 test vector 3 (counter 42). HKDF-SHA256: RFC 5869 appendix A.1 and A.3. Shamir (pycryptodome):
any t of n shares rebuild the secret, fewer do not, and the 32-byte split keeps that property.
"""
import itertools

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy.secagg import keys, masking
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.shamir import combine_shares, split_secret

h = bytes.fromhex


@pytest.mark.parametrize("scalar,u,out", [
    ("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
     "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
     "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"),
    ("4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
     "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
     "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957"),
])
def test_x25519_rfc7748_section_5_2(scalar, u, out):
    assert keys.raw_agreement(h(scalar), h(u)) == h(out)


def test_x25519_rfc7748_section_6_1_alice_and_bob():
    alice = keys.KeyPair.from_private(h("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = keys.KeyPair.from_private(h("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert alice.public == h("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert bob.public == h("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = h("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert keys.raw_agreement(alice.private, bob.public) == shared == keys.raw_agreement(bob.private, alice.public)


def test_x25519_refuses_a_low_order_peer_key():
    # u = 0 is a point of small order: the shared secret would be all zeros whatever our key.
    with pytest.raises(BadSecAggMessage, match="not usable"):
        keys.raw_agreement(keys.KeyPair.generate().private, bytes(32))


def test_chacha20_keystream_rfc8439_a1_vector_1():
    stream = masking.keystream(bytes(32), 16).tobytes()
    assert stream == h("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
                       "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")


def test_chacha20_rfc8439_a2_vector_3_counter_42():
    # cryptography's 16-byte nonce is the block counter (42, little-endian) then the RFC's nonce.
    key = h("1c9240a5eb55d38af333888604f6b5f0473917c1402b80099dca5cbc207075c0")
    nonce = (42).to_bytes(4, "little") + h("000000000000000000000002")
    plain = h("2754776173206272696c6c69672c20616e642074686520736c6974687920746f7665730a4469642067797265"
              "20616e642067696d626c6520696e2074686520776162653a0a416c6c206d696d737920776572652074686520"
              "626f726f676f7665732c0a416e6420746865206d6f6d65207261746873206f757467726162652e")
    encrypted = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(plain)
    assert encrypted == h("62e6347f95ed87a45ffae7426f27a1df5fb69110044c0d73118effa95b01e5cf166d3df2d721caf9b21e"
                          "5fb14c616871fd84c54f9d65b283196c7fe4f60553ebf39c6402c42234e32a356b3e764312a61a553205"
                          "5716ead6962568f87d3f3f7704c6a8d1bcd1bf4d50d6154b6da731b187b58dfd728afa36757a797ac188d1")


@pytest.mark.parametrize("salt,info,okm", [
    ("000102030405060708090a0b0c", "f0f1f2f3f4f5f6f7f8f9",
     "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"),
    ("", "", "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"),
])
def test_hkdf_sha256_rfc5869(salt, info, okm):
    hkdf = HKDF(algorithm=hashes.SHA256(), length=42, salt=h(salt) or None, info=h(info))
    assert hkdf.derive(b"\x0b" * 22) == h(okm)


def test_derived_keys_agree_and_differ_by_purpose_and_cohort():
    u, v = keys.KeyPair.generate(), keys.KeyPair.generate()
    a = keys.derive_key(u.private, v.public, keys.MASK_SEED_PURPOSE, b"e/c1")
    assert a == keys.derive_key(v.private, u.public, keys.MASK_SEED_PURPOSE, b"e/c1")
    assert a != keys.derive_key(u.private, v.public, keys.SHARE_KEY_PURPOSE, b"e/c1")
    assert a != keys.derive_key(u.private, v.public, keys.MASK_SEED_PURPOSE, b"e/c2")
    # ...and none is the raw X25519 secret.
    raw = X25519PrivateKey.from_private_bytes(u.private).exchange(X25519PublicKey.from_public_bytes(v.public))
    assert a != raw


def test_sealed_share_opens_only_with_its_key_and_address():
    key = bytes(range(32))
    box = keys.seal(key, b"share", b"cohort|u->v")
    assert keys.open_sealed(key, box, b"cohort|u->v") == b"share"
    with pytest.raises(BadSecAggMessage, match="authentication"):
        keys.open_sealed(key, box, b"cohort|u->w")  # replayed to another member
    tampered = bytearray(box)
    tampered[-1] ^= 1
    with pytest.raises(BadSecAggMessage, match="authentication"):
        keys.open_sealed(key, bytes(tampered), b"cohort|u->v")


@pytest.mark.parametrize("size", [16, 32])
def test_shamir_any_t_of_n_rebuild_the_secret(size):
    secret = bytes(range(7, 7 + size))
    shares = split_secret(secret, threshold=3, holders=5)
    assert sorted(shares) == [1, 2, 3, 4, 5] and all(len(s) == size for s in shares.values())
    for subset in itertools.combinations(shares, 3):
        assert combine_shares({i: shares[i] for i in subset}, 3) == secret


def test_shamir_fewer_than_t_shares_say_nothing_usable():
    secret = bytes(32)
    shares = split_secret(secret, threshold=3, holders=5)
    with pytest.raises(BadSecAggMessage, match="cannot rebuild"):
        combine_shares({1: shares[1], 2: shares[2]}, 3)
    # Interpolating 2 shares as if t were 2 gives some other value, not the secret.
    assert combine_shares({1: shares[1], 2: shares[2]}, 2) != secret


def test_shamir_splits_are_random_and_a_wrong_share_changes_the_result():
    secret = bytes(range(16))
    first, second = split_secret(secret, 2, 3), split_secret(secret, 2, 3)
    assert first[1] != second[1]  # fresh random polynomial each time
    bad = dict(first)
    bad[1] = bytes(16)
    assert combine_shares({1: bad[1], 2: bad[2]}, 2) != secret
