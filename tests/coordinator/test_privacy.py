"""Worker-level DP at the coordinator (--dp-noise, --dp-clip, --dp-budget) and DP-SGD claims, through the real app."""
from __future__ import annotations

import pytest
import torch

from coordinator.config import CoordinatorConfig
from privacy.accountant import GaussianSteps, epsilon_spent
from privacy.dp import update_norm
from protocol.tensors import loads
from tests.helpers import make_adapter, push, put_expert, random_like, update_meta

NAME = "private_expert"


def weights(client) -> dict[str, torch.Tensor]:
    answer = client.get(f"/api/v1/experts/{NAME}/weights")
    assert answer.status_code == 200
    return loads(answer.data)


def test_a_step_applies_the_clipped_update(make_app):
    client = make_app(dp_noise=1e-9, dp_clip=0.5).test_client()  # noise far below the tolerance: clipping shows
    initial = make_adapter()
    assert put_expert(client, NAME, initial).status_code in (200, 201)
    delta = random_like(initial, seed=1)
    assert update_norm(delta) > 0.5
    assert push(client, NAME, delta, update_meta(worker_id="w1")).status_code == 202
    scale = 0.5 / update_norm(delta)
    after = weights(client)
    assert all(torch.allclose(after[k], initial[k] + scale * delta[k], atol=1e-6) for k in initial)


def test_budget_refuses_the_push_that_would_overspend_and_survives_a_restart(make_app):
    sigma = 2.0
    two, three = (epsilon_spent([GaussianSteps(sigma, 1.0, n)], 1e-5) for n in (2, 3))
    settings = {"dp_noise": sigma, "dp_clip": 1.0, "dp_budget": (two + three) / 2}
    client = make_app(**settings).test_client()
    initial = make_adapter()
    put_expert(client, NAME, initial)
    for version in range(2):
        assert push(client, NAME, random_like(initial, version), update_meta(version, worker_id="w1")).status_code == 202
    refused = push(client, NAME, random_like(initial, 9), update_meta(2, worker_id="w1"))
    assert refused.status_code == 409
    assert refused.json["error"]["code"] == "privacy_budget_spent"
    assert "--dp-budget" in refused.json["error"]["message"]
    spent = client.get(f"/api/v1/experts/{NAME}").json["privacy"]["dp_fedavg"]
    assert spent["steps"] == 2 and spent["epsilon"] == pytest.approx(two, abs=1e-5)
    assert (spent["delta"], spent["noise_multiplier"], spent["clip_norm"]) == (1e-5, sigma, 1.0)
    assert client.get(f"/api/v1/experts/{NAME}").json["version"] == 2  # nothing of the refused push was applied

    restarted = make_app(**settings).test_client()  # same data dir
    assert restarted.get(f"/api/v1/experts/{NAME}").json["privacy"]["dp_fedavg"]["steps"] == 2
    again = push(restarted, NAME, random_like(initial, 10), update_meta(2, worker_id="w1"))
    assert again.status_code == 409 and again.json["error"]["code"] == "privacy_budget_spent"


def test_fedbuff_step_is_one_clipped_contribution_per_worker_over_the_buffer_size(make_app):
    client = make_app(dp_noise=1e-9, dp_clip=1.0, aggregation="fedbuff", buffer_size=3).test_client()
    initial = make_adapter()
    put_expert(client, NAME, initial)
    first, second, other = (random_like(initial, seed, scale=0.01) for seed in (1, 2, 3))  # norms far below C
    for delta, worker in ((first, "w1"), (second, "w1"), (other, "w2")):
        assert push(client, NAME, delta, update_meta(0, worker_id=worker)).status_code == 202
    after = weights(client)
    expected = {k: initial[k] + (first[k] + second[k] + other[k]) / 3 for k in initial}
    assert all(torch.allclose(after[k], expected[k], atol=1e-6) for k in initial)


def test_a_dp_sgd_workers_claim_is_recorded_and_shown(make_app):
    client = make_app().test_client()
    initial = make_adapter()
    put_expert(client, NAME, initial)
    claim = {"mechanism": "dp-sgd", "epsilon": 2.5, "delta": 1e-6, "steps": 12, "noise_multiplier": 1.1,
             "max_grad_norm": 1.0, "sample_rate": 0.05, "accountant": "rdp", "budget": None}
    assert push(client, NAME, random_like(initial, 1), update_meta(worker_id="w7", privacy=claim)).status_code == 202
    shown = client.get(f"/api/v1/experts/{NAME}").json["privacy"]
    assert shown == {"dp_sgd": {"w7": {"epsilon": 2.5, "delta": 1e-6, "steps": 12}}}
    bad = push(client, NAME, random_like(initial, 2), update_meta(worker_id="w7", privacy={**claim, "epsilon": -1}))
    assert bad.status_code == 400 and "privacy: epsilon" in bad.json["error"]["message"]


@pytest.mark.parametrize("settings, message", [
    ({"dp_clip": 1.0}, "--dp-clip need(s) --dp-noise"),
    ({"dp_noise": 1.0}, "--dp-noise needs --dp-clip"),
    ({"dp_noise": 1.0, "dp_clip": 1.0, "dp_budget": 0.0}, "--dp-budget"),
    ({"dp_noise": 1.0, "dp_clip": 1.0, "aggregation": "fedbuff", "buffer_size": 3, "robust": "median"}, "--robust"),
])
def test_dp_flag_mistakes_name_the_flag(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CoordinatorConfig(data_dir=tmp_path, **settings)


def test_dp_noise_composes_with_secure_aggregation(tmp_path):
    """Refused until the workers added the noise themselves (tests/coordinator/test_cohorts_dp.py)."""
    config = CoordinatorConfig(data_dir=tmp_path, dp_noise=1.0, dp_clip=0.5, aggregation="fedbuff", buffer_size=4,
                               secure_aggregation=True)
    assert (config.dp.noise_multiplier, config.dp.clip_norm, config.secagg.cohort_size) == (1.0, 0.5, 4)
