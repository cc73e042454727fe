"""The real-model quality suites, run on tiny-qwen2 (--quick): their arithmetic and their verdicts."""
from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.fedrounds import FedJob, run_central, run_fed
from bench.fvc_sweep import Arm, parse_arm, pick, summarize_horizons
from bench.realdata import DOMAINS, SMOKE_MODEL, Lab, ds1000_domains, shards, spider_domain
from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[2]


def quick(tmp_path: Path, module: str, *args: str, in_process: bool = False) -> tuple[dict, str]:
    """``python -m bench.<module> --quick``: its report and stdout. ``in_process`` runs its main() here instead
    (tests.helpers.run_main; saves the ~6 CPU s of imports), for the runs after a module's first from the shell."""
    out = tmp_path / f"{module}.json"
    argv = ["--quick", "--out", str(out), *args]
    if in_process:
        code, stdout, stderr = run_main(importlib.import_module(f"bench.{module}").main, *argv)
        assert code == 0, stderr[-3000:]
        return json.loads(out.read_text()), stdout
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def planned(module: str, *args: str) -> tuple[int, int]:
    """(optimiser steps, scored problems) that ``--estimate`` plans for ``module`` run with ``args`` (arithmetic
    only, run in this process: each module's command line is exercised by its quick run)."""
    code, stdout, stderr = run_main(importlib.import_module(f"bench.{module}").main, "--estimate", *args)
    assert code == 0, stderr[-3000:]
    found = re.search(r"(\d+) optimiser steps, (\d+) scored problems", stdout)
    assert found, stdout
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


def test_the_spider_domain_holds_out_and_validates_on_whole_databases_no_benchmark_loads_by_default():
    sql = spider_domain()
    rows = [json.loads(line) for line in (ROOT / "data" / "spider" / "train" / "sql_expert.jsonl").read_text().splitlines()]
    by_prompt = {r["prompt"]: r["db_id"] for r in rows}
    assert sql.name == "sql_expert" and (len(sql.train), len(sql.validation), len(sql.heldout)) == (808, 120, 106)
    assert {by_prompt[e.prompt] for e in sql.validation} == {"world_1"}
    assert "world_1" not in {by_prompt[e.prompt] for e in sql.train}
    assert not {e.prompt for e in sql.train + sql.validation} & {e.prompt for e in sql.heldout}
    assert "sql_expert" not in [d.name for d in ds1000_domains()]  # committed results stay comparable


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


def test_workers_keep_their_adam_moments_across_rounds_unless_told_not_to():
    """As the product's worker does (LoraTrainer.load_adapter_state keeps them): one worker's rounds are one run."""
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = ds1000_domains()[2].train[:12]
    central = run_central(lab, data, steps=2, seed=3).weights
    kept = run_fed(lab, FedJob((tuple(data),), rounds=2, steps=1, seed=3)).weights
    fresh = run_fed(lab, FedJob((tuple(data),), rounds=2, steps=1, seed=3, fresh_optimizer=True)).weights
    for key, value in central.items():
        torch.testing.assert_close(kept[key], value, rtol=0, atol=1e-6)
    assert any(not torch.allclose(fresh[k], central[k], rtol=0, atol=1e-5) for k in central)


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


def test_a_jobs_learning_rate_reaches_every_worker_and_the_central_run():
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = ds1000_domains()[2].train[:12]
    preset = run_central(lab, data, steps=2, seed=1).weights
    doubled = run_central(lab, data, steps=2, seed=1, lr=2 * lab.lr).weights
    fed = run_fed(lab, FedJob((tuple(data),), rounds=1, steps=2, seed=1, lr=2 * lab.lr)).weights
    assert any(not torch.allclose(doubled[k], preset[k]) for k in preset)
    for key, value in doubled.items():
        torch.testing.assert_close(fed[key], value, rtol=0, atol=1e-6)


def test_federated_snapshots_are_the_expert_after_that_many_rounds_keyed_by_all_workers_steps():
    lab = Lab(SMOKE_MODEL, max_seq_len=64)
    data = tuple(map(tuple, shards(ds1000_domains()[2].train[:24], 2)))
    long = run_fed(lab, FedJob(data, rounds=3, steps=1, seed=4, snapshot_every=1))
    short = run_fed(lab, FedJob(data, rounds=2, steps=1, seed=4))
    assert set(long.snapshots) == {2, 4, 6}  # 2 workers x 1 step per round
    for key, value in short.weights.items():
        torch.testing.assert_close(long.snapshots[4][key], value, rtol=0, atol=0)
        torch.testing.assert_close(long.snapshots[6][key], long.weights[key], rtol=0, atol=0)
    assert any(not torch.equal(long.snapshots[2][k], long.snapshots[4][k]) for k in short.weights)


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
    # in this process: the module's command line is test_a_bad_compression_flag_from_the_command_line_...'s
    report, stdout = quick(tmp_path, "quality_compression", in_process=True)
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
    settings = report["settings"]
    assert fvc["central_same_wall_time"]["steps"] == settings["fvc_rounds"] * settings["steps"]
    assert settings["fvc_rounds"] > settings["rounds"]  # the quick run exercises the fp32 snapshot
    assert fvc["fedbuff"]["steps_in_all"] == settings["fvc_rounds"] * settings["steps"] * settings["workers"]
    assert all(w["loss"] > c["loss"] for w, c in zip(wall, report["central"]))  # fewer steps, less learnt
    assert all(len(r["track"]) == settings["rounds"] for r in report["records"])
    assert all(len(c["track"]) == settings["fvc_rounds"] for c in report["central"])
    fp32_codec, fp32_fvc = report["records"][0], report["federated"][0]
    assert fp32_codec["label"] == "safetensors" and fp32_fvc["loss"] < fp32_codec["loss"]  # more rounds, more learnt
    for r in report["records"] + report["central"]:
        assert r["loss"] < report["summary"]["base_heldout"]["loss"]  # every run learnt something
        assert r["loss_without_end"] != r["loss"]
    assert report["cost"]["train_steps"] > 0 and "vs central" in stdout
    # --estimate plans exactly what the run did (the time budget of make bench-quality is checked with it)
    assert planned("quality_compression", "--quick") == (report["cost"]["train_steps"], report["cost"]["eval_examples"])


def test_compression_federated_vs_central_only_at_a_server_lr(tmp_path):
    report, stdout = quick(tmp_path, "quality_compression", "--fvc-only", "--server-lr", "2", "--fedasync", in_process=True)
    assert {r["label"] for r in report["records"]} == {"safetensors"} and report["summary"]["targets"] == {}
    fvc = report["summary"]["federated_vs_central"]
    assert fvc["fedbuff"]["server_lr"] == 2 == report["settings"]["server_lr"] and "fedasync" in fvc
    assert "fedbuff (server lr 2)" in stdout
    assert planned("quality_compression", "--quick", "--fvc-only", "--fedasync") == (
        report["cost"]["train_steps"], report["cost"]["eval_examples"])


def test_compression_takes_each_arms_learning_rate(tmp_path):
    report, stdout = quick(tmp_path, "quality_compression", "--fvc-only", "--lr", "0.02", "--central-lr", "0.005", in_process=True)
    fvc = report["summary"]["federated_vs_central"]
    assert report["settings"]["lr"] == 0.02 == fvc["fedbuff"]["lr"] and fvc["central"]["lr"] == 0.005
    assert "fedbuff (lr 0.02) (server lr 1)" in stdout and "central (lr 0.005)" in stdout
    default, _ = quick(tmp_path, "quality_compression", "--fvc-only", in_process=True)
    assert default["records"][0]["loss"] != report["records"][0]["loss"]  # the flag reached the workers
    assert default["central"][0]["loss"] != report["central"][0]["loss"]
    # the codecs' fp32 reference is the longer run's expert after the codec rounds (a snapshot after round 2 of 3)
    short, _ = quick(tmp_path, "quality_compression", "--fvc-only", "--fvc-rounds", "2", in_process=True)
    assert default["settings"]["fvc_rounds"] == 3 and short["settings"]["rounds"] == 2
    assert default["records"][0]["loss"] == short["records"][0]["loss"]
    assert default["records"][0]["bytes_sent"] == short["records"][0]["bytes_sent"]
    assert short["federated"][0] == short["records"][0] and default["federated"][0]["loss"] != short["federated"][0]["loss"]


@pytest.mark.parametrize("args, message", [(["--server-lr", "0"], "--server-lr must be a positive number"),
                                           (["--lr", "-1"], "--lr must be a positive number"),
                                           (["--central-lr", "inf"], "--central-lr must be a positive number"),
                                           (["--server-lr", "nan"], "--server-lr must be a positive number"),
                                           (["--fvc-only", "--only", "int8"], "--fvc-only runs no codecs"),
                                           (["--rounds", "5", "--fvc-rounds", "4"],
                                            "--fvc-rounds (4) must be at least --rounds (5)")])
def test_bad_compression_flags_answer_with_one_line(args, message, capsys):
    from bench.quality_compression import BENCH  # in this process: a subprocess per case cost ~11 s of imports

    with pytest.raises(SystemExit) as exit_info:
        BENCH.parse(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_compression_flag_from_the_command_line_is_one_line_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "bench.quality_compression", "--lr", "-1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--lr must be a positive number" in proc.stderr and "Traceback" not in proc.stderr


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
    for method in ("mixture (top-3)", "mixture (top-2)", "arrow", "arrow + GenKnowSub"):  # soft mixtures
        assert all(v["n"] == 1 for v in methods[method]["loss"].values()), method
    lodo, sizes = report["leave_one_out"], {d: v["heldout"] for d, v in report["domains"].items()}
    assert set(lodo) >= {"base", "gateway", "routed", "mixture (top-3)", "arrow", "arrow + GenKnowSub"}
    assert lodo["base"] == {d: methods["base"]["loss"][d] for d in sizes}  # the same problems, the same model
    mistakes = report["soft"]["router_mistakes"]
    for split in ("shipped", "leave_one_out"):  # every held-out prompt is right, wrong or a fallback
        assert {d: sum(m.values()) for d, m in mistakes[split].items()} == sizes
    assert all(m["right"] == 0 for m in mistakes["leave_one_out"].values())  # its own expert is missing
    table = report["soft"]["pass_at_1"]
    assert set(table["shipped"]) == {"base", "gateway", "routed", "mixture (top-3)"} and table["problems"] == \
        dict.fromkeys(sizes, 1)
    assert 0 < report["soft"]["wrong_expert"]["threshold"] <= 1 and "leave one domain out" in stdout


def test_poisoning_quick_run(tmp_path):
    report, stdout = quick(tmp_path, "quality_poisoning")
    by_rule = report["summary"]["by_rule"]
    assert set(by_rule) == {"none", "median"} and set(by_rule["none"]) == {"sign_flip", "scale"}
    # a flipped update pulls plain averaging back (an undertrained tiny model may even gain from a scaled one)
    assert by_rule["none"]["sign_flip"]["pct"]["mean"] > max(0.0, by_rule["median"]["sign_flip"]["pct"]["mean"])
    assert report["summary"]["honest"]["loss"]["mean"] < report["base"]["loss"]
    assert "within 2%" in stdout
    assert planned("quality_poisoning", "--quick") == (report["cost"]["train_steps"], report["cost"]["eval_examples"])


def test_fvc_sweep_arms_parse_or_say_why():
    assert parse_arm("central:lr=2e-3", 24, 3) == Arm("central", lr=2e-3)
    assert parse_arm("fed:lr=3e-3,rounds=8,steps=1", 24, 3) == Arm("fed", lr=3e-3, rounds=8, steps=1)
    assert parse_arm("fed", 24, 3) == Arm("fed")  # 4 rounds x 2 steps x 3 workers
    assert parse_arm("fed:fresh_adam=1", 24, 3).label == "fed 4x2 lr preset slr 1 fresh adam"
    for spec, message in [("fed:rounds=3", "18 steps, not the 24"), ("local:lr=1", "must start with"),
                          ("central:rounds=2", "is not one of lr=..."), ("fed:lr=x", "lr must be a number"),
                          ("fed:server_lr=0", "server_lr must be positive"), ("fed:lr", "is not one of"),
                          ("fed:fresh_adam=2", "fresh_adam must be 0 or 1"),
                          ("fed:fresh_adam=0.5", "fresh_adam must be 0 or 1"), ("fed:rounds=1.5", "rounds must be an integer")]:
        with pytest.raises(ValueError, match=message):
            parse_arm(spec, 24, 3)


def test_fvc_sweep_scores_validation_only(tmp_path):
    out = tmp_path / "sweep.json"
    arms = ["central", "central:lr=0.02", "fed:rounds=1,steps=2"]
    # in this process (tests.helpers.run_main); the command line is the bad flag's below, from the shell
    code, stdout, stderr = run_main(importlib.import_module("bench.fvc_sweep").main, "--quick", "--total-steps", "6",
                                    "--arms", *arms, "--out", str(out))
    assert code == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["split"] == "validation" and report["validation_problems"] == 8
    summary = report["summary"]
    assert set(summary["arms"]) == {"central lr preset", "central lr 0.02", "fed 1x2 lr preset slr 1"}
    best = summary["best_central"]
    assert summary["arms"][best]["vs_best_central_pct"] == 0
    assert all(v["loss"] < summary["base_validation"]["loss"] for v in summary["arms"].values())
    assert summary["arms"]["central lr preset"]["loss"] != summary["arms"]["central lr 0.02"]["loss"]
    assert report["cost"]["train_steps"] == 18 and best in stdout
    assert planned("fvc_sweep", "--quick", "--total-steps", "6", "--arms", *arms) == (
        report["cost"]["train_steps"], report["cost"]["eval_examples"])
    bad = subprocess.run([sys.executable, "-m", "bench.fvc_sweep", "--arms", "fed:steps=5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not the 24 of --total-steps" in bad.stderr and "Traceback" not in bad.stderr


def test_early_stopping_picks_the_best_validation_checkpoint_at_or_before_the_horizon():
    validation = {n: {"loss": loss, "loss_without_end": loss} for n, loss in {12: 2.0, 24: 1.5, 36: 1.2, 48: 1.2, 60: 1.4}.items()}
    assert [pick(validation, h) for h in (12, 24, 48, 60)] == [12, 24, 36, 36]  # a tie: the earlier


def _horizon_record(label: str, kind: str, seed: int, val: float, held: float, chosen: int = 12) -> dict:
    pair = {"loss": held, "loss_without_end": held / 2}
    return {"label": label, "arm": {"kind": kind}, "seed": seed, "horizons": {"24": {
        "chosen_step": chosen, "validation_fixed": val + 0.1, "validation_chosen": val,
        "heldout_fixed": {"loss": held + 0.1, "loss_without_end": held}, "heldout_chosen": pair}}}


def test_horizon_summary_tunes_each_kind_on_validation_and_compares_held_out_seed_by_seed():
    records = [_horizon_record("c1", "central", 0, 1.0, 2.0), _horizon_record("c1", "central", 1, 1.0, 2.2),
               _horizon_record("c2", "central", 0, 1.1, 1.0), _horizon_record("c2", "central", 1, 1.1, 1.0),
               _horizon_record("f1", "fed", 0, 1.2, 2.02, chosen=24), _horizon_record("f1", "fed", 1, 1.2, 2.31, 24)]
    summary = summarize_horizons(records, [24], {})
    chosen = summary["comparisons"]["24 chosen"]
    # c2 has the better held-out loss, but validation picks c1: held-out never chooses
    assert (chosen["central"], chosen["fed"]) == ("c1", "f1")
    assert chosen["gap_pct"] == pytest.approx(100 * (2.165 / 2.1 - 1))
    assert chosen["per_seed_gap_pct"] == pytest.approx({"0": 1.0, "1": 5.0})
    assert chosen["met"] is False and chosen["fed_chosen_steps"] == [24, 24]
    fixed = summary["comparisons"]["24 fixed"]
    assert fixed["gap_pct"] == pytest.approx(100 * (2.265 / 2.2 - 1)) and fixed["gap_pct_without_end"] == pytest.approx(
        100 * (2.165 / 2.1 - 1))
    assert summary["arms"]["c1"]["horizons"]["24"]["heldout_chosen"]["mean"] == pytest.approx(2.1)


def test_fvc_horizons_checkpoint_score_and_reuse_the_cache(tmp_path):
    """Run in this process (bench.fvc_sweep's command line is test_fvc_sweep_scores_validation_only's): a run,
    the same run again from the cache, a shorter one cut from it, and the flags that do not fit."""
    from bench.fvc_sweep import main

    out, cache = tmp_path / "h.json", tmp_path / "cache"
    arms = ["central", "fed:steps=1"]
    argv = ["--quick", "--horizons", "3", "6", "--every", "3", "--arms", *arms, "--cache", str(cache), "--heldout"]
    code, _, stderr = run_main(main, *argv, "--out", str(out))
    assert code == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["heldout_problems"] == 8 and report["every"] == 3 and report["cost"]["train_steps"] == 12
    for r in report["records"]:
        assert set(r["validation"]) == {"3", "6"} and not r["cached"]
        for h, v in r["horizons"].items():
            assert v["chosen_step"] == min((n for n in (3, 6) if n <= int(h)), key=lambda n: r["validation"][str(n)]["loss"])
            assert v["heldout_chosen"] == r["horizons"][str(v["chosen_step"])]["heldout_fixed"]
    assert report["records"][1]["label"] == "fed 2x1 lr preset slr 1"  # 2 rounds x 1 step x 3 workers = 6
    assert set(report["summary"]["comparisons"]) == {"3 fixed", "3 chosen", "6 fixed", "6 chosen"}
    assert planned("fvc_sweep", "--quick", "--horizons", "3", "6", "--every", "3", "--arms", *arms)[0] == 12
    code, _, stderr = run_main(main, *argv, "--out", str(tmp_path / "again.json"))
    assert code == 0, stderr[-3000:]
    second = json.loads((tmp_path / "again.json").read_text())
    assert all(r["cached"] for r in second["records"]) and second["cost"]["train_steps"] == 0
    assert second["summary"]["comparisons"] == report["summary"]["comparisons"]
    shorter = argv[:3] + argv[4:]  # --horizons 3: the 6-step runs, cut
    code, _, stderr = run_main(main, *shorter, "--out", str(tmp_path / "short.json"))
    assert code == 0, stderr[-3000:]
    short = json.loads((tmp_path / "short.json").read_text())
    assert [r["label"] for r in short["records"]] == ["central lr preset", "fed 1x1 lr preset slr 1"]
    assert all(r["cached"] and set(r["validation"]) == {"3"} for r in short["records"])
    assert ({**short["summary"]["comparisons"]["3 chosen"], "fed": "-"}
            == {**report["summary"]["comparisons"]["3 chosen"], "fed": "-"})  # the same weights, scored the same
    for bad, message in [(["--every", "2", "--horizons", "6"], "not a whole number of rounds"),
                         (["--every", "4", "--horizons", "6"], "not multiples of --every 4"),
                         (["--heldout"], "--heldout needs --horizons")]:
        code, _, stderr = run_main(main, "--quick", "--arms", "fed:steps=1", *bad)
        assert code == 2 and message in stderr and "Traceback" not in stderr, stderr
