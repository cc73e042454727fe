"""The router's threshold fitted on validation (gateway.router.fit_threshold) and the shipped default."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.profiles import ProfileError, text_profile
from gateway.router import DEFAULT_THRESHOLD, fit_threshold, route

ROOT = Path(__file__).resolve().parents[2]
DS1000 = ROOT / "data" / "ds1000"
DOMAINS = ("numpy_expert", "pandas_expert", "sklearn_expert")


def test_the_cut_that_saves_most_is_chosen_midway_between_confidences():
    # routing the two most confident saves 2; adding the third (a wrong expert, -2) loses it again
    assert fit_threshold([0.9, 0.6, 0.8, 0.5], [1.0, -2.0, 1.0, 1.0]) == pytest.approx(0.7)


def test_every_prompt_is_routed_when_every_top_expert_helps():
    assert fit_threshold([0.4, 0.9, 0.55], [0.1, 2.0, 0.3]) == 0.0
    # with a floor (1 / experts: a prompt like no expert) the cut lies between it and the lowest routed
    assert fit_threshold([0.4, 0.9, 0.55], [0.1, 2.0, 0.3], floor=1 / 3) == pytest.approx((0.4 + 1 / 3) / 2)


def test_nothing_is_routed_when_every_top_expert_hurts():
    threshold = fit_threshold([0.9, 0.8], [-1.0, -0.5])
    assert 0.9 < threshold <= 1.0


def test_equal_gains_prefer_routing_more():
    assert fit_threshold([0.9, 0.5], [1.0, 0.0]) == 0.0
    assert fit_threshold([0.9, 0.5], [1.0, 0.0], floor=0.6) == 0.5  # a floor above the lowest routed: that one


def test_mismatched_inputs_are_refused():
    with pytest.raises(ProfileError):
        fit_threshold([0.5], [])
    with pytest.raises(ProfileError):
        fit_threshold([], [])


def test_the_default_is_the_threshold_fitted_on_the_validation_split():
    report = json.loads((ROOT / "bench" / "results" / "router_calibration.json").read_text())
    assert DEFAULT_THRESHOLD == report["fitted_threshold"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_held_out_prompts_with_the_right_top_expert_are_not_sent_to_the_gateway():
    # issue 15: at 0.7, 8 of 67 real prompts went to the gateway though their top score was right
    profiles = {d: text_profile(r["prompt"] for r in _records(DS1000 / "train" / f"{d}.jsonl")) for d in DOMAINS}
    right = sent_away = 0
    for domain in DOMAINS:
        for record in _records(DS1000 / "heldout" / f"{domain}.jsonl"):
            top = route(record["prompt"], profiles, 0.0).expert
            if top == domain:
                right += 1
                sent_away += route(record["prompt"], profiles).expert is None
    assert right >= 70 and sent_away == 0
