"""A routing profile: what a worker's training prompts look like, as hashed n-gram counts, and its wire form.

A *profile* is the hashed character n-gram counts of some texts, summed and L2-normalised (a
4096-float vector by default). A worker profiles its training prompts and sends the profile to
the coordinator (``profile_to_json``), which combines the profiles of one expert's workers
(``combine_profiles``); the router (``gateway.router``) profiles a prompt the same way and sends
it to the expert it is most like. Pure numpy; no model is needed.

What a profile reveals. It holds no example verbatim, but it is n-gram statistics: how often
each 3-5 byte substring (lower-cased) occurs across the expert's prompts, folded into `dim`
buckets (colliding n-grams add up). Vocabulary, identifiers and recurring phrases of the
training data show through, and someone holding a candidate text can test whether its
n-grams are unusually frequent in a profile (membership inference). The fewer examples a
profile aggregates, the more it says about each; a profile of one short prompt can be close
to reconstructable. Share profiles only of many examples.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

DEFAULT_DIM = 4096
DEFAULT_NGRAMS = (3, 4, 5)
PROFILE_FORMAT = "fedmoe-profile"
PROFILE_VERSION = 1
MIN_DIM, MAX_DIM = 64, 1 << 20
MAX_NGRAM = 16

# 64-bit polynomial rolling hash of the bytes, then a splitmix64 finaliser so that every bit of
# the n-gram reaches the low bits kept by `mod dim`. Fixed constants: the same text hashes to the
# same buckets in every process, on every machine (unlike Python's salted hash()).
_BASE = np.uint64(0x100000001B3)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SHIFT30, _SHIFT27, _SHIFT31 = np.uint64(30), np.uint64(27), np.uint64(31)


class ProfileError(ValueError):
    """A profile, a profile's wire form or a routing request is invalid (the coordinator answers 400)."""

    code = "invalid_profile"


def text_profile(
    texts: Iterable[str], dim: int = DEFAULT_DIM, ngrams: Sequence[int] = DEFAULT_NGRAMS
) -> np.ndarray:
    """Hashed counts of the lower-cased UTF-8 byte n-grams of `texts`, summed, L2-normalised.

    Returns float32 of shape (dim,); all zeros when no text is as long as the shortest n-gram.
    """
    _check_config(dim, ngrams)
    if isinstance(texts, str):
        raise ProfileError("text_profile takes an iterable of texts; wrap one prompt in a list")
    counts = np.zeros(dim, dtype=np.float64)
    for text in texts:
        if not isinstance(text, str):
            raise ProfileError(f"texts must be strings, got {type(text).__name__}")
        data = np.frombuffer(text.lower().encode("utf-8"), dtype=np.uint8)
        counts += np.bincount(_ngram_buckets(data, dim, ngrams), minlength=dim)
    return _normalised(counts)


def _ngram_buckets(data: np.ndarray, dim: int, ngrams: Sequence[int]) -> np.ndarray:
    """The bucket of every n-gram of `data`, for every n in `ngrams`, from one rolling pass."""
    values = data.astype(np.uint64)
    # h_n[i] = sum_k data[i + k] * BASE^(n-1-k): h_{n+1} extends h_n by one byte (uint64 wraps).
    # Adding n before mixing keeps n-grams of different lengths apart.
    rolling = np.zeros(len(values), dtype=np.uint64)
    hashes = []
    with np.errstate(over="ignore"):
        for n in range(1, min(max(ngrams), len(values)) + 1):
            rolling = rolling[: len(values) - n + 1] * _BASE + values[n - 1 :]
            if n in ngrams:
                hashes.append(rolling + np.uint64(n))
        if not hashes:
            return np.zeros(0, dtype=np.intp)
        return (_finalise(np.concatenate(hashes)) % np.uint64(dim)).astype(np.intp)


def _finalise(x: np.ndarray) -> np.ndarray:
    """splitmix64's output mix: a bijection of uint64 with good avalanche."""
    x = (x ^ (x >> _SHIFT30)) * _MIX1
    x = (x ^ (x >> _SHIFT27)) * _MIX2
    return x ^ (x >> _SHIFT31)


def _normalised(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    out = vector / norm if norm > 0 else vector
    return out.astype(np.float32)


def combine_profiles(profiles: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """Mean of (profile, num_examples) pairs weighted by the counts, renormalised.

    The coordinator uses it to merge the profiles that several workers of one expert sent.
    """
    if not profiles:
        raise ProfileError("no profiles to combine")
    dim = np.shape(profiles[0][0])[0] if np.ndim(profiles[0][0]) == 1 else -1
    check_dim(dim)
    total = np.zeros(dim, dtype=np.float64)
    examples = 0
    for i, (vector, count) in enumerate(profiles):
        _check_count(count, f"profiles[{i}] num_examples")
        total += count * check_vector(vector, dim, f"profiles[{i}]").astype(np.float64)
        examples += count
    if examples == 0:
        raise ProfileError("every profile has num_examples 0; nothing to combine")
    return _normalised(total)



def profile_to_json(
    vector: np.ndarray, num_examples: int, dim: int = DEFAULT_DIM,
    ngrams: Sequence[int] = DEFAULT_NGRAMS,
) -> dict[str, Any]:
    """The wire form of a profile: plain JSON, the vector as a list of float32 values."""
    _check_config(dim, ngrams)
    vector = check_vector(vector, dim)
    _check_count(num_examples, "num_examples")
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "dim": dim,
        "ngrams": list(ngrams),
        "num_examples": num_examples,
        # str(float32) is the shortest text that reads back to the same float32.
        "vector": [float(str(v)) for v in vector],
    }


def profile_from_json(
    obj: Any, dim: int = DEFAULT_DIM, ngrams: Sequence[int] = DEFAULT_NGRAMS
) -> tuple[np.ndarray, int]:
    """(vector, num_examples) from the wire form, checked strictly against the expected config."""
    if not isinstance(obj, dict):
        raise ProfileError(f"a profile must be a JSON object, got {type(obj).__name__}")
    if obj.get("format") != PROFILE_FORMAT or obj.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"not a {PROFILE_FORMAT} v{PROFILE_VERSION} profile (format {obj.get('format')!r}, "
            f"version {obj.get('version')!r}); make it with protocol.profiles.profile_to_json"
        )
    _check_config(dim, ngrams)
    got_dim, got_ngrams = obj.get("dim"), obj.get("ngrams")
    if (
        type(got_dim) is not int or got_dim != dim
        or not isinstance(got_ngrams, list) or any(type(n) is not int for n in got_ngrams)
        or got_ngrams != list(ngrams)
    ):
        raise ProfileError(
            f"profile made with dim={obj.get('dim')!r} ngrams={got_ngrams!r}, but this router "
            f"uses dim={dim} ngrams={list(ngrams)}; re-profile with the router's settings"
        )
    _check_count(obj.get("num_examples"), "num_examples")
    values = obj.get("vector")
    if not isinstance(values, list) or not all(is_number(v) for v in values):
        raise ProfileError("profile 'vector' must be a list of numbers")
    return check_vector(np.asarray(values, dtype=np.float64), dim), obj["num_examples"]


def check_vector(vector: Any, dim: int, what: str = "profile vector") -> np.ndarray:
    """A profile as float32 after checking it could be one: (dim,), finite, >= 0, norm 1 or 0."""
    array = np.asarray(vector)
    if array.shape != (dim,):
        raise ProfileError(f"{what} has shape {array.shape}, expected ({dim},)")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise ProfileError(f"{what} must be numeric, got dtype {array.dtype}")
    if not np.isfinite(array).all():
        raise ProfileError(f"{what} contains NaN or infinity")
    if (array < 0).any():
        raise ProfileError(f"{what} has negative entries; n-gram counts cannot be negative")
    norm = float(np.linalg.norm(array))
    if norm > 0 and abs(norm - 1) > 1e-3:
        raise ProfileError(
            f"{what} has norm {norm:.6g}; profiles are L2-normalised (make them with text_profile)"
        )
    return array.astype(np.float32)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_count(count: Any, what: str) -> None:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ProfileError(f"{what} must be a non-negative integer, got {count!r}")


def check_dim(dim: Any) -> None:
    integer = isinstance(dim, (int, np.integer)) and not isinstance(dim, bool)
    if not integer or not MIN_DIM <= dim <= MAX_DIM:
        raise ProfileError(f"dim must be an integer in [{MIN_DIM}, {MAX_DIM}], got {dim!r}")


def _check_config(dim: Any, ngrams: Any) -> None:
    check_dim(dim)
    if (
        not isinstance(ngrams, (list, tuple))
        or not ngrams
        or any(type(n) is not int or not 1 <= n <= MAX_NGRAM for n in ngrams)
        or list(ngrams) != sorted(set(ngrams))
    ):
        raise ProfileError(
            f"ngrams must be increasing distinct integers in [1, {MAX_NGRAM}], got {ngrams!r}"
        )
