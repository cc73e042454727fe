"""The real-model quality suites, run on tiny-qwen2 (--quick): their arithmetic and their verdicts."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.fedrounds import FedJob, run_central, run_fed
from bench.realdata import DOMAINS, SMOKE_MODEL, Lab, ds1000_domains, shards

ROOT = Path(__file__).resolve().parents[2]


def quick(tmp_path: Path, module: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{module}.json"
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def planned(module: str, *args: str) -> tuple[int, int]:
    """(optimiser steps, scored problems) that ``--estimate`` plans for ``module`` run with ``args``."""
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", "--estimate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"(\d+) optimiser steps, (\d+) scored problems", proc.stdout)
    assert found, proc.stdout
    return int(found[1]), int(found[2])


def test_validation_is_carved_from_train_by_whole_families_and_heldout_is_untouched():
    domains = ds1000_domains()
    assert [d.name for d in domains] == list(DOMAINS)
    for d in domains:
        shipped = (ROOT / "data" / "ds1000" / "train" / f"{d.name}.jsonl").read_text().splitlines()
        assert len(d.train) + len(d.validation) == len([line for line in shipped if line.strip()])
        assert 0.05 * len(shipped) <= len(d.validation) <= 0.25 * len(shipped)
        assert not {e.prompt for e in d.train} & {e.prompt for e in d.validation}
        assert not {e.prompt for e in d.train + d.validation} & {e.prompt for e in d.heldout}


def test_the_committed_validation_ids_are_what_the_family_rule_carves():
    """data/ds1000/validation.json saves every benchmark process ~15 CPU s; it must stay the rule's output."""
    proc = subprocess.run([sys.executable, "data/ds1000/split.py", "--validation", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "match validation.json" in proc.stdout


def test_a_missing_validation_file_is_one_clear_line(tmp_path):
    for side in ("train", "heldout"):
        (tmp_path / side).mkdir()
        for name in DOMAINS:
            (tmp_path / side / f"{name}.jsonl").write_text(
                json.dumps({"prompt": "p", "reference_code": "r", "problem_id": 1}) + "\n")
    with pytest.raises(SystemExit, match="split.py --validation"):
        ds1000_domains(tmp_path)
    (tmp_path / "validation.json").write_text(json.dumps({DOMAINS[0]: [2]}))
    with pytest.raises(SystemExit, match="not in train/"):
        ds1000_domains(tmp_path)
    (tmp_path / "validation.json").write_text(json.dumps({DOMAINS[0]: [1]}))
    first = ds1000_domains(tmp_path)[0]
    assert (len(first.train), len(first.validation)) == (0, 1)


def test_one_worker_one_round_of_fedbuff_is_plain_training():
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = ds1000_domains()[2].train[:12]
    fed = run_fed(lab, FedJob((tuple(data),), rounds=1, steps=3, seed=5))
    central = run_central(lab, data, steps=3, seed=5)
    assert fed.updates == 1 and fed.bytes_raw == 4 * sum(t.numel() for t in fed.weights.values())
    for key, value in central.weights.items():
        torch.testing.assert_close(fed.weights[key], value, rtol=0, atol=1e-6)
    assert lab.compute.train_steps == 6


def test_the_server_lr_scales_the_aggregated_step():
    """FedBuff with server lr K applies K times the workers' mean delta (the sum, for K equal-sized workers)."""
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = tuple(map(tuple, shards(ds1000_domains()[2].train[:24], 2)))
    start = lab.trainer(data[0], 0).adapter_state()
    mean = run_fed(lab, FedJob(data, rounds=1, steps=1)).weights
    summed = run_fed(lab, FedJob(data, rounds=1, steps=1, server_lr=2.0)).weights
    assert any(float((mean[k] - start[k]).abs().max()) > 0 for k in start)
    for key in start:
        torch.testing.assert_close(summed[key] - start[key], 2 * (mean[key] - start[key]), rtol=1e-4, atol=1e-7)


def test_central_snapshots_are_the_weights_after_that_many_steps():
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = ds1000_domains()[2].train[:12]
    long = run_central(lab, data, steps=3, seed=2, snapshots=(2,))
    short = run_central(lab, data, steps=2, seed=2)
    assert set(long.snapshots) == {2}
    for key, value in short.weights.items():
        torch.testing.assert_close(long.snapshots[2][key], value, rtol=0, atol=0)
    assert any(not torch.equal(long.weights[k], short.weights[k]) for k in short.weights)


def test_a_median_ignores_one_scaled_attacker_among_three():
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = shards(ds1000_domains()[2].train[:24], 2)
    start = lab.trainer(data[0], 0).adapter_state()
    plain = run_fed(lab, FedJob(tuple(map(tuple, data)), rounds=1, steps=1, attack="scale"))
    median = run_fed(lab, FedJob(tuple(map(tuple, data)), rounds=1, steps=1, attack="scale", robust="median"))

    def moved(weights: dict) -> float:
        return math.sqrt(sum(float((weights[k] - start[k]).pow(2).sum()) for k in start))

    # the mean of (d0, d1, 10 d0) moves ~4x an honest step; the median stays among the honest ones
    assert moved(plain.weights) > 2.5 * moved(median.weights)


def test_compression_quick_run(tmp_path):
    report, stdout = quick(tmp_path, "quality_compression")
    assert report["base_model"] == SMOKE_MODEL
    codecs = report["summary"]["codecs"]
    fp32, int8 = codecs["safetensors"], next(v for k, v in codecs.items() if k.startswith("int8"))
    randomk = next(v for k, v in codecs.items() if k.startswith("randomk+terngrad"))
    assert fp32["increase_pct"]["mean"] == 0 and fp32["cosine"]["mean"] == pytest.approx(1.0)
    assert 3.9 < int8["ratio"] < 4.1 and abs(int8["increase_pct"]["mean"]) < 0.1 and int8["cosine"]["mean"] > 0.999
    assert randomk["ratio"] > 100 and randomk["cosine"]["mean"] < 0.6  # a 10% random subset: far from the delta
    fvc = report["summary"]["federated_vs_central"]
    assert set(fvc) == {"central", "fedbuff", "central_same_wall_time", "fedbuff_vs_same_wall_time"}
    assert fvc["central"]["gap_pct"] == 0 and fvc["fedbuff"]["server_lr"] == 1
    wall = report["central_same_wall_time"]
    assert fvc["central_same_wall_time"]["steps"] == report["settings"]["rounds"] * report["settings"]["steps"]
    assert all(w["loss"] > c["loss"] for w, c in zip(wall, report["central"]))  # fewer steps, less learnt
    assert all(len(r["track"]) == report["settings"]["rounds"] for r in report["records"])
    for r in report["records"] + report["central"]:
        assert r["loss"] < report["summary"]["base_heldout"]["loss"]  # every run learnt something
        assert r["loss_without_end"] != r["loss"]
    assert report["cost"]["train_steps"] > 0 and "vs central" in stdout
    # --estimate plans exactly what the run did (the time budget of make bench-quality is checked with it)
    assert planned("quality_compression", "--quick") == (report["cost"]["train_steps"], report["cost"]["eval_examples"])


def test_compression_federated_vs_central_only_at_a_server_lr(tmp_path):
    report, stdout = quick(tmp_path, "quality_compression", "--fvc-only", "--server-lr", "2", "--fedasync")
    assert {r["label"] for r in report["records"]} == {"safetensors"} and report["summary"]["targets"] == {}
    fvc = report["summary"]["federated_vs_central"]
    assert fvc["fedbuff"]["server_lr"] == 2 == report["settings"]["server_lr"] and "fedasync" in fvc
    assert "fedbuff (server lr 2)" in stdout
    assert planned("quality_compression", "--quick", "--fvc-only", "--fedasync") == (
        report["cost"]["train_steps"], report["cost"]["eval_examples"])


@pytest.mark.parametrize("args, message", [(["--server-lr", "0"], "--server-lr must be a positive number"),
                                           (["--server-lr", "nan"], "--server-lr must be a positive number"),
                                           (["--fvc-only", "--only", "int8"], "--fvc-only runs no codecs")])
def test_bad_compression_flags_answer_with_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "bench.quality_compression", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_gateway_quick_run(tmp_path):
    report, stdout = quick(tmp_path, "quality_gateway")
    methods = report["methods"]
    assert methods["oracle_router"]["mean_r"]["mean"] == pytest.approx(1.0)
    assert methods["base"]["mean_r"]["mean"] == pytest.approx(0.0)
    exact, naive = methods["exact_average"], methods["naive_factor_average"]
    assert exact["loss"] != naive["loss"]  # mean(B) mean(A) != mean(BA)
    fitted = report["router"]["validation"]["fitted_threshold"]
    assert 0 <= fitted <= 1 and f"router (threshold {fitted:.2f})" in methods
    assert report["router"]["heldout"]["fitted on losses"]["accuracy"] > 0.9
    calibration = report["router"]["calibration"]  # the model-free fit that sets the default
    assert calibration["heldout"]["fitted"]["right_top_sent_to_gateway"] == 0
    assert calibration["heldout"]["old_0.7"]["right_top_sent_to_gateway"] > 0
    for label, figures in report["codec_true_delta"].items():
        assert 0 <= figures["relative_error"]["mean"] and figures["cosine"]["mean"] <= 1 + 1e-6, label
    assert "macro-F1" in stdout


def test_poisoning_quick_run(tmp_path):
    report, stdout = quick(tmp_path, "quality_poisoning")
    by_rule = report["summary"]["by_rule"]
    assert set(by_rule) == {"none", "median"} and set(by_rule["none"]) == {"sign_flip", "scale"}
    # a flipped update pulls plain averaging back (an undertrained tiny model may even gain from a scaled one)
    assert by_rule["none"]["sign_flip"]["pct"]["mean"] > max(0.0, by_rule["median"]["sign_flip"]["pct"]["mean"])
    assert report["summary"]["honest"]["loss"]["mean"] < report["base"]["loss"]
    assert "within 2%" in stdout
    assert planned("quality_poisoning", "--quick") == (report["cost"]["train_steps"], report["cost"]["eval_examples"])
