import pytest

from gateway.merges import merge


def test_task_arithmetic_is_lambda_times_the_unnormalised_weighted_sum(experts, helpers):
    result = merge("task_arithmetic", experts, [1.0, -0.5, 2.0], lam=0.4)
    assert result.weights == [1.0, -0.5, 2.0]  # not normalised
    assert result.config == {"lam": 0.4, "rank": None}
    assert result.truncation_error is None  # built by concatenation, exact
    for name in experts[0]:
        expected = helpers.weighted_sum(experts, [0.4, -0.2, 0.8], name)
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5


def test_task_arithmetic_truncates_exactly_when_given_a_rank(experts, helpers):
    result = merge("task_arithmetic", experts, [1.0, 1.0, 1.0], rank=2)
    for name in experts[0]:
        dense = helpers.weighted_sum(experts, [1.0, 1.0, 1.0], name)
        assert result.modules[name].rank == 2
        measured = helpers.relative_error(result.modules[name].delta(), dense)
        assert measured == pytest.approx(result.module_errors[name], abs=1e-5)
