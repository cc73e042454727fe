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


def test_the_roots_fedbuff_reads_each_stored_raw_update_in_one_pass_to_the_same_bits(tmp_path, monkeypatch):
    """``stored_deltas`` of a raw body opens the file once per step, not once per tensor (420 opens per smollm2
    update cost 2.7 CPU s for 15 of them), and the step's result is bit for bit the tensor-by-tensor one."""
    import protocol.streaming
    from coordinator.checks.adapters import stored_deltas
    from protocol.streaming import FileTensors
    from protocol.tensors import dumps, manifest_of
    from tests.helpers import make_adapter, random_like

    current = make_adapter(layers=3)  # 12 tensors
    manifest = manifest_of(current)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"u{i}.safetensors")
        paths[-1].write_bytes(dumps(random_like(current, i + 1)))
    opened = []
    real_open = protocol.streaming.safe_open

    def counted_open(path, *args, **kwargs):
        opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(protocol.streaming, "safe_open", counted_open)
    params = AggregationParams(server_lr=0.7, staleness_decay=0.3)
    counts = ((5, 0), (2, 3), (9, 1))  # (num_samples, staleness)

    def step(deltas):
        start = {k: v.clone() for k, v in current.items()}
        return AGGREGATORS["fedbuff"](start, [Update(d, n, s) for d, (n, s) in zip(deltas, counts)], params)

    deltas = [stored_deltas(p, "safetensors", {}, manifest) for p in paths]  # each reads its header
    opened.clear()
    fast = step(deltas)
    assert sorted(opened) == sorted(map(str, paths))  # each update file opened once by the step
    per_tensor = [FileTensors(p) for p in paths]
    opened.clear()
    slow = step(per_tensor)
    assert len(opened) == 3 * len(current)  # what it was: one open per tensor
    exact = step([random_like(current, i + 1) for i in range(3)])  # the same deltas from memory
    assert all(torch.equal(fast[k], slow[k]) and torch.equal(fast[k], exact[k]) for k in current)
    assert not torch.equal(fast[manifest[0][0]], current[manifest[0][0]])
