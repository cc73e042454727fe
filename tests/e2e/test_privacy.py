"""Differential privacy end to end: a --dp-sgd worker (tiny-qwen2) reports and pushes the epsilon it spent; a real
coordinator with --dp-budget refuses the push that would spend past it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import run_worker as run_worker_script
from privacy.accountant import GaussianSteps, epsilon_spent
from protocol.client import CoordinatorClient
from protocol.errors import Conflict
from protocol.tensors import dumps
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.helpers import expert_spec, make_adapter, random_like, run_main, update_meta


def run_worker(url: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    results = tmp_path / "results.jsonl"
    proc = launcher.run([sys.executable, str(ROOT / "run_worker.py"), "--coordinator-url", url,
                         "--specialty", "sql_expert", "--base-model", "tiny-qwen2", "--duration", "6",
                         "--sync-interval", "2", "--lora-rank", "4", "--batch-size", "4", "--max-seq-len", "64",
                         "--threads", "1", "--no-heldout-eval", "--results", str(results),
                         "--state-dir", str(tmp_path / "state"), *extra],
                        env=env() | {"OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True, timeout=300)
    records = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    return proc, records


def test_dp_sgd_worker_reports_the_epsilon_it_spent_in_results_and_pushes(start_coordinator, tmp_path):
    _, url = start_coordinator()
    proc, records = run_worker(url, tmp_path, "--dp-sgd", "1.2,0.5", "--dp-delta", "1e-6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pushed = [r for r in records if r.get("bytes_sent")]
    assert pushed, records
    steps = 0
    for record in pushed:
        privacy = record["privacy"]
        assert privacy["mechanism"] == "dp-sgd" and privacy["delta"] == 1e-6
        assert (privacy["noise_multiplier"], privacy["max_grad_norm"]) == (1.2, 0.5)
        steps = max(steps, privacy["steps"])
        # the worker's sample rate is batch / its training examples (the sample data's 90% training split)
        expected = epsilon_spent([GaussianSteps(1.2, privacy["sample_rate"], privacy["steps"])], 1e-6)
        assert privacy["epsilon"] == pytest.approx(expected, abs=1e-5) and privacy["epsilon"] > 0
    assert steps >= sum(r["steps"] for r in pushed[:-1])  # counted over the whole run, never reset per sync


@pytest.mark.parametrize("args, message", [
    (["--dp-sgd", "1.0"], "--dp-sgd wants NOISE_MULTIPLIER,MAX_GRAD_NORM"),
    (["--dp-sgd", "1,1", "--lora-rank", "0"], "--lora-rank 0"),
    (["--dp-delta", "1e-6"], "--dp-delta applies to --dp-sgd only"),
    (["--min-dp-noise", "0"], "--min-dp-noise must be a positive noise multiplier"),
    (["--min-dp-noise", "nan"], "--min-dp-noise must be a positive noise multiplier"),
])
def test_dp_sgd_flag_mistakes_are_one_line(args, message):
    """In this process (tests.helpers.run_main): the flags are refused before a model or a coordinator is needed."""
    code, _, stderr = run_main(run_worker_script.main, "--specialty", "sql_expert", "--base-model", "tiny-qwen2",
                               "--coordinator-url", "http://127.0.0.1:9", *args)
    assert code == 2 and "Traceback" not in stderr, stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert message in error


def test_dp_budget_refuses_the_push_past_it_at_a_real_coordinator(start_coordinator):
    """run_coordinator.py --dp-noise 2 --dp-clip 1 --dp-budget B, B between the epsilon of 2 and 3 steps (fedasync:
    a step per push): the third push is refused with 409 privacy_budget_spent and nothing of it is applied."""
    sigma = 2.0
    two, three = (epsilon_spent([GaussianSteps(sigma, 1.0, n)], 1e-5) for n in (2, 3))
    _, url = start_coordinator("--dp-noise", str(sigma), "--dp-clip", "1", "--dp-budget", f"{(two + three) / 2:.6f}")
    client = CoordinatorClient(url)
    initial = make_adapter()
    client.experts.create("private_expert", initial, expert_spec())
    for version in range(2):
        client.updates.push("private_expert", dumps(random_like(initial, version)), update_meta(version, worker_id="w1"))
    with pytest.raises(Conflict) as refused:
        client.updates.push("private_expert", dumps(random_like(initial, 5)), update_meta(2, worker_id="w1"))
    assert refused.value.code == "privacy_budget_spent"
    shown = client.experts.get("private_expert")
    assert shown["version"] == 2
    assert shown["privacy"]["dp_fedavg"]["epsilon"] == pytest.approx(two, abs=1e-5)


def test_min_dp_noise_stops_at_joining_a_coordinator_without_dp_with_nothing_from_the_data_sent(start_coordinator,
                                                                                                tmp_path):
    """--min-dp-noise 1 against a coordinator started without --dp-noise: one error line, exit 2, and the expert
    (created from the untrained adapter) has no update, pending or applied, and no routing profile of ours."""
    _, url = start_coordinator()
    proc, records = run_worker(url, tmp_path, "--min-dp-noise", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "--min-dp-noise 1" in error and "adds no worker-level differential privacy noise" in error
    client = CoordinatorClient(url)
    shown = client.experts.get("sql_expert")
    assert shown["version"] == 0 and shown["updates_applied"] == 0 and shown["pending_updates"] == 0, shown
    assert "sql_expert" not in client.gateway.profiles()["profiles"] and records == []


def test_min_dp_noise_at_or_below_the_coordinators_sigma_trains_and_pushes(start_coordinator, tmp_path):
    _, url = start_coordinator("--dp-noise", "1.0", "--dp-clip", "0.5")
    proc, records = run_worker(url, tmp_path, "--min-dp-noise", "1.0", "--duration", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r for r in records if r.get("bytes_sent")], records
    client = CoordinatorClient(url)
    shown = client.experts.get("sql_expert")
    assert shown["privacy"]["dp_fedavg"]["steps"] >= 1 and shown["version"] >= 1
    assert "sql_expert" in client.gateway.profiles()["profiles"]  # what the refused worker above never sent
