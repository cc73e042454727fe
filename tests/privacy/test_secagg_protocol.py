"""Secure aggregation's protocol, members and aggregator in one process (no HTTP): masks cancel
exactly for every survivor set of t or more, a cohort below t applies nothing, a member refuses the
unmasking requests of a malicious aggregator, bad shares are caught, and the journal resumes a cohort."""
import itertools
import json

import numpy as np
import pytest

from privacy.secagg.cohort import CohortState
from privacy.secagg.config import CohortConfig, Phase
from privacy.secagg.errors import BadSecAggMessage, CohortStateError, ReconstructionError, SecAggRefused
from privacy.secagg.journal import CohortJournal
from privacy.secagg.member import CohortMember, UnmaskAnswer
from privacy.secagg.quantize import FixedPoint
from privacy.secagg.unmask import unmasked_sum, unmasked_total

NUMEL = 129


def make_cohort(members=5, threshold=3, clip=0.5, max_weight=64, cohort_id="c1"):
    config = CohortConfig(cohort_id, "python_expert", tuple(f"w{i}" for i in range(members)), threshold, NUMEL,
                          FixedPoint(clip=clip, max_weight=max_weight, members=members))
    return config, {m: CohortMember(config, m) for m in config.members}, CohortState(config)


def share_round(state, members):
    for name, member in members.items():
        state.add_keys(name, member.advertisement())
    for name, member in members.items():
        sealed, commitment = member.share_keys(state.keys)
        state.add_shares(name, sealed, commitment)
    for name, member in members.items():
        member.receive_shares(state.shares_for(name))


def deltas_of(config, seed=0):
    rng = np.random.default_rng(seed)
    return {m: rng.normal(0, 0.05, NUMEL) for m in config.members}


def mask_round(state, members, deltas, senders, samples=7):
    inputs = {}
    for name in senders:
        inputs[name] = members[name].masked_input(deltas[name], samples, rounding_seed=11)
        state.add_masked(name, {"update_id": f"u-{name}"})
    return inputs


def unmask_round(state, members):
    request = state.unmask_request()
    for name in request["survivors"]:
        state.add_answer(name, members[name].unmask(set(request["survivors"]), set(request["dropped"])))


@pytest.mark.parametrize("survivors", [s for k in (3, 4, 5) for s in itertools.combinations(range(5), k)])
def test_masks_cancel_exactly_for_every_survivor_set_of_t_or_more(survivors):
    config, members, state = make_cohort()
    share_round(state, members)
    deltas = deltas_of(config)
    senders = [config.members[i] for i in survivors]
    inputs = mask_round(state, members, deltas, senders)
    state.close_mask()  # the rest dropped after the masks were fixed
    assert state.phase is Phase.UNMASK and state.survivors == set(senders)
    unmask_round(state, members)
    # Exactly the sum of the survivors' quantised vectors (mod 2^32), not merely close to it:
    quant = config.quant
    expected = sum(quant.quantize(deltas[m], 7, 11).astype(np.uint64) for m in senders) % 2 ** 32
    np.testing.assert_array_equal(unmasked_total(state, inputs.__getitem__), expected.astype(np.uint32))
    total, weight = unmasked_sum(state, inputs.__getitem__)
    assert weight == 7 * len(senders)
    # ...which is the weighted sum in the clear up to one quantisation step per member.
    np.testing.assert_allclose(total, sum(7 * deltas[m] for m in senders), rtol=0, atol=len(senders) / quant.scale)


def test_an_individual_masked_input_reveals_nothing_of_its_delta():
    config, members, state = make_cohort()
    share_round(state, members)
    deltas = {m: np.zeros(NUMEL) for m in config.members}  # the plain vector would be all zeros
    inputs = mask_round(state, members, deltas, config.members)
    masked = inputs["w0"]
    assert np.count_nonzero(masked[:-1]) > 0.99 * NUMEL
    assert masked[-1] != 7  # even the weight slot is masked
    # The aggregator cannot rebuild any seed before the unmasking round: it holds only sealed shares.
    with pytest.raises(ReconstructionError):
        unmasked_sum(state, inputs.__getitem__)


@pytest.mark.parametrize("phase_of_drop", ["advertise", "share", "mask"])
def test_a_cohort_below_threshold_is_abandoned_and_applies_nothing(phase_of_drop):
    config, members, state = make_cohort(members=4, threshold=3)
    if phase_of_drop == "advertise":
        for name in ["w0", "w1"]:
            state.add_keys(name, members[name].advertisement())
        state.close_advertise()
    elif phase_of_drop == "share":
        for name, member in members.items():
            state.add_keys(name, member.advertisement())
        for name in ["w0", "w1"]:
            state.add_shares(name, *members[name].share_keys(state.keys))
        state.close_share()
    else:
        share_round(state, members)
        mask_round(state, members, deltas_of(config), ["w0", "w1"])
        state.close_mask()
    assert state.phase is Phase.ABANDONED and "threshold 3" in state.reason
    assert not any(state.included(m) for m in config.members)  # every member keeps (re-queues) its delta
    with pytest.raises(ReconstructionError):
        unmasked_sum(state, lambda m: pytest.fail("nothing may be unmasked"))
    with pytest.raises(CohortStateError):
        state.mark_applied()


def test_survivors_that_stop_answering_below_t_abandon_the_cohort():
    config, members, state = make_cohort(members=4, threshold=3)
    share_round(state, members)
    mask_round(state, members, deltas_of(config), config.members)
    request = state.unmask_request()
    for name in ["w0", "w1"]:
        state.add_answer(name, members[name].unmask(set(request["survivors"]), set(request["dropped"])))
    state.close_unmask()
    assert state.phase is Phase.ABANDONED


def test_a_member_refuses_both_shares_of_one_peer():
    config, members, state = make_cohort(members=4, threshold=3)
    share_round(state, members)
    everyone = set(config.members)
    with pytest.raises(SecAggRefused, match=r"both the seed share and the mask-key share of \['w3'\]"):
        members["w0"].unmask(everyone, {"w3"})


def test_a_member_answers_the_unmasking_round_once():
    # The attack: ask w0 for w3's seed share (w3 "survived"), then, in a second request, for w3's mask
    # key share (w3 "dropped"). With both, the aggregator strips every mask off w3's input.
    config, members, state = make_cohort(members=4, threshold=3)
    share_round(state, members)
    first = members["w0"].unmask(set(config.members), set())
    assert set(first.seed_shares) == set(config.members) and first.key_shares == {}
    with pytest.raises(SecAggRefused, match="already answered"):
        members["w0"].unmask({"w0", "w1", "w2"}, {"w3"})
    assert members["w0"].unmask(set(config.members), set()) == first  # the same request again is a retry


def test_a_member_refuses_a_roster_that_swaps_its_own_key():
    config, members, state = make_cohort(members=3, threshold=2)
    for name, member in members.items():
        state.add_keys(name, member.advertisement())
    roster = dict(state.keys)
    roster["w0"] = members["w1"].advertisement()
    with pytest.raises(SecAggRefused, match="own keys"):
        members["w0"].share_keys(roster)


def test_a_share_replayed_to_another_member_fails_authentication():
    config, members, state = make_cohort(members=3, threshold=2)
    for name, member in members.items():
        state.add_keys(name, member.advertisement())
    for name, member in members.items():
        state.add_shares(name, *member.share_keys(state.keys))
    # The aggregator hands w1 the box w0 sealed to w2.
    with pytest.raises(BadSecAggMessage, match="authentication"):
        members["w1"].receive_shares({"w0": state.sealed["w0"]["w2"], "w2": state.sealed["w2"]["w1"]})


def test_one_bad_share_is_outvoted_and_all_bad_shares_fail_the_step():
    config, members, state = make_cohort(members=5, threshold=3)
    share_round(state, members)
    deltas = deltas_of(config)
    inputs = mask_round(state, members, deltas, ["w0", "w1", "w2", "w3"])
    state.close_mask()
    unmask_round(state, members)
    good = dict(state.answers)
    lying = good["w0"]
    state.answers["w0"] = UnmaskAnswer({u: bytes(16) for u in lying.seed_shares},
                                       {v: bytes(32) for v in lying.key_shares})
    total, _ = unmasked_sum(state, inputs.__getitem__)
    np.testing.assert_allclose(total, sum(7 * deltas[m] for m in inputs), atol=4 / config.quant.scale)
    for name in ["w1", "w2"]:
        state.answers[name] = state.answers["w0"]
    with pytest.raises(ReconstructionError, match="bad shares"):
        unmasked_sum(state, inputs.__getitem__)


def test_quantisation_never_wraps_at_the_extremes_and_clips():
    quant = FixedPoint(clip=0.5, max_weight=64, members=4)
    top = np.full(NUMEL, 10.0)  # clipped to 0.5
    total = sum(quant.quantize(top * sign, 64, seed).astype(np.uint64) for sign, seed in [(1, 1)] * 4) % 2 ** 32
    decoded, weight = quant.decode_sum(total.astype(np.uint32))
    np.testing.assert_allclose(decoded, 4 * 64 * 0.5, atol=4 / quant.scale)
    assert weight == 256
    low = sum(quant.quantize(-top, 64, 2).astype(np.uint64) for _ in range(4)) % 2 ** 32
    np.testing.assert_allclose(quant.decode_sum(low.astype(np.uint32))[0], -128, atol=4 / quant.scale)


def test_stochastic_rounding_is_unbiased():
    quant = FixedPoint(clip=1.0, max_weight=1, members=2)
    value = 0.37 / quant.scale  # a third of a step and a bit
    means = [quant.quantize(np.full(20000, value), 1, seed)[:-1].astype(np.int32).mean() for seed in range(3)]
    assert all(abs(m - 0.37) < 0.02 for m in means)


def test_config_refuses_a_minority_threshold_and_bad_ids():
    quant = FixedPoint(clip=1.0, max_weight=4, members=4)
    with pytest.raises(BadSecAggMessage, match="threshold must be in 3..4"):
        CohortConfig("c", "e", ("a", "b", "c", "d"), 2, 10, quant)
    with pytest.raises(BadSecAggMessage, match="cohort_id"):
        CohortConfig("../x", "e", ("a", "b", "c", "d"), 3, 10, quant)


def test_journal_resumes_a_cohort_killed_mid_unmask(tmp_path):
    config, members, state = make_cohort(members=4, threshold=3)
    journal = CohortJournal(tmp_path)
    share_round(state, members)
    deltas = deltas_of(config)
    for name in ["w0", "w1", "w2"]:
        journal.save_masked(state, name, members[name].masked_input(deltas[name], 7, 11))
        state.add_masked(name, {"update_id": f"u-{name}"})
        journal.save(state)
    state.close_mask()
    journal.save(state)
    request = state.unmask_request()
    state.add_answer("w0", members["w0"].unmask(set(request["survivors"]), set(request["dropped"])))
    journal.save(state)
    (tmp_path / "c1" / "state.json.tmp").write_text("{torn")  # a crash mid-write leaves this behind
    resumed = CohortJournal(tmp_path).load_all()
    assert len(resumed) == 1 and resumed[0].phase is Phase.UNMASK and set(resumed[0].answers) == {"w0"}
    again = resumed[0]
    for name in ["w1", "w2"]:
        again.add_answer(name, members[name].unmask(set(request["survivors"]), set(request["dropped"])))
    total, weight = unmasked_sum(again, lambda m: journal.load_masked(again, m))
    np.testing.assert_allclose(total, sum(7 * deltas[m] for m in ["w0", "w1", "w2"]), atol=3 / config.quant.scale)
    assert weight == 21
    assert json.loads((tmp_path / "c1" / "state.json").read_text())["masked"]["w1"] == {"update_id": "u-w1"}
