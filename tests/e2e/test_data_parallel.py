"""A two-process gloo worker on CPU against a real coordinator: one worker seen, ranks in lockstep,
and the pushed update is the single-process update on the same global batches."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from protocol.client import CoordinatorClient
import tests.e2e.data_parallel_rank as rank_script
from tests import launcher
from tests.e2e.conftest import ROOT, env
from worker.data import load_examples, sample_dataset_path, split_examples
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer

RANK_SCRIPT = ROOT / "tests" / "e2e" / "data_parallel_rank.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, port: int) -> dict[str, str]:
    """What torchrun --nproc_per_node 2 sets for one of its ranks."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}


def run_two_ranks(url: str, out, monkeypatch, strategy: str = "ddp") -> None:
    """Rank 1 in a fresh process, rank 0 here (saves one start-up of torch and transformers)."""
    port = free_port()
    other = launcher.popen([sys.executable, str(RANK_SCRIPT), url, str(out), strategy], cwd=ROOT,
                           env={**env(), **rank_environment(1, port), "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threads = torch.get_num_threads()
    try:
        for key, value in rank_environment(0, port).items():
            monkeypatch.setenv(key, value)
        rank_script.main(url, out, strategy)
        output = other.communicate(timeout=300)[0]  # generous: the machine is shared
    finally:
        torch.set_num_threads(threads)
        if other.poll() is None:
            other.kill()
    assert other.returncode == 0, output[-4000:]


def single_process_run():
    """What one process does on the same data: (adapter after 2 steps, first-step gradients)."""
    train, _ = split_examples(load_examples(sample_dataset_path(rank_script.SPECIALTY)))
    settings = rank_script.TRAIN.__class__(**{**rank_script.TRAIN.__dict__, "grad_accum": 1})
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(), settings, train)
    initial = trainer.adapter_state()
    trainer.train_steps(1)
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train_steps(1)
    return initial, trainer.adapter_state(), grads


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gloo_ranks_act_as_one_worker_and_push_the_single_process_update(start_coordinator, tmp_path,
                                                                            monkeypatch, strategy):
    _, url = start_coordinator()
    run_two_ranks(url, tmp_path, monkeypatch, strategy)

    for stage in ("join", "sync0", "sync1"):  # DDP plus the broadcast after each sync keep the ranks identical
        first, second = (load_file(tmp_path / f"rank{r}-{stage}.safetensors") for r in range(2))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), stage

    client = CoordinatorClient(url)
    assert [w["worker_id"] for w in client.workers.list()] == ["dp-worker"]
    expert = client.experts.get("sql_expert")
    assert expert["version"] == 2 and expert["samples_seen"] == 2 * 2 * 7  # global batches, counted once

    initial, single, single_grads = single_process_run()
    v0, v1 = (client.experts.pull("sql_expert", version=v).tensors for v in (0, 1))
    assert all(torch.equal(v0[k], initial[k]) for k in initial)
    pushed = {k: v1[k] - v0[k] for k in v0}
    expected = {k: single[k] - initial[k] for k in initial}
    assert max(float(v.abs().max()) for v in expected.values()) > 1e-2  # the update is not trivially zero
    # Two AdamW steps: elements with a ~0 gradient move by up to ~lr on rounding noise, hence the loose bound.
    assert max(float((pushed[k] - expected[k]).abs().max()) for k in pushed) < 1e-3
    grads = load_file(tmp_path / "rank0-grads.safetensors")
    scale = max(float(g.abs().max()) for g in single_grads.values())
    assert max(float((grads[k] - single_grads[k]).abs().max()) for k in grads) < 1e-4 * scale
