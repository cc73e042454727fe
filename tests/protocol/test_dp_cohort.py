"""A relay batch's ``dp_cohort`` field (protocol/dp_cohort.py): parsed strictly at the edge, stored as it came."""
from __future__ import annotations

import pytest

from protocol.dp_cohort import DPCohortSum
from protocol.errors import BadRequest
from protocol.schemas import UpdateMeta

COHORT = {"cohort": "secagg-e1-ab12", "members": 4, "survivors": 3, "noise_multiplier": 1.0, "clip_norm": 0.5}
BATCH = {"update_id": "site-a.1.e1.0", "base_version": 2, "num_samples": 40, "members": {"secagg-e1-ab12": "ab" * 32},
         "dp_cohort": COHORT}


def test_a_dp_cohort_batch_round_trips_and_a_plain_update_keeps_its_old_shape():
    meta = UpdateMeta.from_json(BATCH)
    assert meta.dp_cohort == DPCohortSum("secagg-e1-ab12", 4, 3, 1.0, 0.5)
    assert meta.to_json()["dp_cohort"] == COHORT and UpdateMeta.from_json(meta.to_json()) == meta
    plain = UpdateMeta.from_json({k: v for k, v in BATCH.items() if k != "dp_cohort"})
    assert "dp_cohort" not in plain.to_json()  # stored metadata of every other update is unchanged


@pytest.mark.parametrize("change, message", [
    ({"survivors": 5}, "survivors must be an integer in 1..members"),
    ({"survivors": 0}, "survivors must be an integer in 1..members"),
    ({"members": 1}, "members must be an integer in 2.."),
    ({"members": True}, "members must be an integer"),
    ({"noise_multiplier": float("nan")}, "noise_multiplier must be a finite positive number"),
    ({"noise_multiplier": True}, "noise_multiplier must be a finite positive number"),
    ({"clip_norm": 0}, "clip_norm must be a finite positive number"),
    ({"cohort": 7}, "cohort must be the cohort's update id"),
    ({"extra": 1}, "exactly cohort, members, survivors"),
])
def test_a_bad_dp_cohort_is_a_400_naming_the_field(change, message):
    with pytest.raises(BadRequest, match=message):
        UpdateMeta.from_json(BATCH | {"dp_cohort": COHORT | change})


def test_dp_cohort_comes_only_with_a_batchs_members():
    with pytest.raises(BadRequest, match="comes with its members"):
        UpdateMeta.from_json({k: v for k, v in BATCH.items() if k != "members"})
