"""Properties of buffered aggregation, checked on random buffers (hypothesis).

- The result of a buffered step does not depend on the order the updates arrived in.
- With fewer bad updates than a rule tolerates (median: under half; trimmed mean: at most the
  trimmed count), every coordinate of the combined delta stays within the honest updates' range,
  however extreme the bad values are.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinator.aggregation import AggregationParams, Update, fedbuff
from coordinator.aggregation.robust import ROBUST_RULES, RobustParams, robust_fedbuff, trim_count

SHAPES = {"a": (2, 3), "b": (4,)}
FAST = settings(max_examples=40, deadline=None, database=None)  # no .hypothesis/ left in the checkout


@st.composite
def buffers(draw, min_size: int = 3, max_size: int = 7) -> list[Update]:
    """A buffer of updates with random deltas, sample counts and staleness."""
    n = draw(st.integers(min_size, max_size))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return [Update(delta={k: torch.randn(shape, generator=g) for k, shape in SHAPES.items()},
                   num_samples=draw(st.integers(0, 50)), staleness=draw(st.integers(0, 4))) for _ in range(n)]


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape) for k, shape in SHAPES.items()}


@pytest.mark.slow
@FAST
@given(buffers(), st.randoms(use_true_random=False), st.floats(0.0, 1.0))
def test_fedbuff_does_not_depend_on_arrival_order(updates, rnd, decay):
    params = AggregationParams(server_lr=0.7, staleness_decay=decay)
    shuffled = updates[:]
    rnd.shuffle(shuffled)
    first, second = fedbuff(zeros(), updates, params), fedbuff(zeros(), shuffled, params)
    for k in first:  # float sums in another order differ in the last bits, nothing more
        torch.testing.assert_close(first[k], second[k], rtol=1e-6, atol=1e-6)


@FAST
@given(buffers(), st.randoms(use_true_random=False), st.sampled_from(sorted(ROBUST_RULES)), st.floats(0.0, 1.0))
def test_robust_rules_do_not_depend_on_arrival_order(updates, rnd, rule, decay):
    params = AggregationParams(server_lr=0.7, staleness_decay=decay)
    shuffled = updates[:]
    rnd.shuffle(shuffled)
    first = robust_fedbuff(zeros(), updates, params, ROBUST_RULES[rule])
    second = robust_fedbuff(zeros(), shuffled, params, ROBUST_RULES[rule])
    for k in first:
        if rule == "clip":
            torch.testing.assert_close(first[k], second[k], rtol=1e-6, atol=1e-6)
        else:  # sorted per coordinate before any arithmetic: bit-identical
            assert torch.equal(first[k], second[k])


bad_values = st.sampled_from([1e6, -1e6, 3e4, -7e5])


@st.composite
def attacked(draw, honest_min: int, honest_max: int, max_bad: Callable) -> tuple[list[Update], list[Update]]:
    honest = draw(buffers(honest_min, honest_max))
    honest = [Update(u.delta, u.num_samples, staleness=0) for u in honest]
    n_bad = draw(st.integers(0, max_bad(len(honest))))
    bad = [Update(delta={k: torch.full(shape, draw(bad_values)) for k, shape in SHAPES.items()},
                  num_samples=draw(st.integers(0, 10**6)), staleness=0) for _ in range(n_bad)]
    return honest, bad


def assert_within_honest_range(result: dict[str, torch.Tensor], honest: list[Update]) -> None:
    for k, value in result.items():
        stacked = torch.stack([u.delta[k] for u in honest])
        assert torch.all(value >= stacked.min(dim=0).values - 1e-6), k
        assert torch.all(value <= stacked.max(dim=0).values + 1e-6), k


@pytest.mark.slow
@FAST
@given(attacked(3, 7, lambda h: h - 1), st.randoms(use_true_random=False))
def test_median_stays_within_honest_range_while_bad_updates_are_a_minority(case, rnd):
    honest, bad = case
    updates = honest + bad
    rnd.shuffle(updates)
    assert len(bad) < len(updates) / 2
    result = robust_fedbuff(zeros(), updates, AggregationParams(), ROBUST_RULES["median"])
    assert_within_honest_range(result, honest)


@pytest.mark.slow
@FAST
@given(attacked(3, 9, lambda h: 4), st.floats(0.05, 0.45), st.randoms(use_true_random=False))
def test_trimmed_mean_stays_within_honest_range_while_bad_updates_are_at_most_the_trimmed_count(
        case, fraction, rnd):
    honest, bad = case
    updates = honest + bad
    assume(len(bad) <= trim_count(len(updates), fraction))
    rnd.shuffle(updates)
    result = robust_fedbuff(zeros(), updates, AggregationParams(), ROBUST_RULES["trimmed_mean"],
                            RobustParams(trim_fraction=fraction))
    assert_within_honest_range(result, honest)


def test_the_property_is_not_vacuous_plain_mean_leaves_the_honest_range():
    honest = [Update({k: torch.full(s, float(i)) for k, s in SHAPES.items()}, 1, 0) for i in range(4)]
    bad = [Update({k: torch.full(s, 1e6) for k, s in SHAPES.items()}, 1, 0)]
    result = fedbuff(zeros(), honest + bad, AggregationParams())
    assert math.isclose(float(result["a"][0, 0]), (0 + 1 + 2 + 3 + 1e6) / 5, rel_tol=1e-6)
    assert float(result["a"].max()) > 3
