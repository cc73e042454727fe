"""Route a prompt to the expert whose training prompts it resembles, or to the gateway.

Each expert is summarised by a *profile* of its training prompts (``protocol.profiles``: hashed
character n-gram counts, summed and L2-normalised). A prompt is profiled the same way and sent
to the expert of highest cosine similarity when the router is confident, to the merged gateway
otherwise. Pure numpy; no model is needed.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.profiles import DEFAULT_NGRAMS, ProfileError, check_dim, check_vector, is_number, text_profile

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
    if not is_number(threshold) or not 0 <= threshold <= 1:
        raise ProfileError(f"threshold must be a number in [0, 1], got {threshold!r}")
    if not is_number(temperature) or not 0 < temperature < math.inf:
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
    check_dim(first[0])
    rows = [check_vector(profiles[name], first[0], f"profile of {name!r}") for name in names]
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
