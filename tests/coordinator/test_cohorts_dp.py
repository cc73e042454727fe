"""--dp-noise with --secure-aggregation through the real coordinator app served on loopback: its own aggregator
and applier thread, members' protocol sessions over HTTP driven from this thread (no training: random deltas)."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from coordinator.privacy_ledger import PrivacyLedgers
from privacy.accountant import GaussianSteps, epsilon_spent
from privacy.secagg.settings import SecAggSettings
from privacy.secagg.session import CohortSession
from privacy.secagg.vector import flatten
from protocol.tensors import loads, manifest_of
from protocol.client import CoordinatorClient
from tests.helpers import expert_spec, make_adapter, put_expert, random_like, serve_on_loopback

NAME = "private_expert"
WORKERS = ["w0", "w1", "w2", "w3"]
SIGMA, CLIP = 1.0, 1.0


@pytest.fixture
def dp_secure_app(make_app):
    """(app, the members' transport over HTTP) for a root with --dp-noise and --secure-aggregation (no auth)."""
    servers = []

    def start(**extra):
        app = make_app(aggregation="fedbuff", buffer_size=4, secure_aggregation=True, staleness_decay=0.0, auth=False,
                       dp_noise=SIGMA, dp_clip=CLIP, secagg=SecAggSettings(4, input_timeout=2.0), **extra)
        server, url = serve_on_loopback(app)
        servers.append(server)
        return app, CoordinatorClient(url).cohorts

    yield start
    for server in servers:
        server.shutdown()


def flat_weights(client, manifest):
    answer = client.get(f"/api/v1/experts/{NAME}/weights")
    assert answer.status_code == 200
    return flatten(loads(answer.data), manifest)


def wait_until(condition, timeout=30.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def cohort(transport, deltas, senders, base_version):
    """Open a cohort of the four workers, send ``senders``' deltas; the others drop after the key rounds."""
    sessions = {w: CohortSession(transport, NAME, w) for w in WORKERS}
    for _ in range(4):
        for session in sessions.values():
            session.advance()
    for name in senders:
        sessions[name].submit(deltas[name], 10, {"base_version": base_version}, rounding_seed=3)
    return sessions


class JoinsInProcess:
    """The members' HTTP transport, except that joining goes to the aggregator itself: a cohort that formed before
    the budget ran out (the join route refuses once it is spent)."""

    def __init__(self, http, agg):
        self.http, self.agg = http, agg

    def join(self, expert, worker):
        return self.agg.join(expert, worker)

    def __getattr__(self, name):
        return getattr(self.http, name)


def advance(sessions):
    for session in sessions.values():
        session.advance()


def clipped_sum(deltas, senders):
    return sum(d * min(1.0, CLIP / np.linalg.norm(d)) for name, d in deltas.items() if name in senders)


def test_dp_cohorts_book_the_central_epsilon_and_step_by_the_noised_sum_over_k(dp_secure_app, tmp_path):
    app, members = dp_secure_app()
    client = app.test_client()
    initial = make_adapter(rank=8)
    assert put_expert(client, NAME, initial, expert_spec(rank=8)).status_code == 201
    manifest = manifest_of(initial)
    steps = []
    for version, senders in ((0, WORKERS), (1, WORKERS[:3])):  # a full cohort, then one whose w3 drops
        before = flat_weights(client, manifest)
        deltas = {w: flatten(random_like(initial, 10 * version + i, scale=1.0), manifest) for i, w in enumerate(WORKERS)}
        sessions = cohort(members, deltas, senders, version)
        wait_until(lambda: advance(sessions) or all(sessions[w].outcome for w in senders))  # applied, members told
        assert client.get(f"/api/v1/experts/{NAME}").json["version"] == version + 1
        steps.append(flat_weights(client, manifest) - before - clipped_sum(deltas, senders) / 4)
    # what is left of each step is the noise: sigma C sqrt(S/K) / K per coordinate, 0.25 with every input and 0.217
    # with 3 of 4 (352 coordinates: 5 standard errors of the sample std is 19%); an unclipped update (norm ~19) or
    # a second dose of noise at the coordinator would be far outside
    for noise, survivors in zip(steps, (4, 3)):
        assert noise.std() == pytest.approx(SIGMA * CLIP * math.sqrt(survivors / 4) / 4, rel=0.19)
    shown = client.get(f"/api/v1/experts/{NAME}").json["privacy"]["dp_fedavg"]
    central = PrivacyLedgers(tmp_path, app.extensions["fedmoe"].config.dp)
    central.book_step("central")  # one central DP-FedAvg step, booked by the same code the central path uses
    assert shown["steps"] == 2
    expected = epsilon_spent([GaussianSteps(SIGMA, 1.0, 1), GaussianSteps(SIGMA * math.sqrt(3 / 4), 1.0, 1)], 1e-5)
    assert shown["epsilon"] == pytest.approx(expected, abs=1e-6)
    # the full cohort cost exactly one central step: the first segment of the ledger is the central ledger
    assert app.extensions["fedmoe"].privacy._ledgers[NAME].history[0] == central._ledgers["central"].history[0]


def test_a_cohort_the_budget_cannot_pay_for_is_abandoned_unopened_and_joining_is_refused(dp_secure_app):
    one, two = (epsilon_spent([GaussianSteps(SIGMA, 1.0, n)], 1e-5) for n in (1, 2))
    app, members = dp_secure_app(dp_budget=(one + two) / 2)
    client, agg = app.test_client(), app.extensions["fedmoe_secagg"]
    initial = make_adapter()
    put_expert(client, NAME, initial)
    manifest = manifest_of(initial)
    deltas = {w: flatten(random_like(initial, i), manifest) for i, w in enumerate(WORKERS)}
    sessions = cohort(members, deltas, WORKERS, 0)
    wait_until(lambda: advance(sessions) or all(s.outcome for s in sessions.values()))
    assert client.get(f"/api/v1/experts/{NAME}").json["version"] == 1
    sessions = cohort(JoinsInProcess(members, agg), deltas, WORKERS, 1)
    wait_until(lambda: advance(sessions) or agg.cohorts()[-1]["phase"] == "abandoned")
    assert "privacy budget is spent" in agg.cohorts()[-1]["reason"]
    advance(sessions)
    assert all(s.outcome is False for s in sessions.values())  # each member re-queues its delta
    info = client.get(f"/api/v1/experts/{NAME}").json
    assert info["version"] == 1 and info["privacy"]["dp_fedavg"]["steps"] == 1  # never booked, never applied
    refused = client.post(f"/api/v1/experts/{NAME}/cohorts", json={"worker_id": "w0"})
    assert refused.status_code == 409 and refused.json["error"]["code"] == "privacy_budget_spent"
