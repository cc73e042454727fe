"""Distributed DP noise under secure aggregation (privacy.secagg.noise): members' sessions talk to a real
``SecureAggregator`` in this process, as in test_secagg_aggregator.py; the noise is drawn from the OS's entropy,
as in production, so the statistical checks use tolerances of 5 or more standard errors."""
import logging
import math

import numpy as np
import pytest

from coordinator.privacy_ledger import PrivacyLedgers
from privacy.accountant import GaussianSteps, epsilon_spent
from privacy.dp import DPFedAvgSettings
from privacy.secagg.aggregator import ReleaseDeferred, SecAggSettings, SecureAggregator
from privacy.secagg.config import CohortConfig
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.journal import CohortJournal
from privacy.secagg.noise import TAIL_STDS, CohortNoise
from privacy.secagg.quantize import FixedPoint
from privacy.secagg.session import CohortSession
from tests.privacy.test_secagg_aggregator import WORKERS, Clock, finish

EXPERT = "python_expert"
K = 4


def dp_aggregator(tmp_path, clock, noise, numel):
    settings = SecAggSettings(cohort_size=K, round_timeout=10, input_timeout=100)
    return SecureAggregator(CohortJournal(tmp_path / "cohorts"), settings, lambda e: numel, clock, dp=noise)


def open_sessions(agg, transport=None):
    sessions = {w: CohortSession(transport or agg, EXPERT, w) for w in WORKERS}
    for _ in range(4):  # join, keys, shares, open shares
        for session in sessions.values():
            session.advance()
    return sessions


def run_cohort(agg, clock, deltas, survivors):
    """One DP cohort in which ``survivors`` send their delta (the rest drop after the key rounds): its CohortSum."""
    sessions = open_sessions(agg)
    assert all(s.can_submit for s in sessions.values())
    for name in survivors:
        sessions[name].submit(deltas[name], 10, {"base_version": 0}, rounding_seed=1)
    if len(survivors) < K:
        clock.now += 101  # the input round's deadline: the others count as dropped
        agg.tick()
    finish({n: sessions[n] for n in survivors})
    [ready] = agg.ready()
    agg.applied(ready.config.cohort_id)
    return ready


def clipped(delta, clip_norm):
    return delta * min(1.0, clip_norm / np.linalg.norm(delta))


@pytest.mark.parametrize("survivors", [4, 3])
def test_the_unmasked_sum_of_many_cohorts_carries_sigma_c_sqrt_s_over_k(tmp_path, survivors):
    noise, numel, cohorts = CohortNoise(noise_multiplier=2.0, clip_norm=0.5), 1000, 8
    clock = Clock()
    agg = dp_aggregator(tmp_path, clock, noise, numel)
    rng = np.random.default_rng(0)
    residuals = []
    for _ in range(cohorts):
        deltas = {w: rng.normal(0, 3 * 0.5 / math.sqrt(numel), numel) for w in WORKERS}  # norm ~3C: clipping bites
        ready = run_cohort(agg, clock, deltas, WORKERS[:survivors])
        assert ready.weight == survivors  # every member weighs 1, whatever its sample count
        total = ready.mean * K  # the mean is over the fixed K
        residuals.append(total - sum(clipped(deltas[w], 0.5) for w in WORKERS[:survivors]))
    noise_seen = np.concatenate(residuals)
    expected = 2.0 * 0.5 * math.sqrt(survivors / K)  # sigma C sqrt(S/K): 1.0 with every input, 0.866 with 3 of 4
    # 8,000 samples: the sample std's relative standard error is 1 / sqrt(2n) = 0.8%, so 4% is 5 standard errors
    assert noise_seen.std() == pytest.approx(expected, rel=0.04)
    assert abs(noise_seen.mean()) < 5 * expected / math.sqrt(noise_seen.size)
    # fresh noise in each cohort and each member: two cohorts' noise is uncorrelated (5 standard errors: 0.16)
    assert abs(np.corrcoef(residuals[0], residuals[1])[0, 1]) < 5 / math.sqrt(numel)


def test_the_step_is_the_survivors_clipped_sum_over_the_fixed_k(tmp_path):
    noise, numel = CohortNoise(noise_multiplier=1e-7, clip_norm=1.0), 300  # noise far below the tolerance
    clock = Clock()
    agg = dp_aggregator(tmp_path, clock, noise, numel)
    rng = np.random.default_rng(1)
    deltas = {w: rng.normal(0, 0.2, numel) for w in WORKERS}  # norm ~3.5: each clipped to 1
    ready = run_cohort(agg, clock, deltas, WORKERS[:3])
    expected = sum(clipped(deltas[w], 1.0) for w in WORKERS[:3]) / K  # over K = 4, not over the 3 survivors
    assert np.abs(ready.mean - expected).max() < 1e-6
    assert ready.config.quant.max_weight == 1 and ready.config.quant.clip == pytest.approx(1.0 + TAIL_STDS * 5e-8)


def good_config(**dp):
    config = CohortConfig(cohort_id="c1", expert=EXPERT, members=tuple(WORKERS), threshold=3, numel=10,
                          quant=FixedPoint(CohortNoise(1.0, 1.0).coordinate_bound(K), 1, K), dp=CohortNoise(1.0, 1.0))
    body = config.to_json()
    body["dp"].update(dp)
    return body


@pytest.mark.parametrize("dp, message", [
    ({"noise_multiplier": None}, "noise_multiplier must be a finite positive number, got None"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier must be a finite positive number, got nan"),
    ({"noise_multiplier": float("inf")}, "noise_multiplier must be a finite positive number, got inf"),
    ({"noise_multiplier": 0.0}, "noise_multiplier must be a finite positive number, got 0.0"),
    ({"noise_multiplier": "1.0"}, "noise_multiplier must be a finite positive number, got '1.0'"),
    ({"clip_norm": float("nan")}, "clip_norm must be a finite positive number, got nan"),
    ({"clip_norm": True}, "clip_norm must be a finite positive number, got True"),
])
def test_a_member_refuses_a_dp_cohort_whose_sigma_or_clip_is_not_finite(dp, message):
    assert CohortConfig.from_json(good_config()).dp == CohortNoise(1.0, 1.0)
    with pytest.raises(BadSecAggMessage, match=message):
        CohortConfig.from_json(good_config(**dp))


@pytest.mark.parametrize("missing", ["noise_multiplier", "clip_norm"])
def test_a_member_refuses_a_dp_cohort_whose_sigma_or_clip_is_missing(missing):
    body = good_config()
    del body["dp"][missing]
    with pytest.raises(BadSecAggMessage, match=f"lacks {missing}"):
        CohortConfig.from_json(body)


@pytest.mark.parametrize("field, value, message", [
    ("max_weight", 4096, "weighs every member 1"),  # a sample-count weight would scale its influence past C
    ("clip", 1.0, "would clip members' noise"),  # the range must hold C + 10 noise stds (here 6)
])
def test_a_member_refuses_a_dp_cohort_whose_quantisation_would_weaken_the_noise(field, value, message):
    with pytest.raises(BadSecAggMessage, match=message):
        CohortConfig.from_json(good_config() | {field: value})


class DroppingSigma:
    """A coordinator that announces a DP cohort without sigma (so members might pick their own): the real
    aggregator underneath, its cohort config edited on the way out."""

    def __init__(self, agg):
        self.agg = agg

    def __getattr__(self, name):
        return getattr(self.agg, name)

    def _edit(self, status):
        if "cohort" in status:
            del status["cohort"]["dp"]["noise_multiplier"]
        return status

    def join(self, expert, worker):
        return self._edit(self.agg.join(expert, worker))

    def status(self, cohort_id, worker):
        return self._edit(self.agg.status(cohort_id, worker))


def test_a_worker_never_joins_the_key_round_of_a_dp_cohort_without_sigma(tmp_path):
    agg = dp_aggregator(tmp_path, Clock(), CohortNoise(1.0, 1.0), 50)
    sessions = [CohortSession(DroppingSigma(agg), EXPERT, w) for w in WORKERS]
    for session in sessions[:3]:
        assert session.advance() is None and session.member is None  # forming
    with pytest.raises(BadSecAggMessage, match="lacks noise_multiplier"):
        sessions[3].advance()  # the fourth join forms the cohort: its config is refused
    assert sessions[3].member is None
    [cohort] = agg.cohorts()
    assert cohort["phase"] == "advertise" and agg.registry.get(cohort["cohort_id"]).keys == {}


def test_a_cohort_is_booked_once_at_sigma_sqrt_s_over_k_and_survives_a_restart(tmp_path):
    dp = DPFedAvgSettings(clip_norm=1.0, noise_multiplier=2.0, budget=10.0)
    ledgers = PrivacyLedgers(tmp_path, dp)
    ledgers.book_cohort("e1", "secagg-a", survivors=4, members=4)
    ledgers.book_cohort("e1", "secagg-a", survivors=4, members=4)  # a restart unmasking it again: not twice
    ledgers.book_cohort("e1", "secagg-b", survivors=3, members=4)
    (tmp_path / "central").mkdir()
    central = PrivacyLedgers(tmp_path / "central", dp)
    central.book_step("e1")  # what the coordinator books for one central DP-FedAvg step
    reloaded = PrivacyLedgers(tmp_path, dp)
    assert reloaded.booked("e1", "secagg-a") and reloaded.booked("e1", "secagg-b")
    assert not reloaded.booked("e1", "site-a.batch-1") and not reloaded.booked("e2", "secagg-a")
    report = reloaded.report("e1")["dp_fedavg"]
    assert report["steps"] == 2
    # a full cohort costs exactly a central step; one with 3 of 4 inputs costs the step of sigma sqrt(3/4)
    with_dropout = epsilon_spent([GaussianSteps(2.0, 1.0, 1), GaussianSteps(2.0 * math.sqrt(3 / 4), 1.0, 1)], 1e-5)
    assert report["epsilon"] == pytest.approx(with_dropout, abs=1e-6)
    assert central.report("e1")["dp_fedavg"]["epsilon"] == pytest.approx(epsilon_spent([GaussianSteps(2.0, 1.0, 1)],
                                                                                        1e-5), abs=1e-6)


@pytest.mark.parametrize("noise, floor, refused", [
    (CohortNoise(0.5, 1.0), 1.0, "noise multiplier 0.5 is below this worker's --min-dp-noise 1"),
    (None, 0.5, "adds no DP noise"),
    (CohortNoise(1.0, 1.0), 1.0, None),
])
def test_a_worker_with_min_dp_noise_posts_no_keys_to_a_cohort_below_it(tmp_path, noise, floor, refused):
    """worker.secure_push's admission (--min-dp-noise) on a real aggregator: the member whose join forms a cohort
    below its floor refuses it before its key round, and the cohort gets no keys from it."""
    from protocol.client import CoordinatorClient
    from privacy.secagg.errors import SecAggRefused
    from worker.secure_push import SecurePush

    agg = dp_aggregator(tmp_path, Clock(), noise, 50)
    push = SecurePush(CoordinatorClient("http://127.0.0.1:9"), EXPERT, WORKERS[3], min_dp_noise=floor)  # never called
    sessions = [CohortSession(agg, EXPERT, w) for w in WORKERS[:3]] + [CohortSession(agg, EXPERT, WORKERS[3],
                                                                                    admit=push._admit)]
    for session in sessions[:3]:
        session.advance()  # forming
    if refused is None:
        sessions[3].advance()
        assert sessions[3].member is not None and sessions[3].member.config.dp == noise
        return
    with pytest.raises(SecAggRefused, match=refused):
        sessions[3].advance()  # its join forms the cohort
    [cohort] = agg.cohorts()
    for _ in range(2):
        for session in sessions[:3]:
            session.advance()  # the others post their keys
    with pytest.raises(SecAggRefused):
        sessions[3].advance()  # asked again at the next poll: still no
    assert sessions[3].member is None and WORKERS[3] not in agg.registry.get(cohort["cohort_id"]).keys
    assert set(agg.registry.get(cohort["cohort_id"]).keys) == set(WORKERS[:3])


def test_a_release_deferred_through_an_outage_warns_once_and_unmasks_when_the_root_answers(tmp_path, caplog):
    """A relay's cohort waits for its root to book the DP step: every tick of an outage asks again, but the log
    says so once per cohort, not once per tick (a relay printed a warning per waiting cohort per tick)."""
    clock = Clock()
    agg = dp_aggregator(tmp_path, clock, CohortNoise(1.0, 1.0), 4)
    sessions = open_sessions(agg)
    for name, session in sessions.items():
        session.submit(np.full(4, 0.1, dtype=np.float32), 10, {"base_version": 0}, rounding_seed=1)
    finish(sessions)
    root_answers = False

    def release(config, survivors):
        if not root_answers:
            raise ReleaseDeferred("the root is unreachable")
        return None

    with caplog.at_level(logging.DEBUG, logger="privacy.secagg.aggregator"):
        for _ in range(5):
            assert agg.ready(release) == []
        root_answers = True
        [ready] = agg.ready(release)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "keeps its masks" in r.getMessage()]
    assert len(warnings) == 1 and ready.config.cohort_id in warnings[0].getMessage()
    assert sum("keeps its masks" in r.getMessage() for r in caplog.records) == 5  # the rest at DEBUG
