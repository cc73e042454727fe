import pytest
import torch

from coordinator.aggregation import AGGREGATORS, AggregationParams, Update, staleness_weight


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value)}


def test_staleness_weight_is_the_original_rule():
    assert staleness_weight(0, 0.1) == 1.0
    assert staleness_weight(5, 0.1) == pytest.approx(1 / 1.5)
    assert staleness_weight(3, 0.0) == 1.0


def test_fedasync_applies_each_update_with_its_staleness_weight():
    params = AggregationParams(server_lr=0.5, staleness_decay=0.25)
    updates = [Update(state(2.0), num_samples=10, staleness=0), Update(state(4.0), num_samples=1, staleness=4)]
    result = AGGREGATORS["fedasync"](state(1.0), updates, params)
    # 1 + 0.5 * 1 * 2 + 0.5 * (1 / (1 + 0.25 * 4)) * 4 = 1 + 1 + 1 = 3
    assert torch.allclose(result["w"], torch.full((2, 3), 3.0))


@pytest.mark.parametrize("name", ["fedasync", "fedbuff"])
def test_aggregators_update_current_in_place_and_leave_deltas_alone(name):
    """No copy of the model per step: the result is ``current`` itself, its tensors updated in place."""
    current, delta = state(1.0), state(2.0)
    storage = current["w"].data_ptr()
    result = AGGREGATORS[name](current, [Update(delta, 1, 0)], AggregationParams(staleness_decay=0.0))
    assert result is current and result["w"].data_ptr() == storage
    assert torch.equal(result["w"], state(3.0)["w"]) and torch.equal(delta["w"], state(2.0)["w"])


def test_fedbuff_is_the_sample_and_staleness_weighted_mean():
    params = AggregationParams(server_lr=2.0, staleness_decay=0.5)
    updates = [Update(state(3.0), num_samples=30, staleness=0),   # weight 0.75 * 1
               Update(state(-8.0), num_samples=10, staleness=2)]  # weight 0.25 * 0.5
    result = AGGREGATORS["fedbuff"](state(1.0), updates, params)
    expected = 1.0 + 2.0 * (0.75 * 3.0 + 0.125 * -8.0)  # = 3.5
    assert torch.allclose(result["w"], torch.full((2, 3), expected))


def test_fedbuff_with_zero_samples_uses_equal_weights():
    updates = [Update(state(2.0), 0, 0), Update(state(4.0), 0, 0)]
    result = AGGREGATORS["fedbuff"](state(0.0), updates, AggregationParams(staleness_decay=0.0))
    assert torch.allclose(result["w"], torch.full((2, 3), 3.0))


def test_fedbuff_does_not_depend_on_arrival_order():
    g = torch.Generator().manual_seed(0)
    updates = [Update({"w": torch.randn(4, 4, generator=g)}, n, s) for n, s in [(3, 0), (7, 2), (1, 5)]]
    current = {"w": torch.randn(4, 4, generator=g)}
    a = AGGREGATORS["fedbuff"]({"w": current["w"].clone()}, updates, AggregationParams())
    b = AGGREGATORS["fedbuff"]({"w": current["w"].clone()}, updates[::-1], AggregationParams())
    assert torch.allclose(a["w"], b["w"], atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"server_lr": 0}, {"staleness_decay": -1}])
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        AggregationParams(**kwargs)
