"""Route a prompt to the expert whose training prompts it resembles, or to the gateway.

Each expert is summarised by a *profile*: hashed character n-gram counts of its training
prompts, summed and L2-normalised (a 4096-float vector by default). A prompt is profiled the
same way and sent to the expert of highest cosine similarity when the router is confident, to
the merged gateway otherwise. Pure numpy; no model is needed.

What a profile reveals. It holds no example verbatim, but it is n-gram statistics: how often
each 3-5 byte substring (lower-cased) occurs across the expert's prompts, folded into `dim`
buckets (colliding n-grams add up). Vocabulary, identifiers and recurring phrases of the
training data show through, and someone holding a candidate text can test whether its
n-grams are unusually frequent in a profile (membership inference). The fewer examples a
profile aggregates, the more it says about each; a profile of one short prompt can be close
to reconstructable. Share profiles only of many examples.

Scores. Raw n-gram counts are dominated by a few frequent n-grams (spaces, common words,
prompt boilerplate) that every domain shares, so both sides are damped to the cube root of
their counts before the cosine (a sublinear term weighting; the exponent was picked by 5-fold
cross-validation on DS-1000's pandas/numpy/sklearn *training* prompts: nearest-profile accuracy
72% raw, 94% square root, 97% cube root).

Confidence. Cosines of one prompt to related domains are all high and close (median gap
between the best two 0.03 on DS-1000), so the raw similarity says little; what separates
domains is what they do not share. Confidence is therefore computed on *centred* cosines (the
mean expert profile subtracted from the prompt and from every profile, which removes what all
domains have in common) as the softmax probability of the best expert at a temperature. The
temperature 0.03 is the one that maximises the likelihood of the right expert in that same
cross-validation (temperature scaling), so the confidence reads as a probability of being
right: near 1 when one expert stands out, near 1 / n_experts when several are equally likely.
It is calibrated for a few experts of related domains; re-fit it for very different setups.
A single expert is chosen whenever the prompt shares any n-gram with it (there is nothing to
centre against, and the gateway of one expert is that expert anyway).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.errors import GatewayError

DEFAULT_DIM = 4096
DEFAULT_NGRAMS = (3, 4, 5)
DEFAULT_THRESHOLD = 0.46
"""Confidence below which a prompt goes to the gateway, fitted by ``fit_threshold`` on the DS-1000
validation split (bench/quality_gateway.py --router-only; bench/results/router_calibration.json):
there every prompt's top expert was right but two (confidence 0.65 and 0.68), so the best cut
routes all of them and sits midway between the lowest validation confidence (0.58) and 1/3, the
confidence of a prompt no more like one of three experts than another. On the held-out problems
it routes 72 of 73 right, sends none to the gateway and one (confidence 0.81) to a wrong expert;
the old 0.7 sent 5 with a right top expert to the gateway (issue 15 saw 8 of 67 in the demo)."""
MAX_PROMPT_CHARS = 8192
"""Only the start of a prompt is routed: it says what the prompt is about, and the cost of hashing
its n-grams (~100x its size in memory) stays bounded however long the prompt is."""
DEFAULT_TEMPERATURE = 0.03
"""Softmax temperature over centred cosine similarities (fitted, see the module docstring)."""
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


class ProfileError(GatewayError, ValueError):
    """A profile, a profile's wire form or a routing request is invalid."""

    code = "invalid_profile"


@dataclass(frozen=True)
class RouteResult:
    """Where a prompt should go and why."""

    expert: str | None
    """Chosen expert, or None to use the gateway."""
    scores: dict[str, float]
    """Cosine similarity of the prompt to each expert's profile (cube-root damped, not centred)."""
    confidence: float
    """Softmax probability of the best expert over centred similarities, in [0, 1]."""
    probabilities: dict[str, float] = field(default_factory=dict)
    """That softmax for every expert (sums to 1; empty when the prompt could not be compared):
    the weights of a soft mixture of the experts (``mixture_weights``)."""


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
    _check_dim(dim)
    total = np.zeros(dim, dtype=np.float64)
    examples = 0
    for i, (vector, count) in enumerate(profiles):
        _check_count(count, f"profiles[{i}] num_examples")
        total += count * _check_vector(vector, dim, f"profiles[{i}]").astype(np.float64)
        examples += count
    if examples == 0:
        raise ProfileError("every profile has num_examples 0; nothing to combine")
    return _normalised(total)


def route(
    prompt: str,
    profiles: Mapping[str, np.ndarray],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    ngrams: Sequence[int] = DEFAULT_NGRAMS,
    temperature: float = DEFAULT_TEMPERATURE,
) -> RouteResult:
    """Send `prompt` to the expert whose profile it is most like, or to the gateway (None).

    `profiles` maps expert names to profiles made with the same dim and `ngrams`. The prompt
    goes to the gateway when the confidence is below `threshold` (see the module docstring).
    """
    names, matrix = _profile_matrix(profiles)
    if not _is_number(threshold) or not 0 <= threshold <= 1:
        raise ProfileError(f"threshold must be a number in [0, 1], got {threshold!r}")
    if not _is_number(temperature) or not 0 < temperature < math.inf:
        raise ProfileError(f"temperature must be a positive finite number, got {temperature!r}")
    # float64: centring subtracts nearly equal numbers (see _centred_cosines)
    profile = text_profile([prompt[:MAX_PROMPT_CHARS]], dim=matrix.shape[1], ngrams=ngrams)
    query = _unit_rows(np.cbrt(profile, dtype=np.float64))
    damped = _unit_rows(np.cbrt(matrix, dtype=np.float64))
    cosines = damped @ query
    scores = {name: float(c) for name, c in zip(names, cosines)}
    if not query.any():  # nothing to compare: shorter than the shortest n-gram
        return RouteResult(None, scores, 0.0)
    if len(names) == 1:  # nothing to centre against; the gateway of one expert is that expert
        best, probabilities = 0, np.array([float(cosines[0] > 0)])
    else:
        centred = _centred_cosines(damped @ damped.T, cosines, float(query @ query))
        best, probabilities = int(np.argmax(centred)), _softmax(centred, temperature)
    confidence = float(probabilities[best])
    expert = names[best] if confidence >= threshold else None
    return RouteResult(expert, scores, confidence, {n: float(p) for n, p in zip(names, probabilities)})


def mixture_weights(probabilities: Mapping[str, float], top_k: int) -> dict[str, float]:
    """The ``top_k`` most probable experts, their probabilities renormalised to sum to 1.

    With every expert (top_k >= their number) and equal probabilities this is the equal-weight
    average of the experts' updates, i.e. the exact gateway; with one dominant expert it is that
    expert: the mixture moves between the two with the router's certainty, where a threshold jumps.
    """
    if top_k < 1:
        raise ProfileError(f"top_k must be at least 1, got {top_k!r}")
    top = sorted(probabilities.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]
    mass = sum(p for _, p in top)
    if mass <= 0:
        return {}
    return {name: p / mass for name, p in top}


def fit_threshold(confidences: Sequence[float], gains: Sequence[float], floor: float | None = None) -> float:
    """The confidence threshold that maximises the summed gain of the validation prompts it routes.

    ``gains[i]`` is what answering validation prompt i with its top-scoring expert is worth
    against the gateway: +1 / -1 for a right / wrong top expert, or the gateway's loss minus that
    expert's. Prompts at or above the threshold are routed, the rest go to the gateway. Among
    equally good cuts the one that routes most wins; the threshold returned lies midway between
    the lowest routed confidence and the highest one sent to the gateway, or, when every prompt
    is routed, midway to ``floor`` (0 without one; e.g. 1 / number of experts, the confidence of a prompt that is no more
    like one expert than another: validation prompts are all in-domain, so they say nothing
    about prompts that fit no expert, which should still go to the gateway).
    """
    if len(confidences) != len(gains) or not len(confidences):
        raise ProfileError("fit_threshold needs one gain per confidence, and at least one of each")
    order = sorted(range(len(confidences)), key=lambda i: -confidences[i])
    best_count, best_gain, running = 0, 0.0, 0.0
    for count, i in enumerate(order, start=1):  # route the `count` most confident prompts
        running += gains[i]
        if running >= best_gain:
            best_count, best_gain = count, running
    above = confidences[order[best_count - 1]] if best_count else 1.0
    if best_count == len(order):
        if floor is None:
            return 0.0
        return (above + floor) / 2 if floor < above else above
    return (above + confidences[order[best_count]]) / 2


def fit_threshold_counting_mistakes(confidences: Sequence[float], right: Sequence[bool], wrong_cost: float,
                                    floor: float | None = None) -> float:
    """``fit_threshold`` where a right top expert is worth +1, a fallback to the gateway 0 and a wrong
    expert ``-wrong_cost``: with ``wrong_cost`` > 1 a wrong expert counts as worse than a fallback by
    that factor (a wrong expert can answer worse than the base model; the gateway rarely does)."""
    if not wrong_cost > 0:
        raise ProfileError(f"wrong_cost must be positive, got {wrong_cost!r}")
    return fit_threshold(confidences, [1.0 if r else -wrong_cost for r in right], floor)


def _profile_matrix(profiles: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """Expert names and their profiles stacked as rows, after checking they share one dim."""
    if not isinstance(profiles, Mapping) or not profiles:
        raise ProfileError("no expert profiles to route between; give a dict of at least one")
    names = list(profiles)
    first = np.shape(profiles[names[0]])
    if len(first) != 1:
        raise ProfileError(f"profile of {names[0]!r} has shape {first}; a profile is one vector")
    _check_dim(first[0])
    rows = [_check_vector(profiles[name], first[0], f"profile of {name!r}") for name in names]
    return names, np.stack(rows)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def _centred_cosines(gram: np.ndarray, dots: np.ndarray, query_sq: float) -> np.ndarray:
    """Cosines of (r_i - c) and (q - c), c the mean of the rows r_i, q the query.

    Expanded into dot products so that only the k x k Gram matrix r_i . r_j, the k dots r_i . q
    and q . q are needed, never a dim-sized difference: with c = mean_j r_j,
    (r_i - c).(q - c) = r_i.q - r_i.c - c.q + c.c, |r_i - c|^2 = r_i.r_i - 2 r_i.c + c.c and
    |q - c|^2 = q.q - 2 q.c + c.c.
    """
    row_dot_centre = gram.mean(axis=1)
    centre_sq = float(gram.mean())
    query_dot_centre = float(dots.mean())
    numerators = dots - row_dot_centre - query_dot_centre + centre_sq
    row_norms = np.sqrt(np.maximum(np.diag(gram) - 2 * row_dot_centre + centre_sq, 0.0))
    query_norm = math.sqrt(max(query_sq - 2 * query_dot_centre + centre_sq, 0.0))
    norms = row_norms * query_norm
    # Identical profiles leave nothing after centring (rounding leaves ~1e-8, not 0).
    return np.divide(numerators, norms, out=np.zeros_like(numerators), where=norms > 1e-6)


def _softmax(scores: np.ndarray, temperature: float) -> np.ndarray:
    weights = np.exp((scores - scores.max()) / temperature)
    return weights / weights.sum()


def profile_to_json(
    vector: np.ndarray, num_examples: int, dim: int = DEFAULT_DIM,
    ngrams: Sequence[int] = DEFAULT_NGRAMS,
) -> dict[str, Any]:
    """The wire form of a profile: plain JSON, the vector as a list of float32 values."""
    _check_config(dim, ngrams)
    vector = _check_vector(vector, dim)
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
            f"version {obj.get('version')!r}); make it with gateway.router.profile_to_json"
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
    if not isinstance(values, list) or not all(_is_number(v) for v in values):
        raise ProfileError("profile 'vector' must be a list of numbers")
    return _check_vector(np.asarray(values, dtype=np.float64), dim), obj["num_examples"]


def _check_vector(vector: Any, dim: int, what: str = "profile vector") -> np.ndarray:
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_count(count: Any, what: str) -> None:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ProfileError(f"{what} must be a non-negative integer, got {count!r}")


def _check_dim(dim: Any) -> None:
    integer = isinstance(dim, (int, np.integer)) and not isinstance(dim, bool)
    if not integer or not MIN_DIM <= dim <= MAX_DIM:
        raise ProfileError(f"dim must be an integer in [{MIN_DIM}, {MAX_DIM}], got {dim!r}")


def _check_config(dim: Any, ngrams: Any) -> None:
    _check_dim(dim)
    if (
        not isinstance(ngrams, (list, tuple))
        or not ngrams
        or any(type(n) is not int or not 1 <= n <= MAX_NGRAM for n in ngrams)
        or list(ngrams) != sorted(set(ngrams))
    ):
        raise ProfileError(
            f"ngrams must be increasing distinct integers in [1, {MAX_NGRAM}], got {ngrams!r}"
        )
