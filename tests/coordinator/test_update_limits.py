"""The root's step rule as a relay applies it before its 202 (coordinator/checks/update_limits.py, coordinator/relay/checks.py):
a quick bound from peak magnitudes, and the exact sum whenever the bound cannot promise a finite result."""
from __future__ import annotations

import threading

import pytest
import torch

from coordinator.storage.blobs import BlobStore
from coordinator.relay.checks import RelayChecks
from coordinator.relay.relay_store import RelayStore
from coordinator.relay.relay_store_schema import CachedWeights
from coordinator.checks.update_limits import SAFE_MAGNITUDE, UpdateLimits, headroom, peak_magnitude, surely_finite
from protocol.errors import InvalidUpdate
from protocol.streaming import FileTensorsOnce
from protocol.tensors import dumps
from tests.helpers import make_adapter, random_like

ADAPTER = make_adapter()
FIRST, SECOND = sorted(ADAPTER)[:2]


def spiked(name: str, value: float = 3e38, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in (base or random_like(ADAPTER, 9)).items()}
    out[name][0, 0] = value
    return out


@pytest.fixture
def checks(tmp_path):
    store = RelayStore(tmp_path / "relay.sqlite")
    yield RelayChecks(store, BlobStore(tmp_path / "blobs"), threading.RLock())
    store.close()


def cached(checks: RelayChecks, weights: dict[str, torch.Tensor]) -> CachedWeights:
    return CachedWeights("e1", 0, "etag", checks.blobs.put_bytes(dumps(weights)), {})


def test_the_peak_of_a_file_read_as_one_buffer_is_the_peak_of_its_tensors(tmp_path):
    weights = spiked(SECOND, -7.5, ADAPTER)
    path = tmp_path / "w.safetensors"
    path.write_bytes(dumps(weights))
    assert peak_magnitude(FileTensorsOnce(path)) == peak_magnitude(weights) == 7.5
    assert headroom(weights) == SAFE_MAGNITUDE - 7.5
    assert headroom({k: v.half() for k, v in weights.items()}) == float("-inf")  # the bound is float32's only
    assert surely_finite(headroom(weights), 1.0, 1e38) and not surely_finite(headroom(weights), 1.0, 3.4e38)


def test_a_step_that_would_overflow_is_refused_and_one_the_bound_cannot_promise_is_summed(checks):
    weights = cached(checks, spiked(FIRST, base=ADAPTER))
    with pytest.raises(InvalidUpdate) as refused:
        checks.check_step(weights, spiked(FIRST), "u1", "e1")  # 3e38 + 3e38 at the same place
    assert refused.value.details == {"reason": "result_not_finite", "tensor": FIRST}
    checks.check_step(weights, spiked(SECOND), "u2", "e1")  # peaks in different tensors: the exact sum is finite
    checks.check_step(weights, random_like(ADAPTER, 3), "u3", "e1")  # the bound promises it
    checks.limits = UpdateLimits(server_lr=2.0)
    with pytest.raises(InvalidUpdate):  # 3e38 + 2 x 2e38: the root's --server-lr counts
        checks.check_step(weights, spiked(FIRST, 2e38), "u4", "e1")


def test_a_site_is_checked_at_the_larger_of_one_and_the_roots_step_size(checks):
    root = spiked(FIRST, 1e38, ADAPTER)
    owed = spiked(FIRST, 1.5e38, {k: torch.zeros_like(v) for k, v in ADAPTER.items()})
    checks.check_site(root, headroom(root), owed, "u1", "e1")  # 2.5e38 served, 2.5e38 stepped
    checks.limits = UpdateLimits(server_lr=2.0)
    with pytest.raises(InvalidUpdate):  # a step of 1e38 + 2 x 1.5e38 would overflow
        checks.check_site(root, headroom(root), owed, "u1", "e1")
    checks.limits = UpdateLimits(server_lr=0.5)
    checks.check_site(root, headroom(root), owed, "u1", "e1")
    with pytest.raises(InvalidUpdate):  # the site's own weights, 1e38 + 2.5e38, would
        checks.check_site(root, headroom(root), spiked(FIRST, 2.5e38, owed), "u1", "e1")


def test_the_roots_dp_reaches_a_relay_and_an_older_roots_answer_means_none():
    limits = UpdateLimits(dp=True)
    assert UpdateLimits.from_json(limits.to_json()).dp is True
    older = {k: v for k, v in limits.to_json().items() if k != "dp"}  # a root before relays took DP updates
    assert UpdateLimits.from_json(older).dp is False
    with pytest.raises(ValueError, match="dp must be true or false"):
        UpdateLimits.from_json(limits.to_json() | {"dp": "yes"})


def test_the_roots_dp_settings_under_secure_aggregation_reach_a_relay_and_are_checked():
    """What a relay's DP cohorts announce to their members comes from here (coordinator/relay/dp_cohorts.py)."""
    limits = UpdateLimits(dp=True, secure_aggregation=True, noise_multiplier=1.5, clip_norm=0.25)
    assert UpdateLimits.from_json(limits.to_json()) == limits
    older = {k: v for k, v in limits.to_json().items() if k not in ("secure_aggregation", "noise_multiplier",
                                                                    "clip_norm")}
    assert UpdateLimits.from_json(older) == UpdateLimits(dp=True)  # a root before relays ran DP cohorts
    with pytest.raises(ValueError, match="secure_aggregation must be true or false"):
        UpdateLimits.from_json(limits.to_json() | {"secure_aggregation": 1})
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="noise_multiplier and clip_norm must be positive"):
            UpdateLimits.from_json(limits.to_json() | {"clip_norm": bad})
