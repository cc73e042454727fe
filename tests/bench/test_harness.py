"""bench/harness.py and bench/run_all.py: flags from a settings dataclass, --quick, one-line errors, stamped results,
and every bench found by reading the sources (checked against the modules themselves)."""
from __future__ import annotations

import ast
import datetime
import importlib
import json
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import harness, run_all
from bench.harness import REGISTRY, Bench, Run, declared_benches
from protocol.cli import comma_list, option
from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[2]
NOT_BENCHES = {"bench.run_all", "bench.figures", "bench.flower_baseline", "bench.wanemu.probe"}
"""Modules with a __main__ that are no benchmark: the runner, docs/benchmarks.md's table, and children that other
benches start."""


@dataclass(frozen=True)
class Toy:
    size_mb: int = option(256, "model size in MiB")
    rules: tuple[str, ...] = option(("a", "b"), "comma list of rules", parse=comma_list)
    fast: bool = option(False, "skip the slow part")
    seed: int = option(0, "seed of the draws")
    rows: int = 10
    """Not a flag: only --quick changes it."""

    def __post_init__(self) -> None:
        if self.size_mb < 1:
            raise ValueError(f"--size-mb must be at least 1, got {self.size_mb}")


def toy_run(s: Toy, ctx: Run) -> int:
    ctx.write({"settings_seen": {"size_mb": s.size_mb, "rules": list(s.rules), "fast": s.fast, "rows": s.rows},
               "draw": random.random()})
    return 0


@pytest.fixture
def toy():
    bench = Bench("toy", tags=("performance",), settings=Toy, run=toy_run, quick={"size_mb": 16, "rows": 2},
                  torch_threads=None)
    yield bench
    REGISTRY.pop("toy")


def written(path: Path) -> dict:
    return json.loads(path.read_text())


def test_flags_come_from_the_settings_quick_overrides_them_and_a_flag_given_wins(toy, tmp_path):
    out = tmp_path / "toy.json"
    assert toy.main(["--out", str(out)]) == 0
    assert written(out)["settings_seen"] == {"size_mb": 256, "rules": ["a", "b"], "fast": False, "rows": 10}
    assert toy.main(["--quick", "--out", str(out)]) == 0
    assert written(out)["settings_seen"] == {"size_mb": 16, "rules": ["a", "b"], "fast": False, "rows": 2}
    assert toy.main(["--quick", "--size-mb", "32", "--rules", "c,d", "--fast", "--out", str(out)]) == 0
    assert written(out)["settings_seen"] == {"size_mb": 32, "rules": ["c", "d"], "fast": True, "rows": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["toy.json"]  # written whole, no temp file left


def test_help_shows_each_default_and_what_quick_changes(toy):
    text = toy.parser().format_help()
    assert "model size in MiB (default: 256; --quick: 16)" in " ".join(text.split())
    assert "(default: a,b)" in text and "--rows" not in text and "size_mb=16, rows=2" in " ".join(text.split())


def test_a_bad_value_is_one_line_and_exit_2(toy):
    code, out, err = run_main(toy.main, "--size-mb", "0")
    assert code == 2 and err == "error: --size-mb must be at least 1, got 0\n" and out == ""
    code, _, err = run_main(toy.main, "--size-mb", "many")  # argparse's own: usage and one error line
    assert code == 2 and "invalid int value: 'many'" in err and "Traceback" not in err


def test_every_result_is_stamped_with_commit_load_date_and_settings(toy, tmp_path):
    out = tmp_path / "toy.json"
    assert toy.main(["--seed", "3", "--out", str(out)]) == 0
    stamp = written(out)["stamp"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert stamp["bench"] == "toy" and stamp["commit"] == head and isinstance(stamp["dirty"], bool)
    assert len(stamp["load_average"]["start"]) == len(stamp["load_average"]["end"]) == 3
    assert datetime.datetime.fromisoformat(stamp["date"]).tzinfo is not None
    assert stamp["settings"] == {"size_mb": 256, "rules": ["a", "b"], "fast": False, "seed": 3, "rows": 10}
    assert stamp["quick"] is False and stamp["seconds"] >= 0


def test_the_seed_makes_the_draws_repeat(toy, tmp_path):
    draws = []
    for seed, name in ((1, "a.json"), (1, "b.json"), (2, "c.json")):
        assert toy.main(["--seed", str(seed), "--out", str(tmp_path / name)]) == 0
        draws.append(written(tmp_path / name)["draw"])
    assert draws[0] == draws[1] != draws[2]


def test_quick_results_go_where_git_does_not_look(toy, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "QUICK_RESULTS_DIR", tmp_path / "quick")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    assert toy.main(["--quick"]) == 0 and toy.main([]) == 0
    assert (tmp_path / "quick" / "toy.json").is_file() and (tmp_path / "results" / "toy.json").is_file()
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "bench/results/quick/x.json"],
                             capture_output=True, text=True)
    assert ignored.returncode == 0


def test_a_bench_refuses_unknown_tags_and_quick_keys_that_are_no_settings():
    with pytest.raises(ValueError, match="unknown tags"):
        Bench("bad", tags=("fast",), settings=Toy, run=toy_run)
    with pytest.raises(ValueError, match="not settings fields"):
        Bench("bad", tags=("performance",), settings=Toy, run=toy_run, quick={"sizemb": 1})
    assert "bad" not in REGISTRY


def test_every_runnable_bench_module_declares_itself_and_the_reading_matches_the_modules():
    """A module of bench/ with a __main__ block is a bench (or one of NOT_BENCHES); run_all finds it by reading its
    BENCH line, and importing it registers the same name, tags and cores."""
    runnable = set()
    for path in (ROOT / "bench").rglob("*.py"):
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M):
            runnable.add(".".join(("bench", *path.relative_to(ROOT / "bench").with_suffix("").parts)))
    declared = {d.module: d for d in declared_benches()}
    assert runnable - NOT_BENCHES == set(declared), "a runnable module of bench/ without BENCH = Bench(...)"
    assert len({d.name for d in declared.values()}) == len(declared)  # one result file per bench
    for module, d in declared.items():
        bench = importlib.import_module(module).BENCH
        assert (bench.name, bench.tags, bench.cores) == (d.name, d.tags, d.cores), module
        assert importlib.import_module(module).main == bench.main


def test_run_all_selects_by_tag_name_or_all_and_passes_the_rest_on():
    benches = declared_benches()
    args, passed = run_all.parse_args(["--quick", "-v"])
    assert [b.name for b in run_all.chosen(args, benches)] == ["aggregation", "load", "overhead", "transport"]
    assert passed == ["--quick", "-v"]
    args, _ = run_all.parse_args(["--quality", "--estimate"])  # make bench-quality's spelling
    assert [b.name for b in run_all.chosen(args, benches)] == ["quality_compression", "quality_gateway",
                                                               "quality_poisoning"]
    args, _ = run_all.parse_args(["--all"])
    assert {"hostile", "transport", "quality_gateway"} <= {b.name for b in run_all.chosen(args, benches)}
    args, _ = run_all.parse_args(["--only", "wan_link", "crash"])
    assert [b.module for b in run_all.chosen(args, benches)] == ["bench.wanemu.measure", "bench.crash"]
    code, _, err = run_main(run_all.main, "--only", "nope")
    assert code == 2 and "no bench named ['nope']" in err


def test_bench_never_imports_tests():
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "tests" or n.startswith("tests.") for n in names), path


def test_every_current_result_has_a_headline_that_fits_it():
    """docs/benchmarks.md's table (bench.figures) says "(no headline ...)" for a result it does not know and
    "(the headline does not fit ...)" when a bench changed its result's shape: both are caught here, not on the page."""
    from bench.figures import HEADLINES, headline

    results = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert results and {p.stem for p in results} <= set(HEADLINES), {p.stem for p in results} - set(HEADLINES)
    for path in results:
        line = headline(path.stem, json.loads(path.read_text()))
        assert line and not line.startswith("("), (path.name, line)
