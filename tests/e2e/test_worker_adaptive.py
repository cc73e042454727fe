"""Joining an existing expert pulls it; --compression auto against a real coordinator on loopback."""
from __future__ import annotations

import json

import pytest
import torch

from bench.wanemu import DelayProxy
from protocol.client import CoordinatorClient
from protocol.credentials import local_token
from protocol.errors import Conflict
from protocol.tensors import dumps
from worker.adaptive import LinkEstimate
from worker.data import load_examples, sample_dataset_path, split_examples
from worker.encoding import CompressionSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

pytestmark = pytest.mark.e2e


def make_worker(url: str, worker_id: str, seed: int, rank: int = 2, token: str | None = None,
                **kwargs) -> tuple[FederatedWorker, LoraTrainer]:
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    base = load_base_model("tiny-qwen2")
    trainer = LoraTrainer(base, LoraSettings(rank=rank), TrainSettings(lr=1e-2, batch_size=2, max_seq_len=64, seed=seed),
                          train)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id=worker_id),
                             CoordinatorClient(url, token=token),
                             trainer, spec, **kwargs)
    return worker, trainer


def test_a_worker_joining_an_existing_expert_pulls_it_instead_of_uploading_its_adapter(start_coordinator):
    _, url = start_coordinator()
    host, port = url.rsplit("//", 1)[1].split(":")
    token = local_token(url)
    with DelayProxy((host, int(port)), one_way_s=0.0) as proxy:  # counts the bytes each worker sends
        first, first_trainer = make_worker(proxy.url(), "w1", seed=1, token=token)
        first.joining.join()
        adapter = first_trainer.adapter_state()
        creator_sent = proxy.bytes_to_target
        assert creator_sent > len(dumps(adapter))  # the first worker creates the expert from its adapter

        second, second_trainer = make_worker(proxy.url(), "w2", seed=2, token=token)
        assert not all(torch.equal(second_trainer.adapter_state()[k], adapter[k]) for k in adapter)  # other seed
        info = second.joining.join()
        joiner_sent = proxy.bytes_to_target - creator_sent
    assert info["version"] == 0 and second.base_version == 0
    assert all(torch.equal(second_trainer.adapter_state()[k], adapter[k]) for k in adapter)  # pulled the expert
    assert joiner_sent < len(dumps(adapter)) / 4  # requests and headers only, no adapter

    other_rank, _ = make_worker(url, "w3", seed=3, rank=4)
    with pytest.raises(Conflict, match="rank 4 != expert's 2"):  # the setup is still checked
        other_rank.joining.join()


def test_auto_compression_switches_codecs_and_keeps_local_equal_to_the_experts_plus_residual(start_coordinator,
                                                                                             tmp_path):
    _, url = start_coordinator()
    results = tmp_path / "results.jsonl"
    encoder = UpdateEncoder(CompressionSettings("auto", sync_budget=0.5))
    worker, trainer = make_worker(url, "w1", seed=0, encoder=encoder)
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w1", results_path=results),
                             worker.client, trainer, worker.expert_spec, encoder=encoder)
    worker.joining.join()
    # Pretend the first measurements said a 4 kB/s uplink and a 1 kB/s downlink.
    worker.links.up = LinkEstimate(4000.0, observed=1)
    worker.links.down = LinkEstimate(1000.0, observed=1)
    records = []
    for up in (None, 1e9, 30_000.0, 4000.0):  # then a fast uplink, a medium one, a slow one again
        if up is not None:
            worker.links.up = LinkEstimate(up, observed=1)
        worker.interval.add(trainer.train_steps(1))
        records.append(worker.sync())
        assert worker.links.up.observed == 2  # the push was timed into the estimate
    codecs = [r["codec"] for r in records]
    assert codecs == ["randomk+terngrad", "safetensors", "int8", "randomk+terngrad"]
    assert records[0]["push_choice"]["allowed_bytes"] == 2000 and records[0]["bytes_sent"] <= 2000 * 1.1
    assert records[2]["push_choice"]["allowed_bytes"] == 15_000 and records[2]["bytes_sent"] <= 15_000 * 1.1
    # int8 keeps error feedback; an exact push and the random-k rung (an unbiased estimate) send the residual too
    assert records[0]["residual_norm"] == records[1]["residual_norm"] == 0 < records[2]["residual_norm"]
    assert records[3]["residual_norm"] == 0
    assert records[0]["codec_config"]["randomk"]["rescale"] is True  # seeded per worker, one mapping per stage
    assert records[0]["pull_codec"] == "int4"  # full weights at 1 kB/s would overrun 0.5 s: a diff pull
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert [json.loads(line)["codec"] for line in results.read_text().splitlines()] == codecs

    # Error feedback across the switches: after a full pull the local weights are the expert's plus the residual.
    worker.links.up, worker.links.down = LinkEstimate(30_000.0, observed=1), LinkEstimate(1e9, observed=1)
    worker.interval.add(trainer.train_steps(1))
    assert worker.sync()["codec"] == "int8"  # leaves a residual
    server = worker.client.experts.pull("sql_expert").tensors
    local, residual = trainer.adapter_state(), encoder.state_dict()
    assert all(torch.allclose(local[k], server[k] + residual.get(k, 0), atol=1e-6) for k in local)


def test_auto_sizes_its_first_push_from_an_upload_probe_at_join(start_coordinator):
    """Before POST /probe a fresh auto worker started from a 1 Mbit/s guess and grew 2.5x a push: a smollm2-135m
    worker's first 2-5 pushes were random-k. Now join times a probe upload and the first push fits the link."""
    from worker.adaptive import UPLOAD_PROBES, choose_push

    _, url = start_coordinator()
    encoder = UpdateEncoder(CompressionSettings("auto", sync_budget=4.0))
    worker, trainer = make_worker(url, "w1", seed=0, rank=32, token=local_token(url), encoder=encoder)
    worker.joining.join()
    delta = trainer.adapter_state()
    numel = sum(t.numel() for t in delta.values())
    assert 4 * numel < UPLOAD_PROBES[-1]  # loopback: both probes, the large one no larger than the fp32 update
    assert worker.links.up.observed == 1 and worker.links.up.largest == 4 * numel
    guessed = choose_push(numel, len(delta), 4.0, LinkEstimate())  # what the same worker chose without a probe
    assert guessed.choice is not None and guessed.choice.meta["codec"] == "fp16"
    worker.interval.add(trainer.train_steps(1))
    record = worker.sync()
    assert record["codec"] == "safetensors" and record["residual_norm"] == 0  # exact from the first push
    assert record["push_choice"]["allowed_bytes"] > 4 * numel


def test_the_upload_probe_endpoint_reads_at_most_4_mib_and_wants_a_token(start_coordinator):
    import requests

    from protocol.probe import MAX_PROBE_BYTES

    _, url = start_coordinator()
    probe = f"{url}/api/v1/probe"
    auth = {"Authorization": f"Bearer {local_token(url)}"}
    r = requests.post(probe, data=bytes(100_000), headers=auth, timeout=30)
    assert r.status_code == 200 and r.json() == {"bytes": 100_000} and r.headers["Cache-Control"] == "no-store"
    assert requests.post(probe, data=b"x", timeout=30).status_code == 401  # bytes in: not for anyone
    too_big = requests.post(probe, data=bytes(MAX_PROBE_BYTES + 1), headers=auth, timeout=30)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
    chunked = requests.post(probe, data=iter([bytes(1 << 20)] * 5), headers=auth, timeout=30)  # no Content-Length
    assert chunked.status_code == 413 and "at most" in chunked.json()["error"]["message"]
    assert requests.get(probe, params={"bytes": 10}, timeout=30).content == bytes(10)  # the download probe: public
