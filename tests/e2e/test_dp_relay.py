"""DP-FedAvg with secure aggregation through a relay, with real processes (a root and a relay on loopback).

The relay's site cohort is a DP cohort with the root's sigma and C (each member clips and adds its noise share);
the root books the cohort's step before the relay unmasks it, once, and applies the forwarded sum over K as it is.
The root refuses what is not such a cohort's sum, and a relay whose --secure-aggregation does not fit its DP root
stops at start with one line. The members' own protocol sessions run with chosen deltas: no training needed.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import requests

from bench.common import CoordinatorProcess
from privacy.secagg.noise import CohortNoise
from privacy.secagg.vector import flatten
from protocol.errors import Conflict, PrivacyBudgetSpent
from protocol.tensors import dumps, manifest_of
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.e2e.test_relay import admin, forward_now, start_pair, worker_client
from tests.e2e.test_secure_aggregation import (WORKERS, accepted_updates, advance_all, member_sessions, root_step,
                                               wait_for)
from tests.helpers import expert_spec, make_adapter, random_like

pytestmark = pytest.mark.e2e
SECURE = ("--aggregation", "fedbuff", "--buffer-size", "4", "--secure-aggregation")
SCALES = (0.03, 0.002, 0.02, 0.001)
"""Two large deltas (clipped) and two small ones (not): C lies between their norms."""


def site_deltas() -> tuple[dict, list, list[np.ndarray], float]:
    """(adapter, manifest, the four members' flat deltas, a C that clips exactly the two large ones)."""
    adapter = make_adapter()
    manifest = manifest_of(adapter)
    deltas = [flatten(random_like(adapter, i, scale=s), manifest) for i, s in enumerate(SCALES)]
    norms = sorted(float(np.linalg.norm(d)) for d in deltas)
    return adapter, manifest, deltas, round((norms[1] + norms[2]) / 2, 6)


def clip(delta: np.ndarray, c: float) -> np.ndarray:
    norm = float(np.linalg.norm(delta))
    return delta * (c / norm) if norm > c else delta


def site_cohort(relay: CoordinatorProcess, tmp_path, adapter) -> list:
    """Expert e1 created through the relay; the four members' sessions past the key rounds."""
    clients = [worker_client(relay.url, tmp_path, name) for name in WORKERS]
    clients[0].experts.create("e1", adapter, expert_spec())
    sessions = member_sessions(clients, "e1")
    wait_for(lambda: advance_all(sessions) or all(s.can_submit for s in sessions), what="the cohort's shares")
    return sessions


def submit_all(sessions, deltas) -> None:
    for i, (session, delta) in enumerate(zip(sessions, deltas)):
        session.submit(delta, 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
    wait_for(lambda: advance_all(sessions) or all(s.outcome is not None for s in sessions),
             what="the relay to finish its cohort")


def test_a_relays_dp_cohort_is_booked_once_and_applied_as_the_clipped_sum_over_k(tmp_path):
    """Root and relay with --secure-aggregation, the root with --dp-noise 1e-9 (far below the tolerance, so the
    clipping shows) --dp-clip C: the members are told sigma and C, the root's step is sum_u clip(d_u, C) / K, its
    ledger books one step under the cohort's id, and the root never holds a worker's own update."""
    adapter, manifest, deltas, c = site_deltas()
    root, relay = start_pair(tmp_path, *SECURE, "--forward-interval", "3600",
                             root_flags=(*SECURE, "--dp-noise", "1e-9", "--dp-clip", str(c)))
    try:
        sessions = site_cohort(relay, tmp_path, adapter)
        assert {s.member.config.dp for s in sessions} == {CohortNoise(1e-9, c)}  # the root's, through the relay
        submit_all(sessions, deltas)
        assert all(s.outcome for s in sessions), [s.reason for s in sessions]
        assert forward_now(relay)["delivered"] == 1
        root_admin = admin(root)
        expert = root_admin.experts.get("e1")
        assert expert["version"] == 1 and expert["privacy"]["dp_fedavg"]["steps"] == 1, expert
        assert expert["privacy"]["dp_fedavg"]["noise_multiplier"] == 1e-9
        expected = sum(clip(d, c) for d in deltas) / 4  # two clipped to C, two as they were; equal weights over K
        assert sum(float(np.linalg.norm(d)) > c for d in deltas) == 2
        assert np.abs(root_step(root_admin, adapter, manifest) - expected).max() < 1e-6
        # booked once: by the relay before it unmasked, and not again when the batch came
        (cohort,) = requests.get(f"{relay.url}/api/v1/cohorts", headers=relay.headers, timeout=10).json()["cohorts"]
        booked = json.loads((root.data_dir / "privacy.json").read_text())["e1"]["cohorts_booked"]
        assert booked == [f"secagg-{cohort['cohort_id']}"]
        # the root accepted one update, the relay's batch of the cohort's sum; no worker's update id anywhere in it
        assert [u.startswith("site-a.") for u in accepted_updates(root_admin)] == [True]
        events = json.dumps(root_admin.transport.json("GET", "/events", params={"limit": 500}))
        assert not any(f'"u{i}"' in events or f" u{i} " in events for i in range(4))
        relay_admin = admin(relay)
        assert [u.startswith("secagg-e1-") for u in accepted_updates(relay_admin)] == [True]
    finally:
        relay.stop()
        root.stop()


def test_a_relays_dp_cohort_the_budget_cannot_pay_for_is_abandoned_unopened(tmp_path):
    """--dp-budget 8 with sigma 1e-9: no step fits. The root refuses to book the relay's cohort (409
    privacy_budget_spent), so the relay abandons it with its masks on: nothing is forwarded or booked, and every
    member learns its input was not counted (it keeps its delta for a later cohort); a later join is refused."""
    adapter, _, deltas, c = site_deltas()
    root, relay = start_pair(tmp_path, *SECURE, "--forward-interval", "3600",
                             root_flags=(*SECURE, "--dp-noise", "1e-9", "--dp-clip", str(c), "--dp-budget", "8"))
    try:
        sessions = site_cohort(relay, tmp_path, adapter)
        submit_all(sessions, deltas)
        assert [s.outcome for s in sessions] == [False] * 4
        assert all("privacy_budget_spent" in s.reason for s in sessions), sessions[0].reason
        assert forward_now(relay)["delivered"] == 0
        expert = admin(root).experts.get("e1")
        assert expert["version"] == 0 and expert["privacy"]["dp_fedavg"]["steps"] == 0, expert
        (cohort,) = requests.get(f"{relay.url}/api/v1/cohorts", headers=relay.headers, timeout=10).json()["cohorts"]
        assert cohort["phase"] == "abandoned"
        assert accepted_updates(admin(relay)) == []  # no sum was ever made at the relay
        # told so once, the relay refuses new cohorts of the expert, as the root does, instead of forming more
        # that each end abandoned at booking
        with pytest.raises(PrivacyBudgetSpent):
            worker_client(relay.url, tmp_path, WORKERS[0]).cohorts.join("e1", WORKERS[0])
    finally:
        relay.stop()
        root.stop()


def batch_meta(update_id: str, members: dict, **extra) -> dict:
    return {"update_id": update_id, "base_version": 0, "num_samples": 40, "members": members, **extra}


DIGEST = "ab" * 32


def test_a_dp_root_under_secure_aggregation_takes_only_dp_cohort_sums_with_its_sigma_and_c(tmp_path):
    """Pushed straight to a root with --secure-aggregation --dp-noise 1 --dp-clip 0.5 --dp-budget B (B between one and
    two steps' epsilon), with the admin token as a relay would: a batch of several workers, and one of a single named
    worker (the root clips nothing under secure aggregation), are 409 dp_relay_batch; a cohort sum with another sigma
    or C is 409 dp_cohort_mismatch; the right one is one booked step applied as sent; the next is 409
    privacy_budget_spent, at the booking route too."""
    from privacy.accountant import GaussianSteps, epsilon_spent

    one, two = (epsilon_spent([GaussianSteps(1.0, 1.0, n)], 1e-5) for n in (1, 2))
    root = CoordinatorProcess(tmp_path / "root", *SECURE, "--staleness-decay", "0", "--dp-noise", "1", "--dp-clip",
                              "0.5", "--dp-budget", f"{(one + two) / 2:.6f}")
    root.start()
    try:
        client = admin(root)
        adapter = make_adapter()
        client.experts.create("e1", adapter, expert_spec())
        body = dumps(random_like(adapter, 7, scale=0.01))
        cohort = {"cohort": "secagg-e1-aa", "members": 4, "survivors": 4, "noise_multiplier": 1.0, "clip_norm": 0.5}
        refusals = [
            ("dp_relay_batch", batch_meta("b1", {"w0-u": DIGEST, "w1-u": DIGEST})),
            ("dp_relay_batch", batch_meta("b2", {"w0-u": DIGEST}, worker_id="w0")),
            ("dp_cohort_mismatch", batch_meta("b3", {"secagg-e1-aa": DIGEST},
                                              dp_cohort=cohort | {"noise_multiplier": 0.5})),
            ("dp_cohort_mismatch", batch_meta("b4", {"secagg-e1-aa": DIGEST}, dp_cohort=cohort | {"clip_norm": 1.0})),
            ("dp_relay_batch", batch_meta("b5", {"w0-u": DIGEST}, dp_cohort=cohort)),  # not the cohort's own id
        ]
        for reason, meta in refusals:
            with pytest.raises(Conflict) as refused:
                client.updates.push("e1", body, meta)
            assert refused.value.status == 409 and refused.value.details.get("reason") == reason, (meta, refused.value)
        assert client.experts.get("e1")["privacy"]["dp_fedavg"]["steps"] == 0  # nothing booked by a refusal
        client.updates.push("e1", body, batch_meta("b6", {"secagg-e1-aa": DIGEST}, dp_cohort=cohort))
        expert = client.experts.get("e1")
        assert expert["version"] == 1 and expert["privacy"]["dp_fedavg"]["steps"] == 1
        assert expert["privacy"]["dp_fedavg"]["epsilon"] == pytest.approx(one, abs=1e-5)
        sent, after = random_like(adapter, 7, scale=0.01), client.experts.pull("e1").tensors
        assert all((after[k] - adapter[k] - sent[k]).abs().max() < 1e-6 for k in adapter)  # not clipped, not noised
        with pytest.raises(Conflict) as spent:
            client.updates.push("e1", body, batch_meta("b7", {"secagg-e1-bb": DIGEST},
                                                       dp_cohort=cohort | {"cohort": "secagg-e1-bb"}))
        assert spent.value.code == "privacy_budget_spent"
        booking = requests.post(f"{root.url}/api/v1/experts/e1/dp-cohorts", headers=root.headers, timeout=10,
                                json=cohort | {"cohort": "secagg-e1-cc"})
        assert booking.status_code == 409 and booking.json()["error"]["code"] == "privacy_budget_spent"
        assert client.experts.get("e1")["version"] == 1
    finally:
        root.stop()


def relay_start_error(tmp_path, root: CoordinatorProcess, *flags: str) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    join = tmp_path / "join"
    join.write_text((root.data_dir / "join_token").read_text())
    done = launcher.run(
        [sys.executable, str(ROOT / "run_coordinator.py"), "--port", "0", "--host", "127.0.0.1", "--data-dir",
         str(tmp_path / "relay"), "--upstream", root.url, "--join-token-file", str(join),
         "--relay-join-token-file", str(root.data_dir / "relay_join_token"), *flags],
        env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return line


def test_a_relay_whose_secure_aggregation_does_not_fit_its_dp_root_stops_with_one_line(tmp_path):
    root = CoordinatorProcess(tmp_path / "root", *SECURE, "--dp-noise", "1", "--dp-clip", "0.5")
    root.start()
    try:  # the root clips nothing under secure aggregation: a relay forwarding each worker's update would skip DP
        line = relay_start_error(tmp_path / "a", root)
        assert "start this relay with --secure-aggregation" in line
    finally:
        root.stop()
    root = CoordinatorProcess(tmp_path / "root2", "--dp-noise", "1", "--dp-clip", "0.5")
    root.start()
    try:  # the root clips each worker's update itself: it takes no cohort's sum
        line = relay_start_error(tmp_path / "b", root, *SECURE)
        assert "start this relay without --secure-aggregation" in line
    finally:
        root.stop()
