"""Overlapped syncs and kill -9 resume, against a real coordinator on loopback."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from protocol.client import CoordinatorClient
from protocol.schemas import RAW_CODEC
from protocol.tensors import load_file
from tests import launcher
from tests.e2e.conftest import ROOT, Process, env
from worker.checkpoint import MANIFEST, load_checkpoint
from worker.data import load_examples, sample_dataset_path, split_examples
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

SMALL = ("--base-model", "tiny-qwen2", "--batch-size", "2", "--max-seq-len", "64", "--lora-rank", "2")


def spawn_worker(*args: str) -> Process:
    """run_worker.py with one OpenMP thread: on a loaded 2-core machine more threads only spin."""
    return Process(launcher.popen([sys.executable, *args], cwd=ROOT, env=env() | {"OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


@pytest.fixture(autouse=True)
def single_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_overlapped_syncs_keep_training_made_meanwhile_exactly_once(start_coordinator, tmp_path):
    _, url = start_coordinator("--staleness-decay", "0")  # one worker: the expert is the sum of its deltas
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    base = load_base_model("tiny-qwen2")
    trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64), train)
    client = CoordinatorClient(url)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    settings = SyncSettings(specialty="sql_expert", worker_id="w1", state_dir=tmp_path / "state")
    # lossless both ways (not the int8 defaults): the checks below are exact sums
    worker = FederatedWorker(settings, client, trainer, spec, encoder=UpdateEncoder(CompressionSettings(RAW_CODEC)),
                             pull=PullSettings(codec=None))
    worker.joining.join()
    start = trainer.adapter_state()
    trained = {k: torch.zeros_like(v) for k, v in start.items()}  # what the optimiser steps changed, summed

    def step() -> None:
        before = trainer.adapter_state()
        worker.train_step()
        after = trainer.adapter_state()
        for k in trained:
            trained[k] += after[k] - before[k]

    records = []
    for _ in range(3):
        step()
        step()
        worker.start_sync()
        while (record := worker.poll_sync()) is None:
            step()  # training goes on while the push and pull are in flight
        records.append(record)
    step()
    records.append(worker.sync(final=True))

    assert all(r["steps_during_sync"] >= 1 and r["background_seconds"] > 0 for r in records[:3])
    assert all(r["blocked_seconds"] < r["sync_seconds"] for r in records[:3])
    server = client.experts.pull("sql_expert").tensors
    local = trainer.adapter_state()
    assert all(torch.allclose(server[k], start[k] + trained[k], atol=1e-5) for k in start)  # nothing lost or doubled
    assert all(torch.allclose(server[k], local[k], atol=1e-6) for k in start)
    info = client.experts.get("sql_expert")
    assert info["updates_applied"] == 4 and info["samples_seen"] == worker.totals.samples
    saved = load_checkpoint(tmp_path / "state", worker.pipeline.identity)
    assert saved.progress["syncs"] == 4 and saved.progress["global_step"] == trainer.global_step


def test_a_killed_worker_resumes_from_its_checkpoint_and_nothing_counts_twice(start_coordinator, tmp_path):
    _, url = start_coordinator("--staleness-decay", "0")
    state, results = tmp_path / "state", tmp_path / "results.jsonl"
    args = (str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", "sql_expert", "--worker-id", "w1",
            *SMALL, "--sync-interval", "1", "--state-dir", str(state), "--results", str(results))
    first = spawn_worker(*args, "--duration", "600")
    first.wait_for(re.compile(r"sync 2: \d+ steps"), timeout=120)  # syncs 0 and 1 are checkpointed
    first.proc.kill()  # SIGKILL: no final push, no cleanup
    first.proc.wait(timeout=30)
    manifest = json.loads((state / MANIFEST).read_text())
    at_kill = manifest["progress"]
    queued = {e["meta"]["update_id"]: e["meta"]["num_samples"] for e in manifest["outbox"]}
    before = [json.loads(line) for line in results.read_text().splitlines()]
    assert at_kill["global_step"] > 0 and at_kill["syncs"] >= 2

    second = spawn_worker(*args, "--duration", "3")
    assert second.proc.wait(timeout=120) == 0, "".join(second.log)
    log = "".join(second.log)
    assert "resuming the checkpoint in" in log and "pass --fresh to start over" in log and "Traceback" not in log
    records = [json.loads(line) for line in results.read_text().splitlines()]
    resumed = records[len(before):]
    assert resumed[0]["sync"] == at_kill["syncs"] and resumed[0]["global_step"] > at_kill["global_step"]

    pushed = {r["update_id"]: r["samples"] for r in records if "update_id" in r} | queued
    client = CoordinatorClient(url)
    assert all(client.updates.status(u)["status"] == "applied" for u in pushed)
    info = client.experts.get("sql_expert")
    assert info["updates_applied"] == info["version"] == len(pushed)
    assert info["samples_seen"] == sum(pushed.values())

    final = json.loads((state / MANIFEST).read_text())
    optimizer = load_file(state / final["directory"] / "optimizer.safetensors")
    steps = {int(t) for k, t in optimizer.items() if k.endswith(".step")}
    assert steps == {final["progress"]["global_step"]}  # the optimiser's own count went on from the checkpoint
    assert final["outbox"] == [] or all(e["meta"]["update_id"] in pushed for e in final["outbox"])


def test_a_checkpoint_of_another_setup_is_one_clear_error_until_fresh(tmp_path, capsys):
    import run_worker
    from worker.checkpoint import WorkerCheckpoint, save_checkpoint

    state = tmp_path / "state"
    identity = {"specialty": "sql_expert", "worker_id": "w1", "base_model": {"id": "tiny-qwen2", "fingerprint": "x"},
                "lora": {"rank": 2, "alpha": 16.0, "target_modules": ["q_proj"]}}
    save_checkpoint(state, WorkerCheckpoint(identity, {}, {"a": torch.ones(1)}, {}, {}, {},
                                            {"state": {}, "param_groups": []}, [(b"u", {"update_id": "w1-a"})]))
    args = ["--specialty", "docs_expert", "--worker-id", "w1", *SMALL, "--state-dir", str(state),
            "--coordinator-url", "http://127.0.0.1:9"]  # nothing listens there

    assert run_worker.main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and 'specialty "sql_expert" in the checkpoint, "docs_expert" now' in errors[0]
    assert "base_model.fingerprint" in errors[0] and "--fresh" in errors[0]
    assert (state / MANIFEST).is_file()  # refused, not touched

    assert run_worker.main([*args, "--fresh"]) == 2  # discarded, then on to the (unreachable) coordinator
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot reach the coordinator" in errors[0]
    assert list(state.iterdir()) == []

    (tmp_path / "file").write_text("")
    assert run_worker.main([*args, "--state-dir", str(tmp_path / "file")]) == 2  # the last --state-dir wins
    assert "is a file" in capsys.readouterr().err


@pytest.mark.parametrize("codec", ["safetensors", "topk+int8"])  # topk: a residual is carried, and dropped too
def test_resuming_against_a_coordinator_that_lost_the_expert_counts_nothing_twice(start_coordinator, tmp_path, codec):
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    settings = SyncSettings(specialty="sql_expert", worker_id="w1", state_dir=tmp_path / "state")

    def new_worker(url: str) -> FederatedWorker:
        base = load_base_model("tiny-qwen2")
        trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64), train)
        spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
        # full pulls (not the int8 diff default): the checks below compare weights exactly
        return FederatedWorker(settings, CoordinatorClient(url), trainer, spec,
                               encoder=UpdateEncoder(CompressionSettings(codec, {"ratio": 0.01} if "topk" in codec else {})),
                               pull=PullSettings(codec=None))

    _, old_url = start_coordinator(data_dir=tmp_path / "old")
    first = new_worker(old_url)
    first.joining.join()
    for _ in range(2):
        first.train_step()
        first.sync()  # checkpoint at version 1 holding the update of sync 1 (delivered, as far as it knows)
    trained = first.trainer.adapter_state()

    _, new_url = start_coordinator(data_dir=tmp_path / "new")  # an empty data dir: no expert, no history
    second = new_worker(new_url)
    second.joining.join()
    info = second.client.experts.get("sql_expert")
    assert info["version"] == 0 and info["updates_applied"] == 0 and not second.outbox
    created = second.client.experts.pull("sql_expert").tensors
    assert all(torch.allclose(created[k], trained[k], atol=1e-6) for k in trained)  # from our checkpoint
    local = second.trainer.adapter_state()  # which already holds the residual: not added a second time
    assert second.encoder.residual_norm() == 0 and all(torch.allclose(local[k], created[k]) for k in local)
    assert second.trainer.global_step == first.trainer.global_step and second.base_version == 0


@pytest.mark.parametrize("pull_codec", [None, "fp16"])
def test_a_checkpoint_writes_only_what_a_resume_needs_and_resumes_from_it(start_coordinator, tmp_path, pull_codec):
    _, url = start_coordinator("--staleness-decay", "0")
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    client = CoordinatorClient(url)

    def new_worker() -> tuple[FederatedWorker, LoraTrainer]:
        base = load_base_model("tiny-qwen2")
        trainer = LoraTrainer(base, LoraSettings(rank=2), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64), train)
        spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
        settings = SyncSettings(specialty="sql_expert", worker_id="w1", state_dir=tmp_path / "state", overlap=False)
        # lossless pushes: no error-feedback residual to checkpoint (an int8 worker's is one more file)
        return FederatedWorker(settings, client, trainer, spec, encoder=UpdateEncoder(CompressionSettings(RAW_CODEC)),
                               pull=PullSettings(codec=pull_codec)), trainer

    worker, trainer = new_worker()
    worker.joining.join()
    for _ in range(2):
        worker.train_step()
        worker.sync()
    manifest = json.loads((tmp_path / "state" / MANIFEST).read_text())
    files = sorted(p.name for p in (tmp_path / "state" / manifest["directory"]).iterdir())
    # the reference is the adapter's snapshot: an alias; the pulled weights only with diff pulls
    assert manifest["aliases"] == {"reference": "adapter"}
    assert files == sorted(["adapter.safetensors", "optimizer.safetensors", "outbox-0.bin"]
                           + (["pulled.safetensors"] if pull_codec else []))
    saved = load_checkpoint(tmp_path / "state", worker.pipeline.identity)
    assert all(torch.equal(saved.reference[k], saved.adapter[k]) for k in saved.adapter)
    assert (saved.pulled.keys() == worker.state.pulled.keys()) if pull_codec else saved.pulled == {}

    worker, trainer = new_worker()  # a restart: the same state dir
    worker.joining.join()
    assert trainer.global_step == saved.progress["global_step"] and worker.syncs == 2
    worker.train_step()
    worker.sync(final=True)
    info = client.experts.get("sql_expert")
    assert info["updates_applied"] == 3 and info["samples_seen"] == 3 * 2  # batch 2, one step per update
    tolerance = 1e-3 if pull_codec else 1e-6  # an fp16 diff pull after the restart is off by fp16's rounding
    assert all(torch.allclose(client.experts.pull("sql_expert").tensors[k], v, atol=tolerance)
               for k, v in trainer.adapter_state().items())
