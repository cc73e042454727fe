"""Real workers training real (tiny) models against a real coordinator on loopback."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import get_gateway_model
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.schemas import RAW_CODEC
from protocol.tensors import loads
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.helpers import run_main
from worker.data import load_examples, sample_dataset_path, split_examples
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from bench.heldout import adapter_loss
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings


@pytest.fixture(scope="module")
def tiny_base():
    return load_base_model("tiny-qwen2")


def assert_one_console_line_per_sync(output: str, records: list[dict], as_json: bool) -> None:
    """No progress bar in a pipe; one line per sync (a JSON object carrying the record with --log-format json)."""
    assert "\r" not in output
    if as_json:
        entries = [json.loads(line) for line in output.splitlines()]  # every line is a JSON object
        assert [e["sync_record"] for e in entries if e["logger"] == "worker.sync"] == records
    else:
        lines = [line for line in output.splitlines() if " INFO worker.sync: sync " in line]
        assert [int(line.split(" sync ")[1].split(":")[0].split()[0]) for line in lines] == [r["sync"] for r in records]


def test_two_worker_processes_train_their_experts_and_the_gateway_loads(start_coordinator, tmp_path, tiny_base):
    _, url = start_coordinator()
    workers = {}
    for specialty in ("python_expert", "sql_expert"):
        cmd = [sys.executable, str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", specialty,
               "--base-model", "tiny-qwen2", "--duration", "10", "--sync-interval", "3",
               "--lora-rank", "4", "--results", str(tmp_path / f"{specialty}.jsonl"),
               "--state-dir", str(tmp_path / f"{specialty}.state")]
        cmd += ["--log-format", "json"] if specialty == "sql_expert" else []
        workers[specialty] = launcher.popen(cmd, env=env() | {"OMP_NUM_THREADS": "1"}, cwd=ROOT,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = {}
    for specialty, proc in workers.items():
        outputs[specialty], _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, outputs[specialty]

    client = CoordinatorClient(url)
    listed = {w["specialty"]: w for w in client.workers.list()}
    assert {s: (w["status"], w["sync_interval"]) for s, w in listed.items()} == {s: ("alive", 3) for s in workers}
    assert all(w["bytes_up"] > 0 and w["bytes_down"] > 0 for w in listed.values())
    experts = {e["name"]: e for e in client.experts.list()}
    for specialty in workers:
        records = [json.loads(line) for line in (tmp_path / f"{specialty}.jsonl").read_text().splitlines()]
        pushed = [r for r in records if r.get("bytes_sent")]
        assert experts[specialty]["version"] == len(pushed) >= 3
        assert experts[specialty]["samples_seen"] == sum(r["samples"] for r in pushed)
        assert_one_console_line_per_sync(outputs[specialty], records, as_json=specialty == "sql_expert")

        heldout = split_examples(load_examples(sample_dataset_path(specialty)))[1]
        trained = client.experts.pull(specialty).tensors
        base_loss = adapter_loss(tiny_base, heldout)
        expert_loss = adapter_loss(tiny_base, heldout, trained, experts[specialty]["lora"])
        assert expert_loss < base_loss - 0.1, (specialty, base_loss, expert_loss)

    for specialty in workers:  # each worker sent a profile of its data when it joined
        heldout = split_examples(load_examples(sample_dataset_path(specialty)))[1]
        routed = [client.gateway.route(e.prompt)["target"] for e in heldout]
        assert routed.count(specialty) >= 0.9 * len(heldout), routed

    out = tmp_path / "gateway.npz"
    code, _, stderr = run_main(get_gateway_model.main, "--coordinator-url", url, "--save-gateway", str(out))
    assert code == 0, stderr  # in this process (the tool's own process is tests/cli's): no second torch import
    npz = np.load(out, allow_pickle=False)
    meta = json.loads(str(npz["__fedmoe__"]))
    assert meta["lora"]["rank"] == 8 and set(meta["sources"]) == set(workers)
    gateway = {k: torch.from_numpy(npz[k]) for k in npz.files if k != "__fedmoe__"}
    heldout = split_examples(load_examples(sample_dataset_path("sql_expert")))[1]
    assert adapter_loss(tiny_base, heldout, gateway, meta["lora"]) < adapter_loss(tiny_base, heldout)


def test_worker_keeps_training_while_the_coordinator_is_down_and_delivers_once(start_coordinator, tmp_path):
    proc, url = start_coordinator("--staleness-decay", "0")
    port = url.rsplit(":", 1)[1]
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    base = load_base_model("tiny-qwen2")
    trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(lr=1e-3, batch_size=2, max_seq_len=64), train)
    client = CoordinatorClient(url, retry=RetryPolicy(attempts=2, base_delay=0.05))
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    # lossless both ways (not the int8 defaults): the check below is that nothing is lost or doubled, exactly
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w1"), client, trainer, spec,
                             encoder=UpdateEncoder(CompressionSettings(RAW_CODEC)), pull=PullSettings(codec=None))
    worker.joining.join()

    worker.interval.add(trainer.train_steps(2))
    assert worker.sync()["delivered"] and worker.base_version == 1

    proc.stop()
    for _ in range(2):  # two intervals of training with nobody to talk to
        worker.interval.add(trainer.train_steps(2))
        record = worker.sync()
        assert not record["delivered"] and worker.base_version == 1
    assert len(worker.outbox) == 2
    local = trainer.adapter_state()

    start_coordinator("--staleness-decay", "0", "--port", port)  # same data dir, same address
    assert worker.sync()["delivered"] and not worker.outbox
    info = client.experts.get("sql_expert")
    assert info["version"] == 3 and info["updates_applied"] == 3 and info["samples_seen"] == 12
    pulled = loads(client.transport.request("GET", "/experts/sql_expert/weights").content)
    assert all(torch.allclose(pulled[k], local[k], atol=1e-6) for k in local)  # nothing lost, nothing doubled


def test_compressed_pushes_and_diff_pulls_stay_close_to_the_experts_weights(start_coordinator):
    _, url = start_coordinator()
    train, _ = split_examples(load_examples(sample_dataset_path("docs_expert")))
    base = load_base_model("tiny-qwen2")
    trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64), train)
    client = CoordinatorClient(url)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    worker = FederatedWorker(SyncSettings(specialty="docs_expert", worker_id="w1"), client, trainer, spec,
                             encoder=UpdateEncoder(CompressionSettings("topk+int8", {"ratio": 0.1})),
                             pull=PullSettings(codec="fp16", full_every=3))
    worker.joining.join()
    records = []
    for _ in range(5):
        worker.interval.add(trainer.train_steps(1))
        records.append(worker.sync())
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["ratio"] > 10 for r in records)  # topk 10% + int8 of the fp32 delta
    full = records[1]["bytes_down"]  # pulls 2..6: diff, full (3rd), diff, diff, full (6th)
    assert records[0]["bytes_down"] < full * 0.6 and records[2]["bytes_down"] < full * 0.6
    server = client.experts.pull("docs_expert").tensors
    local, residual = trainer.adapter_state(), worker.encoder.state_dict()
    assert worker.encoder.residual_norm() > 0  # topk 10% leaves most of each delta behind ...
    # ... which the worker keeps in its weights (local = pulled + undelivered residual); the last pull was full
    assert all(torch.allclose(local[k], server[k] + residual[k], atol=1e-6) for k in local)
    worker.interval.add(trainer.train_steps(1))
    worker.sync()  # a diff pull: close to the server's weights, within fp16 rounding
    server, local, residual = client.experts.pull("docs_expert").tensors, trainer.adapter_state(), worker.encoder.state_dict()
    assert all(torch.allclose(local[k], server[k] + residual[k], atol=1e-3) for k in local)
    (w,) = client.workers.list()
    # 7 pulls of the worker, and this test's own 2: a pull is counted for the token's worker (docs/identity.md)
    assert w["bytes_up_raw"] > 10 * w["bytes_up"] and w["pulls"] == 7 + 2


def test_ctrl_c_pushes_what_was_trained_then_exits(start_coordinator, tmp_path):
    import signal

    from tests.e2e.conftest import spawn

    _, url = start_coordinator()
    worker = spawn(str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", "sql_expert",
                   "--base-model", "tiny-qwen2", "--duration", "600", "--sync-interval", "600",
                   "--batch-size", "2", "--max-seq-len", "64", "--state-dir", str(tmp_path / "state"))
    worker.wait_for(re.compile(r"held-out loss at start"), timeout=120)
    worker.wait_for(re.compile(r"training: the first \d+ step"), timeout=120)  # trained something
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(timeout=300) == 0, "".join(worker.log)
    info = CoordinatorClient(url).experts.get("sql_expert")
    assert info["version"] == 1 and info["samples_seen"] > 0
    assert "Traceback" not in "".join(worker.log)


def test_generate_and_merged_export_with_the_tiny_base_model(start_coordinator, tmp_path, tiny_base):
    from transformers import AutoModelForCausalLM

    _, url = start_coordinator()
    train, heldout = split_examples(load_examples(sample_dataset_path("sql_expert")))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=2), TrainSettings(lr=1e-2), train)
    from protocol.profiles import profile_to_json, text_profile
    spec = {"lora": trainer.lora_config, "base_model": {"id": "tiny-qwen2", "fingerprint": tiny_base.fingerprint}}
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w1"), CoordinatorClient(url), trainer,
                             spec, profile=profile_to_json(text_profile(e.prompt for e in train), len(train)))
    worker.joining.join()
    worker.interval.add(trainer.train_steps(3))
    worker.sync()

    tool = get_gateway_model.main  # in this process: the tool's own process is tests/cli's
    code, stdout, stderr = run_main(tool, "--coordinator-url", url, "--generate", heldout[0].prompt,
                                    "--max-new-tokens", "8")
    assert code == 0, stderr
    assert "[routed to sql_expert" in stderr and stdout.strip()

    merged = tmp_path / "merged"
    code, _, stderr = run_main(tool, "--coordinator-url", url, "--save-gateway", str(merged), "--format", "merged")
    assert code == 0, stderr
    model = AutoModelForCausalLM.from_pretrained(merged)
    ids = torch.tensor([[1, 2, 3, 4]])
    from gateway.export import merged_copy
    reference = merged_copy(tiny_base.model, client_gateway_tensors(url), CoordinatorClient(url).gateway.info()["lora"])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-4)


def client_gateway_tensors(url: str):
    return loads(CoordinatorClient(url).gateway.weights("safetensors"))


@pytest.mark.parametrize("codec", ["int8", "safetensors"])
def test_a_nan_update_is_dropped_and_the_worker_resyncs(start_coordinator, codec):

    _, url = start_coordinator()
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    base = load_base_model("tiny-qwen2")
    trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(batch_size=2, max_seq_len=64), train)
    client = CoordinatorClient(url)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w1"), client, trainer, spec,
                             encoder=UpdateEncoder(CompressionSettings(codec)))
    worker.joining.join()
    worker.interval.add(trainer.train_steps(1))
    worker.state.reference = {k: torch.full_like(v, float("nan")) for k, v in worker.state.reference.items()}  # diverged
    worker.sync()
    assert client.experts.get("sql_expert")["version"] == 0  # nothing poisoned the expert
    worker.interval.add(trainer.train_steps(1))
    assert worker.sync()["delivered"] and client.experts.get("sql_expert")["version"] == 1  # and it goes on


def test_max_steps_stops_after_exactly_that_many_optimiser_steps_and_pushes_them(start_coordinator):
    _, url = start_coordinator()
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    tiny_base = load_base_model("tiny-qwen2")  # a trainer wraps its base model: not the module's clean one
    trainer = LoraTrainer(tiny_base, LoraSettings(rank=2), TrainSettings(lr=1e-3, batch_size=2, max_seq_len=32), train)
    client = CoordinatorClient(url)
    spec = {"lora": trainer.lora_config, "base_model": {"id": tiny_base.model_id, "fingerprint": tiny_base.fingerprint}}
    # two steps per clock check: the third check must take one step, not two; no sync falls due before the end
    settings = SyncSettings(specialty="sql_expert", worker_id="w1", duration=600, sync_interval=600, max_steps=3,
                            steps_per_check=2)
    worker = FederatedWorker(settings, client, trainer, spec)
    worker.joining.join()
    summary = worker.run()
    assert summary.steps == trainer.global_step == 3
    info = client.experts.get("sql_expert")  # the final push carried all three steps
    assert (info["version"], info["updates_applied"], info["samples_seen"]) == (1, 1, 3 * 2)
    pulled = client.experts.pull("sql_expert").tensors
    local = trainer.adapter_state()
    assert all(torch.allclose(pulled[k], local[k], atol=1e-6) for k in local)


def test_early_stopping_scores_each_pulled_version_and_stops_when_patience_runs_out(start_coordinator, tiny_base,
                                                                                     tmp_path):
    from worker.early_stopping import BestVersion, EarlyStoppingSettings
    from worker.runner import heldout_scorer

    _, url = start_coordinator()
    train, heldout = split_examples(load_examples(sample_dataset_path("sql_expert")))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=32), train)
    client = CoordinatorClient(url)
    spec = {"lora": trainer.lora_config, "base_model": {"id": tiny_base.model_id, "fingerprint": tiny_base.fingerprint}}
    results = tmp_path / "results.jsonl"
    settings = SyncSettings(specialty="sql_expert", worker_id="w1", duration=600, sync_interval=0.2, max_steps=500,
                            results_path=results, overlap=False)
    # a threshold no version can beat: the joined version stays the best, and patience 1 ends the run at the next.
    # Lossless both ways: the scored weights are version 1 exactly, and no int8 residual is left for a final flush
    worker = FederatedWorker(settings, client, trainer, spec, early_stopping=BestVersion(EarlyStoppingSettings(1, 100.0)),
                             heldout_score=heldout_scorer(trainer, heldout),
                             encoder=UpdateEncoder(CompressionSettings(RAW_CODEC)), pull=PullSettings(codec=None))
    worker.joining.join()
    worker.run()
    records = [json.loads(line) for line in results.read_text().splitlines()]
    scored = [r for r in records if "heldout_loss" in r]
    assert worker.pipeline.early_stopped and trainer.global_step < 500
    assert [(r["version"], r["best_version"], r["versions_since_best"]) for r in scored] == [(1, 0, 1)]
    # it stopped right after that sync: the final sync ran, with nothing trained since to push
    assert records[-1]["final"] and "update_id" not in records[-1] and client.experts.get("sql_expert")["version"] == 1
    version_1 = client.experts.pull("sql_expert", version=1).tensors
    expected = adapter_loss(tiny_base, heldout, version_1, trainer.lora_config, max_seq_len=32)
    assert scored[0]["heldout_loss"] == pytest.approx(expected, rel=1e-4)


def test_best_version_counts_versions_since_the_best_against_the_threshold():
    from worker.early_stopping import BestVersion, EarlyStoppingSettings

    best = BestVersion(EarlyStoppingSettings(patience=2, threshold=0.05))
    assert [best.observe(v, loss) for v, loss in [(0, 2.0), (1, 1.9), (2, 1.87), (3, 1.5), (4, 1.6), (5, 1.46)]] == \
        [False, False, False, False, False, True]  # 1.87 and 1.46 improve by less than 0.05: not improvements
    assert (best.version, best.loss, best.since_best) == (3, 1.5, 2)
