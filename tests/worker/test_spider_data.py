"""data/spider: Spider's text-to-SQL questions split by whole databases, reproducibly (data/spider/split.py)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.data import load_examples

ROOT = Path(__file__).resolve().parents[2]
SPIDER = ROOT / "data" / "spider"
SPLIT = SPIDER / "split.py"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _split_module():
    spec = importlib.util.spec_from_file_location("spider_split", SPLIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_database_straddles_train_and_heldout_and_heldout_is_10_to_15_percent():
    train, heldout = _rows(SPIDER / "train" / "sql_expert.jsonl"), _rows(SPIDER / "heldout" / "sql_expert.jsonl")
    assert len(train) + len(heldout) == 1034  # Spider's dev set, every question kept
    assert not {r["db_id"] for r in train} & {r["db_id"] for r in heldout}
    assert 0.10 <= len(heldout) / 1034 <= 0.15
    validation = set(json.loads((SPIDER / "validation.json").read_text())["sql_expert"])
    assert validation and validation <= {r["db_id"] for r in train}


def test_every_record_is_a_worker_example_and_held_out_ones_carry_their_schema():
    for side in ("train", "heldout"):
        path = SPIDER / side / "sql_expert.jsonl"
        rows = _rows(path)
        assert all(r["prompt"].startswith(f"SQLite database {r['db_id']}:\n") and "\nQuestion: " in r["prompt"]
                   and r["reference_code"].strip() and "  " not in r["reference_code"] for r in rows), side
        assert len(load_examples(path)) == len(rows)  # the worker reads the file as it is
        assert all("CREATE TABLE" in r.get("schema_sql", "") for r in rows) == (side == "heldout")


def test_the_shipped_files_are_what_the_rule_makes():
    done = subprocess.run([sys.executable, str(SPLIT), "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _spider_source(directory: Path, questions: dict[str, int]) -> Path:
    """A Spider-shaped dev.json and tables.json: one two-table database per key, that many questions each."""
    tables = [{"db_id": db, "table_names_original": ["person", "pet"],
               "column_names_original": [[-1, "*"], [0, "id"], [0, "Home Town"], [1, "pet_id"], [1, "owner_id"]],
               "primary_keys": [1, 3], "foreign_keys": [[4, 1]]} for db in questions]
    dev = [{"db_id": db, "question": f"Question {i} on {db}?", "query": f"SELECT  count(*) FROM pet WHERE owner_id = {i}"}
           for db, n in questions.items() for i in range(n)]
    directory.mkdir()
    (directory / "dev.json").write_text(json.dumps(dev))
    (directory / "tables.json").write_text(json.dumps(tables))
    return directory


def test_the_split_is_deterministic_by_database_and_check_catches_an_edit(tmp_path):
    source = _spider_source(tmp_path / "src", {f"db_{i}": 10 + i for i in range(12)})
    outputs = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, str(SPLIT), str(source), "--out", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append({p.relative_to(tmp_path / name): p.read_bytes() for p in (tmp_path / name).rglob("*.json*")})
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
    train, heldout = _rows(tmp_path / "a" / "train" / "sql_expert.jsonl"), _rows(tmp_path / "a" / "heldout" / "sql_expert.jsonl")
    assert not {r["db_id"] for r in train} & {r["db_id"] for r in heldout}
    assert 0.10 <= len(heldout) / (len(train) + len(heldout)) <= 0.15
    first = train[0]
    assert first["prompt"].splitlines()[1:] == ['person(id*, "Home Town")', "pet(pet_id*, owner_id -> person.id)",
                                                "Question: Question 0 on db_0?"]
    assert first["reference_code"] == "SELECT count(*) FROM pet WHERE owner_id = 0"  # spaces collapsed
    heldout_file = tmp_path / "a" / "heldout" / "sql_expert.jsonl"
    heldout_file.write_text(heldout_file.read_text().replace("Question 0", "Question zero", 1))
    done = subprocess.run([sys.executable, str(SPLIT), str(source), "--out", str(tmp_path / "a"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "differs from the rule" in done.stderr


def test_a_database_moved_across_the_split_fails_the_check_without_spiders_files(tmp_path):
    split = _split_module()
    for side in ("train", "heldout"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "sql_expert.jsonl").write_bytes((SPIDER / side / "sql_expert.jsonl").read_bytes())
    (tmp_path / "validation.json").write_bytes((SPIDER / "validation.json").read_bytes())
    train = _rows(tmp_path / "train" / "sql_expert.jsonl")
    moved = [r for r in train if r["db_id"] == "singer"]
    (tmp_path / "train" / "sql_expert.jsonl").write_text(split.to_jsonl([r for r in train if r not in moved], split.FIELDS))
    with open(tmp_path / "heldout" / "sql_expert.jsonl", "a") as f:  # held out now too many questions
        f.write(split.to_jsonl([{**r, "schema_sql": "CREATE TABLE singer (x);"} for r in moved], split.FIELDS + ("schema_sql",)))
    done = subprocess.run([sys.executable, str(SPLIT), "--check", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "differs from the rule" in done.stderr


@pytest.mark.parametrize("args, message", [(["/nonexistent"], "dev.json"), ([], "SOURCE_DIR is required")])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    done = subprocess.run([sys.executable, str(SPLIT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
