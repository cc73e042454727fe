"""Secure aggregation with real processes: a coordinator on loopback, workers training tiny-qwen2 in this process.

Four workers train from the same expert with the same seeds against a plain FedBuff coordinator
(--buffer-size 4) and against one with --secure-aggregation: the expert's next version must be the
same up to quantisation, while the secure coordinator accepted no individual update. A member that
leaves after the key rounds is recovered from its peers' shares (the step is the survivors' mean),
each masked input the coordinator holds meanwhile is unreadable alone, and a push in the clear is
refused. A relay unmasks its site's cohort and forwards only the sum. kill -9 of the coordinator
mid-cohort loses no acknowledged masked input and applies nothing with masks left in it. The last
two drive the members' own protocol sessions with random deltas: no training needed.
"""
from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import pytest

from bench.common import CoordinatorProcess
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.session import CohortSession
from privacy.secagg.vector import flatten
from protocol.client import CoordinatorClient
from protocol.tensors import manifest_of
from tests.e2e.test_relay import admin, forward_now, start_pair, worker_client
from tests.helpers import expert_spec, make_adapter, random_like
from protocol.errors import Forbidden
from worker.data import load_examples, sample_dataset_path, split_examples
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

EXPERT = "docs_expert"
WORKERS = ["w0", "w1", "w2", "w3"]
RELAY_SECURE = ("--aggregation", "fedbuff", "--buffer-size", "4", "--secure-aggregation")
SECURE = ("--aggregation", "fedbuff", "--buffer-size", "4", "--secure-aggregation", "--secagg-round-timeout", "20")


@pytest.fixture(scope="module")
def base():
    return load_base_model("tiny-qwen2")


def make_workers(base, url, secure):
    train, _ = split_examples(load_examples(sample_dataset_path(EXPERT)))
    workers = []
    for i, name in enumerate(WORKERS):
        own = dataclasses.replace(base, model=copy.deepcopy(base.model))
        trainer = LoraTrainer(own, LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64, seed=i),
                              train[i::4])
        spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
        workers.append(FederatedWorker(SyncSettings(specialty=EXPERT, worker_id=name, secure_aggregation=secure),
                                       CoordinatorClient(url), trainer, spec))
    for worker in workers:
        worker.joining.join()
    return workers


def wait_for(condition, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def one_round(workers):
    for worker in workers:
        worker.interval.add(worker.trainer.train_steps(2))
        worker.sync()


def close_sessions(workers):
    """Let every worker learn its cohort's outcome, then stop its secure-aggregation thread."""
    wait_for(lambda: all(not w.secure.sent for w in workers), what="every worker to learn its cohort's outcome")
    for worker in workers:
        worker.secure.close()


def run_one_round(start_coordinator, base, *flags):
    _, url = start_coordinator(*flags)
    secure = "--secure-aggregation" in flags
    workers = make_workers(base, url, secure)
    if secure:
        wait_for(lambda: all(w.secure.session.can_submit for w in workers), what="the cohort's keys and shares")
    one_round(workers)
    client = CoordinatorClient(url)
    wait_for(lambda: client.experts.get(EXPERT)["version"] == 1, what="the expert's version 1")
    weights = client.experts.pull(EXPERT).tensors
    if secure:
        close_sessions(workers)
    return url, client, workers, weights


def accepted_updates(client):
    return [e["message"].split()[1] for e in client.transport.json("GET", "/events", params={"kind": "update_accepted"})["events"]]


def test_four_workers_with_secure_aggregation_equal_plain_fedbuff_up_to_quantisation(start_coordinator, base, tmp_path):
    _, _, _, plain = run_one_round(start_coordinator, base, "--aggregation", "fedbuff", "--buffer-size", "4",
                                   "--data-dir", str(tmp_path / "plain"))
    url, client, workers, secure = run_one_round(start_coordinator, base, *SECURE, "--data-dir", str(tmp_path / "secure"))
    assert plain.keys() == secure.keys()
    worst = max(float((plain[k] - secure[k]).abs().max()) for k in plain)
    assert 0 < worst < 1e-5, worst  # equal up to quantisation (not bit-equal: the sum went through Z_2^32)
    info = client.experts.get(EXPERT)
    assert info["updates_applied"] == 1 and info["samples_seen"] == 4 * 2 * 2  # one cohort: 4 workers x 2 steps x 2
    assert all(w.secure.owed.carried is None for w in workers)  # every worker learned its input counted
    (cohort,) = [c for c in client.transport.json("GET", "/cohorts")["cohorts"] if c["phase"] == "applied"]
    assert sorted(cohort["members"]) == WORKERS
    # The coordinator accepted one update, the cohort's: no worker's own update id ever reached it as an update.
    assert accepted_updates(client) == [f"secagg-{cohort['cohort_id']}"]


def test_a_member_dropping_after_the_key_rounds_is_recovered_and_no_input_is_readable_alone(
        start_coordinator, base, tmp_path):
    data_dir = tmp_path / "secure"
    _, url = start_coordinator(*SECURE, "--secagg-input-timeout", "10", "--data-dir", str(data_dir))
    workers = make_workers(base, url, secure=True)
    client = CoordinatorClient(url)
    before = client.experts.pull(EXPERT).tensors
    for worker in workers[:3]:  # trained before the input round opens: its deadline is then only waited on
        worker.interval.add(worker.trainer.train_steps(2))
    wait_for(lambda: all(w.secure.session.can_submit for w in workers), what="the cohort's keys and shares")
    cohort_id, quant = workers[0].secure.session.cohort_id, workers[0].secure.session.member.config.quant
    workers[3].secure.close()  # w3 holds its shares and masks, then leaves without sending its input
    for worker in workers[:3]:
        worker.sync()
    # While the cohort waits for w3, what the coordinator holds of each input is masked: not decodable alone,
    # and uncorrelated with the member's delta.
    stored = sorted((data_dir / "secagg" / cohort_id).glob("*.u32"))
    assert len(stored) == 3, client.transport.json("GET", "/cohorts")
    deltas = [w.secure.owed.in_flight[cohort_id].copy() for w in workers[:3]]
    for path, delta in zip(stored, deltas):
        masked = np.frombuffer(path.read_bytes(), dtype="<u4")
        with pytest.raises(BadSecAggMessage, match="masks did not cancel"):
            quant.decode_sum(masked.copy())  # its weight field is masked too
        assert abs(np.corrcoef(masked[:-1].view(np.int32).astype(np.float64), delta)[0, 1]) < 0.05
    wait_for(lambda: client.experts.get(EXPERT)["version"] == 1, what="the cohort recovered without w3")
    close_sessions(workers[:3])
    after = client.experts.pull(EXPERT).tensors
    manifest = workers[0].pipeline.manifest()
    step = flatten({k: after[k] - before[k] for k in after}, manifest)
    cohorts = {c["cohort_id"]: c for c in client.transport.json("GET", "/cohorts")["cohorts"]}
    cohort = cohorts[cohort_id]
    assert cohort["phase"] == "applied" and cohort["inputs"] == 3, cohort
    assert client.experts.get(EXPERT)["samples_seen"] == 3 * 2 * 2  # w3's samples are not counted
    assert accepted_updates(client) == [f"secagg-{cohort_id}"]
    assert all(w.secure.owed.carried is None for w in workers[:3])
    # The step is the three survivors' mean delta (equal sample counts), up to quantisation: w3's masks cancelled.
    assert 0 < np.abs(step - np.mean(deltas, axis=0)).max() < 1e-5
    # A push in the clear to a secure-aggregation expert is refused, with a message saying what to do.
    with pytest.raises(Forbidden, match="only through secure-aggregation cohorts") as refused:
        client.updates.push(EXPERT, b"x" * 16, {"update_id": "w0-clear", "base_version": 1, "num_samples": 1,
                                               "worker_id": "w0"})
    assert refused.value.status == 403


def advance_all(sessions):
    for session in sessions:
        session.advance()


def member_sessions(clients, expert):
    """The protocol's own member sessions over HTTP, one per registered client (no training: random deltas)."""
    return [CohortSession(c.cohorts, expert, name) for c, name in zip(clients, WORKERS)]


def random_deltas(adapter, manifest, count):
    return [flatten(random_like(adapter, i, scale=0.01), manifest) for i in range(count)]


def root_step(root_admin, adapter, manifest):
    return flatten({k: v - adapter[k] for k, v in root_admin.experts.pull("e1").tensors.items()}, manifest)


def cohort_ready_to_submit(url: str, tmp_path) -> tuple:
    """Expert e1 created through ``url``, the four WORKERS' sessions past the key rounds, and one random delta each:
    (adapter, manifest, clients, sessions, deltas)."""
    adapter = make_adapter()
    clients = [worker_client(url, tmp_path, name) for name in WORKERS]
    clients[0].experts.create("e1", adapter, expert_spec())
    manifest = manifest_of(adapter)
    sessions = member_sessions(clients, "e1")
    wait_for(lambda: advance_all(sessions) or all(s.can_submit for s in sessions), what="the cohort's shares")
    return adapter, manifest, clients, sessions, random_deltas(adapter, manifest, 4)


def test_a_relay_unmasks_its_sites_cohort_and_forwards_only_the_sum(tmp_path):
    root, relay = start_pair(tmp_path, *RELAY_SECURE, "--forward-interval", "3600", root_flags=RELAY_SECURE)
    try:
        adapter, manifest, clients, sessions, deltas = cohort_ready_to_submit(relay.url, tmp_path)
        for i, (session, delta) in enumerate(zip(sessions, deltas)):
            session.submit(delta, 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
        wait_for(lambda: advance_all(sessions) or all(s.outcome for s in sessions), what="the relay to unmask its cohort")
        assert forward_now(relay)["delivered"] == 1
        root_admin = admin(root)
        assert root_admin.experts.get("e1")["samples_seen"] == 40 and root_admin.experts.get("e1")["updates_applied"] == 1
        step = root_step(root_admin, adapter, manifest)
        assert 0 < np.abs(step - np.mean(deltas, axis=0)).max() < 1e-6  # the cohort's mean, up to quantisation
        # The relay accepted only the cohort's sum, and the root only the relay's batch of it.
        relay_admin = CoordinatorClient(relay.url, token=(relay.data_dir / "admin_token").read_text().strip())
        assert [u.startswith("secagg-e1-") for u in accepted_updates(relay_admin)] == [True]
        assert [u.startswith("site-a.") for u in accepted_updates(root_admin)] == [True]
        with pytest.raises(Forbidden, match="only through secure-aggregation cohorts"):
            clients[0].updates.push("e1", b"x" * 16, {"update_id": "w0-clear", "base_version": 1, "num_samples": 1,
                                                     "worker_id": "w0"})
    finally:
        relay.stop()
        root.stop()


def test_kill_9_mid_cohort_loses_no_acknowledged_input_and_applies_no_partial_sum(tmp_path):
    root = CoordinatorProcess(tmp_path / "root", *RELAY_SECURE, new_session=True)
    root.start()
    try:
        (tmp_path / "join").write_text((tmp_path / "root" / "join_token").read_text())
        adapter, manifest, clients, sessions, deltas = cohort_ready_to_submit(root.url, tmp_path)
        for i in (0, 1):  # two inputs acknowledged (202), then the coordinator is killed
            sessions[i].submit(deltas[i], 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
        root.kill()
        root.start()  # same data dir, a new port: the members follow it
        for client in clients:
            client.transport.base_url = root.url
        root_admin = admin(root)
        (cohort,) = root_admin.transport.json("GET", "/cohorts")["cohorts"]
        assert cohort["phase"] == "mask" and cohort["inputs"] == 2, cohort  # resumed, both inputs kept
        assert root_admin.experts.get("e1")["version"] == 0  # nothing applied with masks left in it
        for i in (2, 3):
            sessions[i].submit(deltas[i], 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
        wait_for(lambda: advance_all(sessions) or all(s.outcome for s in sessions), what="the resumed cohort")
        assert root_admin.experts.get("e1")["samples_seen"] == 40 and root_admin.experts.get("e1")["updates_applied"] == 1
        assert 0 < np.abs(root_step(root_admin, adapter, manifest) - np.mean(deltas, axis=0)).max() < 1e-6
    finally:
        root.stop()


def test_kill_9_of_a_relay_mid_cohort_loses_no_acknowledged_input_and_forwards_no_partial_sum(tmp_path):
    """The relay's own cohort, killed after two of four masked inputs were acknowledged: restarted on its data dir,
    it keeps both, forwards nothing while the cohort waits, and forwards the unmasked sum once it completes."""
    root, relay = start_pair(tmp_path, *RELAY_SECURE, "--forward-interval", "3600", root_flags=RELAY_SECURE)
    try:
        adapter, manifest, clients, sessions, deltas = cohort_ready_to_submit(relay.url, tmp_path)
        for i in (0, 1):  # two inputs acknowledged (202) by the relay, then it is killed
            sessions[i].submit(deltas[i], 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
        relay.kill()
        relay.start()  # same data dir, a new port: the members follow it
        for client in clients:
            client.transport.base_url = relay.url
        relay_admin = CoordinatorClient(relay.url, token=(relay.data_dir / "admin_token").read_text().strip())
        (cohort,) = relay_admin.transport.json("GET", "/cohorts")["cohorts"]
        assert cohort["phase"] == "mask" and cohort["inputs"] == 2, cohort  # resumed, both inputs kept
        assert forward_now(relay)["delivered"] == 0  # nothing to forward: no sum exists while masks remain
        root_admin = admin(root)
        assert root_admin.experts.get("e1")["version"] == 0
        for i in (2, 3):
            sessions[i].submit(deltas[i], 10, {"base_version": 0, "update_id": f"u{i}"}, rounding_seed=i)
        wait_for(lambda: advance_all(sessions) or all(s.outcome for s in sessions), what="the resumed relay cohort")
        assert forward_now(relay)["delivered"] == 1
        info = root_admin.experts.get("e1")
        assert info["samples_seen"] == 40 and info["updates_applied"] == 1 and info["version"] == 1
        step = root_step(root_admin, adapter, manifest)
        assert np.isfinite(step).all()
        # what an uninterrupted run gives (test_a_relay_unmasks_its_sites_cohort_...): the mean, up to quantisation
        assert 0 < np.abs(step - np.mean(deltas, axis=0)).max() < 1e-6
        assert [u.startswith("secagg-e1-") for u in accepted_updates(relay_admin)] == [True]
    finally:
        relay.stop()
        root.stop()
