"""data/: the shipped sample datasets are exactly what data/make_samples.py writes, and usable."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from worker.data import load_examples, sample_dataset_path, split_examples

DATA = Path(__file__).resolve().parents[2] / "data"
NAMES = ("python_expert", "sql_expert", "docs_expert")


@pytest.mark.slow
def test_sample_files_regenerate_byte_identically(tmp_path):
    subprocess.run([sys.executable, str(DATA / "make_samples.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    for name in NAMES:
        committed = (DATA / f"{name}.jsonl").read_bytes()
        assert (tmp_path / f"{name}.jsonl").read_bytes() == committed, f"{name}.jsonl is stale: run data/make_samples.py"
    shipped = sorted(p.name for p in (DATA / "formats").iterdir())
    assert sorted(p.name for p in (tmp_path / "formats").iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / "formats" / name).read_bytes() == (DATA / "formats" / name).read_bytes(), name


@pytest.mark.parametrize("name", NAMES)
def test_sample_file_shape(name):
    path = sample_dataset_path(name)
    assert path == DATA / f"{name}.jsonl"
    assert path.stat().st_size < 400 * 1024
    examples = load_examples(path)
    assert 300 <= len(examples) <= 500
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len({r["id"] for r in records}) == len(records)
    assert len({e.prompt for e in examples}) == len(examples)
    train, heldout = split_examples(examples)
    assert 0.05 * len(examples) <= len(heldout) <= 0.15 * len(examples)


def test_domains_differ_in_style():
    first = {name: load_examples(DATA / f"{name}.jsonl")[0] for name in NAMES}
    assert first["python_expert"].reference_code.startswith("def ")
    assert first["sql_expert"].reference_code.startswith("SELECT ")
    assert first["docs_expert"].reference_code.startswith('"""')


def test_python_answers_compile_and_sql_answers_run():
    sys.path.insert(0, str(DATA))
    try:
        from samplegen.sql_schema import build_database
    finally:
        sys.path.remove(str(DATA))
    for example in load_examples(DATA / "python_expert.jsonl"):
        compile(example.reference_code, "<answer>", "exec")
    conn = build_database()
    for example in load_examples(DATA / "sql_expert.jsonl"):
        assert conn.execute(example.reference_code).fetchall(), example.prompt
