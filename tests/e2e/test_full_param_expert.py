"""A full-parameter expert (--lora-rank 0) federated through a real coordinator, then exported."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

import get_gateway_model
from protocol.client import CoordinatorClient
from tests import launcher
from tests.e2e.conftest import ROOT, env
from worker.data import load_examples, sample_dataset_path, split_examples
from models.loading import load_base_model
from worker.trainer import evaluate_loss


def run(*args: str) -> subprocess.CompletedProcess:
    return launcher.run([sys.executable, *args], cwd=ROOT, env=env() | {"OMP_NUM_THREADS": "1"},
                        capture_output=True, text=True, timeout=180)


def test_full_parameter_expert_trains_compressed_syncs_and_exports(start_coordinator, tmp_path, capsys):
    _, url = start_coordinator()
    results = tmp_path / "w.jsonl"
    worker = run(str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", "sql_expert",
                 "--base-model", "tiny-qwen2", "--lora-rank", "0", "--duration", "5", "--sync-interval", "1.5",
                 "--compression", "int8", "--pull-compression", "fp16", "--full-pull-every", "2",
                 "--results", str(results), "--state-dir", str(tmp_path / "state"))
    assert worker.returncode == 0, worker.stderr[-3000:]

    base = load_base_model("tiny-qwen2")
    params = dict(base.model.named_parameters())
    client = CoordinatorClient(url)
    (expert,) = client.experts.list()
    records = [json.loads(line) for line in results.read_text().splitlines()]
    pushed = [r for r in records if r.get("bytes_sent")]
    assert expert["kind"] == "full" and expert["lora"] is None
    assert expert["full"]["num_parameters"] == sum(p.numel() for p in params.values())
    assert expert["version"] == len(pushed) >= 2
    *syncs, flush = pushed  # the last push flushes int8's error-feedback residual losslessly (docs/worker.md)
    assert syncs and all(r["codec"] == "int8" and r["ratio"] > 3.5 for r in syncs)  # block scales included
    assert flush["final"] and flush["codec"] == "safetensors"
    assert any(r["pulled"] and 0 < r["bytes_down"] < 0.6 * 4 * expert["full"]["num_parameters"]
               for r in records)  # at least one fp16 difference pull
    weights = client.experts.pull("sql_expert").tensors
    assert sorted(weights) == sorted(params)

    heldout = split_examples(load_examples(sample_dataset_path("sql_expert")))[1][:16]
    base_loss = evaluate_loss(base.model, base.tokenizer, heldout, max_seq_len=128)
    assert get_gateway_model.main(["--coordinator-url", url, "--save-gateway", str(tmp_path / "merged"),
                                   "--format", "merged"]) == 0
    assert "full-parameter, as merged" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for name, p in merged.named_parameters():  # the gateway of one expert is that expert, exactly
        assert torch.equal(p.detach(), weights[name]), name
    assert evaluate_loss(merged, base.tokenizer, heldout, max_seq_len=128) < base_loss - 1.0

    assert get_gateway_model.main(["--coordinator-url", url, "--save-gateway", str(tmp_path / "peft"),
                                   "--format", "peft"]) == 2
    assert not (tmp_path / "peft").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --format peft: this is a full-parameter model (every weight, no LoRA factors), not a PEFT adapter; "
        "use --format merged for a model directory, or a .safetensors/.npz file"]
