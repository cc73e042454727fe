"""Cohorts end to end in one process: workers' sessions talk to a ``SecureAggregator`` directly (the
HTTP layer maps one request to one of its methods), with a journal in tmp_path and a hand-driven clock."""
import numpy as np
import pytest

from privacy.secagg.aggregator import SecAggSettings, SecureAggregator
from privacy.secagg.errors import CohortStateError
from privacy.secagg.journal import CohortJournal
from privacy.secagg.session import CohortSession, OwedDelta

NUMEL = 300
WORKERS = ["w0", "w1", "w2", "w3"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def aggregator(tmp_path, clock, **settings):
    settings = {"cohort_size": 4, "clip": 0.5, "max_weight": 100, "round_timeout": 10, "input_timeout": 100} | settings
    return SecureAggregator(CohortJournal(tmp_path / "cohorts"), SecAggSettings(**settings), lambda e: NUMEL, clock)


def open_cohort(agg, workers=WORKERS):
    sessions = {w: CohortSession(agg, "python_expert", w) for w in workers}
    for _ in range(4):  # join, keys, shares, open shares: one round trip each
        for session in sessions.values():
            session.advance()
    assert all(s.can_submit for s in sessions.values()), {w: s.phase for w, s in sessions.items()}
    return sessions


def deltas(seed=0):
    rng = np.random.default_rng(seed)
    return {w: rng.normal(0, 0.02, NUMEL) for w in WORKERS}


def submit(sessions, delta, names, samples=None):
    for name in names:
        sessions[name].submit(delta[name], (samples or {}).get(name, 10), {"base_version": 3}, rounding_seed=5)


def finish(sessions):
    for _ in range(2):
        for session in sessions.values():
            session.advance()


def test_a_full_cohort_gives_the_weighted_mean_and_every_member_learns_it_counted(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    samples = {"w0": 10, "w1": 30, "w2": 20, "w3": 40}
    submit(sessions, delta, WORKERS, samples)
    finish(sessions)  # the unmasking round
    [ready] = agg.ready()
    expected = sum(samples[w] * delta[w] for w in WORKERS) / 100
    np.testing.assert_allclose(ready.mean, expected, atol=4 / (ready.config.quant.scale * 100))
    assert ready.weight == 100 and ready.members == tuple(WORKERS)
    assert ready.update_id.startswith("secagg-python_expert-")
    agg.applied(ready.config.cohort_id)
    finish(sessions)
    assert all(s.outcome is True for s in sessions.values())
    assert agg.ready() == []
    assert not list((tmp_path / "cohorts" / ready.config.cohort_id).glob("*.u32"))  # inputs dropped once applied


def test_one_of_four_dropping_after_masking_is_recovered_and_its_delta_requeued(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    owed = {w: OwedDelta() for w in WORKERS}
    for w in WORKERS:
        owed[w].submitted(sessions[w].cohort_id, delta[w])
    submit(sessions, delta, ["w0", "w1", "w2"])  # w3 trained, masked... and vanished before sending
    finish(sessions)
    assert agg.ready() == []  # still waiting for w3
    clock.now += 101  # w3's input deadline passes
    agg.tick()
    finish(sessions)
    [ready] = agg.ready()
    np.testing.assert_allclose(ready.mean, sum(delta[w] for w in ["w0", "w1", "w2"]) / 3, atol=1e-6)
    agg.applied(ready.config.cohort_id)
    finish(sessions)
    assert [sessions[w].outcome for w in WORKERS] == [True, True, True, False]
    for w in WORKERS:
        owed[w].settle(sessions[w].cohort_id, sessions[w].outcome)
    assert owed["w0"].carried is None
    fresh = np.ones(NUMEL)
    np.testing.assert_array_equal(owed["w3"].next_delta(fresh), fresh + delta["w3"])  # folded into its next cohort


def test_a_cohort_below_threshold_is_abandoned_and_every_delta_requeued(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    owed = {w: OwedDelta() for w in WORKERS}
    for w in WORKERS:
        owed[w].submitted(sessions[w].cohort_id, delta[w])
    submit(sessions, delta, ["w0", "w1"])  # 2 < t = 3
    clock.now += 101
    agg.tick()
    finish(sessions)
    assert agg.ready() == []
    assert all(s.outcome is False for s in sessions.values())
    assert "threshold 3" in sessions["w0"].reason
    for w in WORKERS:
        owed[w].settle(sessions[w].cohort_id, sessions[w].outcome)
        np.testing.assert_array_equal(owed[w].next_delta(np.zeros(NUMEL)), delta[w])
    # ...and the workers are free to join the next cohort, where the carried deltas are summed.
    again = open_cohort(agg)
    assert {s.cohort_id for s in again.values()} != {s.cohort_id for s in sessions.values()}


def test_a_late_input_is_refused_and_stays_owed(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    submit(sessions, delta, ["w0", "w1", "w2"])
    clock.now += 101
    agg.tick()
    with pytest.raises(CohortStateError, match="phase unmask"):
        submit(sessions, delta, ["w3"])


def test_an_aggregator_killed_mid_cohort_resumes_it_and_loses_no_acknowledged_input(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    submit(sessions, delta, ["w0", "w1"])  # acknowledged: journalled before the call returned
    del agg  # killed (nothing is flushed at exit: every change was already on disk)
    resumed = aggregator(tmp_path, clock)
    for session in sessions.values():
        session.transport = resumed
    submit(sessions, delta, ["w2", "w3"])
    finish(sessions)
    [ready] = resumed.ready()
    assert ready.members == tuple(WORKERS)
    np.testing.assert_allclose(ready.mean, sum(delta[w] for w in WORKERS) / 4, atol=1e-6)


def test_a_worker_is_in_one_unfinished_cohort_at_a_time(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    first = open_cohort(agg)
    assert agg.join("python_expert", "w0")["cohort"]["cohort_id"] == first["w0"].cohort_id
    assert agg.join("python_expert", "w9")["phase"] == "forming"
    assert [c["phase"] for c in agg.cohorts("python_expert")] == ["mask"]


def test_a_survivor_silent_in_the_unmasking_round_does_not_stop_the_step(tmp_path, clock):
    agg = aggregator(tmp_path, clock)
    sessions = open_cohort(agg)
    delta = deltas()
    submit(sessions, delta, WORKERS)
    for name in ["w0", "w1", "w2"]:  # w3 sent its input, then went quiet: 3 = t answers
        sessions[name].advance()
    clock.now += 11
    agg.tick()
    agg.tick()  # a second tick past the deadline changes nothing
    [ready] = agg.ready()
    assert ready.members == tuple(WORKERS)  # w3's input counts: its seed is rebuilt from the others' shares
    np.testing.assert_allclose(ready.mean, sum(delta[w] for w in WORKERS) / 4, atol=1e-6)
