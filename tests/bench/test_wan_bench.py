"""bench.wan's flags and worker command lines (the runs themselves take minutes of namespaces: docs/wan.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.wan import DEFAULT_MODES, MODES, PRESETS, CpuCapUnavailable, cpu_capped, worker_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags, message", [
    (["--quick", "--base-model", "smollm2-135m"], "error: --quick is the tiny-qwen2 preset; drop --quick or --base-model"),
    (["--duration", "0"], "error: --duration must be positive, got 0.0"),
    (["--modes", "relays"], "error: --modes must include a baseline (a mode without relays) and name only"),
    (["--modes", "flat,nope"], "error: --modes must include a baseline (a mode without relays) and name only"),
    (["--runs", "0"], "error: --runs must be 1-20, got 0"),
    (["--worker-cpu", "0"], "error: --worker-cpu must be between 0.01 and"),
    (["--worker-cpu", "nan"], "error: --worker-cpu must be between 0.01 and"),
    (["--forward-interval", "0"], "error: --forward-interval must be 0.05-3600 seconds, got 0.0"),
    (["--forward-interval", "nan"], "error: --forward-interval must be 0.05-3600 seconds, got nan"),
])
def test_bad_flags_answer_with_one_line(flags, message, capsys):
    from bench.wan import main  # in this process: a subprocess per case cost ~5 s of imports

    assert main(flags) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(message)


def test_a_bad_flag_from_the_command_line_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.wan", "--duration", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "error: --duration must be positive, got 0.0\n"


def test_every_default_mode_exists_and_each_model_has_baselines_and_relays():
    for names in DEFAULT_MODES.values():
        assert set(names) <= set(MODES)
        assert any(MODES[n].baseline for n in names) and any(not MODES[n].baseline for n in names)


def test_the_smollm2_baselines_are_a_user_s_defaults_swept_and_flower_at_three_round_lengths(tmp_path):
    from bench.wan import SWEEP_INTERVALS, mode_settings

    s = PRESETS["smollm2-135m"]
    names = DEFAULT_MODES["smollm2-135m"]
    flat = [n for n in names if n.startswith("flat defaults sync")]
    assert len(flat) >= 3 and len({MODES[n].sync_interval for n in flat}) == len(flat) == len(SWEEP_INTERVALS)
    assert len({MODES[n].flower_steps for n in names if MODES[n].flower_steps}) >= 3
    for name in flat:
        mode = MODES[name]
        assert mode.root == {}  # the coordinator's defaults
        argv = worker_command("wan-0-0", "http://10.0.0.1:1", tmp_path / "w.jsonl", mode.workers,
                              mode_settings(mode, s), dataset=tmp_path / "shard-0.jsonl")
        assert "--no-overlap" not in argv  # the worker's default: sync overlapped with training
        assert float(argv[argv.index("--sync-interval") + 1]) == mode.sync_interval
        assert argv[argv.index("--dataset") + 1] == str(tmp_path / "shard-0.jsonl")
        assert argv[argv.index("--lr") + 1] == str(s.lr)  # the Flower clients' lr too (bench.wan_flower)


def test_shards_are_disjoint_and_cover_the_expert_s_training_examples(tmp_path):
    from bench.common import sample_suite
    from bench.wan_setup import SPECIALTY, write_shards

    paths = write_shards(tmp_path, 6)
    rows = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
    train = next(d for d in sample_suite().domains if d.name == SPECIALTY).train
    assert len(rows) == len(train) and {r["prompt"] for r in rows} == {e.prompt for e in train}
    assert min(len(p.read_text().splitlines()) for p in paths) >= len(train) // 6


def test_the_smollm2_preset_is_the_link_bound_one_and_seeds_each_worker_s_codec(tmp_path):
    s = PRESETS["smollm2-135m"]
    flags = MODES["flat randomk+terngrad"].workers
    commands = [worker_command(name, "http://10.0.0.1:1", tmp_path / f"{name}.jsonl", flags, s)
                for name in ("wan-0-0", "wan-0-1")]
    for argv in commands:
        assert argv[argv.index("--base-model") + 1] == "smollm2-135m"
        assert argv[argv.index("--threads") + 1] == "1" and "--no-overlap" in argv and "--no-heldout-eval" in argv
        assert argv[argv.index("--batch-size") + 1] == "1" and argv[argv.index("--max-seq-len") + 1] == "32"
        assert "--no-error-feedback" in argv
    configs = [json.loads(argv[argv.index("--compression-config") + 1]) for argv in commands]
    seeds = [(c["randomk"]["seed"], c["terngrad"]["seed"]) for c in configs]
    assert all(a == b > 0 for a, b in seeds) and seeds[0] != seeds[1]  # each worker keeps its own entries
    orders = [argv[argv.index("--seed") + 1] for argv in commands]
    assert orders[0] != orders[1]  # each worker its own order over the examples
    assert all(c["randomk"]["ratio"] == 0.1 and c["randomk"]["rescale"] is True for c in configs)
    tiny = worker_command("w", "http://10.0.0.1:1", tmp_path / "w.jsonl", MODES["flat"].workers, PRESETS["quick"])
    assert "--no-overlap" not in tiny and "--threads" not in tiny  # the tiny presets are unchanged


def test_a_capped_worker_gets_its_share_of_a_core_and_no_more():
    burn = "import os, time\nt = time.time()\nwhile time.time() - t < 2: pass\nprint(sum(os.times()[:2]))"
    try:
        with cpu_capped("test", 0.2) as add:
            proc = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
            add(proc.pid)
            used = float(proc.communicate(timeout=60)[0])
    except CpuCapUnavailable as exc:
        pytest.skip(str(exc))
    assert used < 0.2 * 2 * 1.5  # 2 s of wall at a fifth of a core (uncapped it would take up to 2 CPU s)


def test_pulls_are_counted_by_kind_and_by_where_their_bytes_came_from():
    from bench.wan import figures, relay_pulls

    records = [{"sync_seconds": 1, "pull_seconds": 0.1, "bytes_down": 100, "pull_codec": "int8"},
               {"sync_seconds": 1, "pull_seconds": 0.1, "bytes_down": 400},
               {"sync_seconds": 1, "pull_seconds": 0.0, "bytes_down": 0},
               {"sync_seconds": 1, "pull_seconds": 0.1, "bytes_down": 400}]
    row = figures(records)
    assert row["pull_codecs"] == {"int8": 1, "full": 2, "none": 1} and row["pull_bytes_total"] == 900
    row["relays"] = [{"stats": {"bytes_served": 500, "diff_bytes_served": 100, "diffs_unavailable": 2}},
                     {"stats": {"bytes_served": 300}}]
    assert relay_pulls(row) == {"served_full": 700, "served_diffs": 100, "passed_through": 100, "diffs_unavailable": 2}
    row["relays"] = []
    assert relay_pulls(row) is None


def test_the_time_to_target_is_the_first_version_reaching_it_even_between_two_sampled_ones():
    from bench.wan import first_reaching

    truth = [2.4, 2.0, 1.5, 1.9, 2.2, 1.8, 1.4, 1.2]  # dips under 1.6 at index 2, rises, comes down again at 6
    versions = [{"heldout_loss": truth[i]} if i in (0, 4, 7) else {} for i in range(len(truth))]  # sampled
    evaluated = []

    def loss(v):  # as bench.wan's: a version is evaluated once
        i = next(j for j, x in enumerate(versions) if x is v)
        if "heldout_loss" in v:
            return v["heldout_loss"]
        evaluated.append(i)
        v["heldout_loss"] = truth[i]
        return truth[i]

    assert first_reaching(versions, 1.6, loss) == 2  # the old rule (since the last sampled above) said 6
    assert evaluated == [1, 2]  # in order, stopping at the first that reaches it
    assert first_reaching(versions, 1.0, loss) is None  # none reaches it: all evaluated to be sure
    assert sorted(evaluated) == [1, 2, 3, 5, 6]
    assert first_reaching([{"heldout_loss": 1.5}], 1.6, loss) == 0


def test_every_mode_s_relay_flags_are_run_coordinator_s():
    import run_coordinator

    for name, mode in MODES.items():
        if mode.relays is not None:
            args = run_coordinator.parse_args(["--upstream", "http://127.0.0.1:1", *mode.relays])
            assert args.upstream == "http://127.0.0.1:1", name
    both = run_coordinator.parse_args(["--upstream", "http://h:1", *MODES["relays+adaptive (int8 both ways)"].relays])
    assert both.upstream_pull_compression == both.forward_compression == "int8"


def _run(mode, baseline, losses, seconds, **extra):
    versions = [{"version": i, "seconds": t, "heldout_loss": x} for i, (x, t) in enumerate(zip(losses, seconds))]
    return {"mode": mode, "baseline": baseline, "versions": versions, **extra}


def test_the_targets_are_the_best_baseline_s_final_loss_and_ninety_percent_of_its_gain():
    from bench.wan_eval import evaluate, summarise

    rows = [_run("flat 3s", True, [2.0, 1.6, 1.5], [0, 10, 20]), _run("flat 3s", True, [2.0, 1.7, 1.4], [0, 12, 24]),
            _run("flower", True, [2.0, 1.5, 1.2], [0, 30, 60]), _run("flower", True, [2.0, 1.3, 1.1], [0, 25, 50]),
            _run("relays", False, [2.0, 1.24, 1.1], [0, 5, 9]), _run("relays", False, [2.0, 1.3, 1.2], [0, 6, 8])]

    def cached(v):  # as bench.wan_eval.scorer's: every version here is scored already
        return v["heldout_loss"]

    goals = evaluate(rows, PRESETS["quick"], loss=cached)
    assert goals["best_baseline"] == "flower" and goals["target_loss"] == 1.15  # the median of its finals
    assert goals["target90_loss"] == round(2.0 - 0.9 * 0.85, 4)  # 1.235
    assert [r["time_to_target_s"] for r in rows] == [None, None, None, 50, 9, None]
    assert [r["time_to_target90_s"] for r in rows] == [None, None, 60, 50, 9, 8]
    lines = {line["mode"]: line for line in summarise(rows, goals)}
    assert lines["flower"]["time_to_target90_s"] == {"median": 55, "min": 50, "max": 60, "runs": 2, "never": 0}
    assert lines["flat 3s"]["time_to_target90_s"]["median"] is None  # never, in both runs
    assert lines["relays"]["time_to_target90_s"]["median"] == 8.5
    assert lines["relays"]["speedup_target90_s"] == round(55 / 8.5, 2)  # against the fastest baseline (flower)
    # to the final-loss target one relays run never got there: the median is the slower of two, infinite -> None
    assert lines["relays"]["time_to_target_s"] == {"median": None, "min": 9, "max": None, "runs": 2, "never": 1}


def test_flower_s_clock_starts_when_its_clients_began_training_not_when_the_server_app_saved_round_0():
    from bench.wan_flower import training_start

    assert training_start([{"round": 0, "time": 100.0}]) is None
    # round 1 ends 80 s after round 0 (model loads), then rounds of ~20 s: training began ~20 s before round 1's end
    rounds = [{"round": 0, "time": 100.0}, {"round": 1, "time": 180.0}, {"round": 2, "time": 199.0},
              {"round": 3, "time": 220.0}, {"round": 4, "time": 240.0}]
    assert training_start(rounds) == 180.0 - 20.0
    assert training_start(rounds[:2]) is None  # round 1's length holds the model loads: wait for round 2
    assert training_start(rounds[:3]) == 180.0 - 19.0


def test_a_relay_mode_s_root_takes_one_batch_per_site_whatever_the_number_of_sites():
    from dataclasses import replace

    from bench.wan import root_settings

    s = PRESETS["smollm2-135m"]
    for name in ("relays+adaptive (int8 both ways; site model)", "relays+adaptive self-formed (int8 both ways; site model)"):
        assert root_settings(MODES[name], replace(s, sites=1)) == {"aggregation": "fedbuff", "buffer_size": 1}
        assert root_settings(MODES[name], replace(s, sites=3))["buffer_size"] == 3  # was 2 whatever the sites
    assert root_settings(MODES["flat"], replace(s, sites=1))["buffer_size"] == 3  # flat: the group size, as before


def test_learning_is_counted_in_steps_each_worker_had_trained_when_a_target_was_reached():
    from bench.wan import step_clock
    from bench.wan_eval import steps_at

    t0 = 1000.0  # the expert's creation; each record is a sync at "time" carrying the steps trained before it
    records = [{"time": 1010.0, "steps": 4}, {"time": 1005.0, "steps": 2}, {"time": 1020.0, "steps": 6},
               {"time": 1021.0, "steps": 0}]  # a sync that trained nothing (the final one) adds nothing
    clock = step_clock(records, t0, workers=2)
    assert clock == [[5.0, 1.0], [10.0, 3.0], [20.0, 6.0]]
    row = {"step_clock": clock}
    assert [steps_at(row, t) for t in (4.0, 10.0, 19.9, 60.0)] == [0.0, 3.0, 3.0, 6.0]
    assert steps_at(row, None) is None and steps_at({}, 10.0) is None  # never reached; a row without a clock
