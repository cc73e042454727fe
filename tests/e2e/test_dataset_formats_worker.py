"""Every dataset format end to end: a worker (run_worker.main, in this process) trains tiny-qwen2 on the shipped
sample of that format, and on Parquet and save_to_disk copies, and its updates reach a real coordinator."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import run_worker
from protocol.client import CoordinatorClient
from tests.e2e.conftest import module_coordinator
from tests.helpers import run_main

FORMATS_DIR = Path(__file__).resolve().parents[2] / "data" / "formats"


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    yield from module_coordinator(tmp_path_factory)


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """The messages sample as Parquet, and the ShareGPT sample as a save_to_disk directory."""
    import datasets

    out = tmp_path_factory.mktemp("containers")
    rows = [json.loads(line) for line in (FORMATS_DIR / "messages.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(out / "messages.parquet"))
    datasets.Dataset.from_list(json.loads((FORMATS_DIR / "sharegpt.json").read_text())).save_to_disk(str(out / "saved"))
    return out


CASES = {"prompt-completion": "prompt_completion.csv", "messages": "messages.jsonl", "alpaca": "alpaca.json",
         "sharegpt": "sharegpt.json", "text": "text.jsonl", "parquet": "messages.parquet", "save-to-disk": "saved"}


@pytest.mark.parametrize("case", CASES)
def test_a_worker_trains_on_the_format_and_its_updates_reach_the_coordinator(coordinator, containers, tmp_path, case):
    dataset = containers / CASES[case] if case in ("parquet", "save-to-disk") else FORMATS_DIR / CASES[case]
    expert = f"{case.replace('-', '_')}_expert"
    results = tmp_path / "results.jsonl"
    code, _, err = run_main(run_worker.main, "--coordinator-url", coordinator, "--specialty", expert,
                            "--dataset", str(dataset), "--base-model", "tiny-qwen2", "--duration", "2",
                            "--sync-interval", "1", "--lora-rank", "2", "--batch-size", "4", "--max-seq-len", "96",
                            "--results", str(results), "--state-dir", str(tmp_path / "state"), "--threads", "1")
    assert code == 0, err
    records = [json.loads(line) for line in results.read_text().splitlines()]
    pushed = [r for r in records if r.get("bytes_sent")]
    listed = {e["name"]: e for e in CoordinatorClient(coordinator).experts.list()}
    assert listed[expert]["version"] == len(pushed) >= 1
    assert listed[expert]["samples_seen"] == sum(r["samples"] for r in pushed) > 0
    assert "held-out loss at end" in err
