"""worker.checkpoint: exact round trips, an optimiser that continues identically, kill-safe swaps."""
import json

import pytest
import torch

from protocol.tensors import dumps, load_file
from worker.checkpoint import (MANIFEST, CheckpointError, CheckpointWriter, WorkerCheckpoint, clone_optimizer_state,
                               discard_checkpoint, flatten_optimizer, load_checkpoint, save_checkpoint,
                               unflatten_optimizer, write_safetensors)

IDENTITY = {"specialty": "sql_expert", "worker_id": "w1", "base_model": {"id": "tiny-qwen2", "fingerprint": "ab12"},
            "lora": {"rank": 2, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}}


def trained_adamw(seed: int = 0, steps: int = 3) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def checkpoint(opt: torch.optim.AdamW, outbox=(), step: int = 7) -> WorkerCheckpoint:
    adapter = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    return WorkerCheckpoint(IDENTITY, {"global_step": step, "data_position": {"epoch": 1, "index": 4}},
                            adapter=adapter, reference={k: v * 2 for k, v in adapter.items()},
                            pulled={k: v * 3 for k, v in adapter.items()}, residual={"a": torch.full((2, 3), 0.5)},
                            optimizer=clone_optimizer_state(opt.state_dict()), outbox=list(outbox))


def test_flattened_optimizer_continues_exactly_like_the_original():
    params, opt = trained_adamw()
    tensors, meta = flatten_optimizer(clone_optimizer_state(opt.state_dict()))  # live tensors otherwise
    assert set(tensors) == {f"state.{i}.{n}" for i in (0, 1) for n in ("step", "exp_avg", "exp_avg_sq")}
    restored_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = torch.optim.AdamW(restored_params, lr=1e-2)
    restored.load_state_dict(unflatten_optimizer(tensors, json.loads(json.dumps(meta))))
    assert restored.param_groups[0]["betas"] == (0.8, 0.95) and restored.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(params, restored_params):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    opt.step()
    restored.step()
    assert all(torch.equal(p, q) for p, q in zip(params, restored_params))


def test_round_trip_keeps_every_tensor_counter_and_outbox_body(tmp_path):
    _, opt = trained_adamw()
    outbox = [(b"\x00first update", {"update_id": "w1-aa", "num_samples": 4}),
              (b"second", {"update_id": "w1-bb", "num_samples": 2})]
    saved = checkpoint(opt, outbox)
    save_checkpoint(tmp_path, saved)
    loaded = load_checkpoint(tmp_path, IDENTITY)
    for name in ("adapter", "reference", "pulled", "residual"):
        a, b = getattr(saved, name), getattr(loaded, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert loaded.progress == saved.progress and loaded.outbox == outbox
    assert torch.equal(loaded.optimizer["state"][1]["exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])
    assert loaded.optimizer["state"][0]["step"] == 3


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint(tmp_path):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt, step=1))
    partial = tmp_path / "ckpt-000001"  # what a kill -9 half way through the next save leaves
    partial.mkdir()
    (partial / "adapter.safetensors").write_bytes(b"trunc")
    assert load_checkpoint(tmp_path, IDENTITY).progress["global_step"] == 1
    save_checkpoint(tmp_path, checkpoint(opt, step=2))  # the next save sweeps the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "ckpt-000001"]
    assert load_checkpoint(tmp_path, IDENTITY).progress["global_step"] == 2


def test_outbox_bodies_already_on_disk_are_linked_not_rewritten(tmp_path):
    _, opt = trained_adamw()
    first = save_checkpoint(tmp_path, checkpoint(opt, [(b"x" * 100, {"update_id": "w1-aa"})]))
    inode = (first / "outbox-0.bin").stat().st_ino
    second = save_checkpoint(tmp_path, checkpoint(opt, [(b"x" * 100, {"update_id": "w1-aa"}),
                                                        (b"y", {"update_id": "w1-bb"})]))
    assert (second / "outbox-0.bin").stat().st_ino == inode and not first.exists()
    assert [body for body, _ in load_checkpoint(tmp_path, IDENTITY).outbox] == [b"x" * 100, b"y"]


def test_another_setups_checkpoint_is_one_clear_error(tmp_path):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt))
    other = {**IDENTITY, "specialty": "docs_expert", "lora": {**IDENTITY["lora"], "rank": 8}}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, other)
    message = str(err.value)
    assert "specialty \"sql_expert\" in the checkpoint, \"docs_expert\" now" in message
    assert "lora.rank 2 in the checkpoint, 8 now" in message and "--fresh" in message
    assert "base_model" not in message  # only what differs


def test_missing_damaged_and_discarded_checkpoints(tmp_path):
    assert load_checkpoint(tmp_path / "nothing", IDENTITY) is None
    _, opt = trained_adamw()
    directory = save_checkpoint(tmp_path, checkpoint(opt, [(b"u", {"update_id": "w1-aa"})]))
    (directory / "optimizer.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="damaged.*--fresh"):
        load_checkpoint(tmp_path, IDENTITY)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path, IDENTITY)
    assert discard_checkpoint(tmp_path) == 0 and list(tmp_path.iterdir()) == []
    save_checkpoint(tmp_path, checkpoint(opt, [(b"u", {"update_id": "w1-aa"})]))
    assert discard_checkpoint(tmp_path) == 1 and load_checkpoint(tmp_path, IDENTITY) is None


def test_a_set_that_is_another_is_an_alias_not_a_second_file(tmp_path):
    _, opt = trained_adamw()
    saved = checkpoint(opt)
    saved.reference = saved.adapter  # a sync point: the next delta is measured from the snapshot
    directory = save_checkpoint(tmp_path, saved)
    assert not (directory / "reference.safetensors").exists()
    assert json.loads((tmp_path / MANIFEST).read_text())["aliases"] == {"reference": "adapter"}
    loaded = load_checkpoint(tmp_path, IDENTITY)
    assert loaded.reference.keys() == saved.adapter.keys()
    assert all(torch.equal(loaded.reference[k], saved.adapter[k]) for k in saved.adapter)


def test_the_writer_links_the_pulled_weights_it_wrote_last_time_and_rewrites_new_ones(tmp_path):
    _, opt = trained_adamw()
    writer = CheckpointWriter(tmp_path)
    first = checkpoint(opt, step=1)
    inode = (writer.save(first) / "pulled.safetensors").stat().st_ino
    second = checkpoint(opt, step=2)
    second.pulled = first.pulled  # no pull in between: the same object
    directory = writer.save(second)
    assert (directory / "pulled.safetensors").stat().st_ino == inode
    assert (directory / "adapter.safetensors").stat().st_ino != inode
    third = checkpoint(opt, step=3)
    third.pulled = {k: v + 1 for k, v in first.pulled.items()}  # a pull brought new weights
    directory = writer.save(third)
    assert (directory / "pulled.safetensors").stat().st_ino != inode
    loaded = load_checkpoint(tmp_path, IDENTITY)
    assert all(torch.equal(loaded.pulled[k], first.pulled[k] + 1) for k in first.pulled)


def test_a_resumed_writer_links_what_it_loaded_and_not_what_another_save_replaced(tmp_path):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt, step=1))
    loaded = load_checkpoint(tmp_path, IDENTITY)
    inode = (tmp_path / "ckpt-000000" / "pulled.safetensors").stat().st_ino
    writer = CheckpointWriter(tmp_path)
    writer.remember(loaded)
    save_checkpoint(tmp_path, checkpoint(opt, step=2))  # someone else saved since: nothing to link from
    after = checkpoint(opt, step=3)
    after.pulled = loaded.pulled
    directory = writer.save(after)
    assert (directory / "pulled.safetensors").stat().st_ino != inode
    writer.remember(loaded := load_checkpoint(tmp_path, IDENTITY))
    inode = (directory / "pulled.safetensors").stat().st_ino
    again = checkpoint(opt, step=4)
    again.pulled = loaded.pulled
    assert (writer.save(again) / "pulled.safetensors").stat().st_ino == inode


def test_tensors_written_from_memory_read_back_exactly_with_safetensors(tmp_path):
    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "step": torch.tensor(7.0),
               "i64": torch.arange(4), "empty": torch.zeros(0, 2), "mask": torch.tensor([True, False]),
               "strided": torch.randn(4, 6)[:, ::2]}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k


def test_a_format_1_checkpoint_is_still_resumed(tmp_path):
    _, opt = trained_adamw()
    saved = checkpoint(opt, [(b"u", {"update_id": "w1-aa"})])
    directory = save_checkpoint(tmp_path, saved)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for name in ("adapter", "reference", "pulled", "residual"):  # format 1: every set its own file, dumps'd
        (directory / f"{name}.safetensors").write_bytes(dumps(getattr(saved, name)))
    del manifest["aliases"]
    manifest["format"] = 1
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    loaded = load_checkpoint(tmp_path, IDENTITY)
    assert all(torch.equal(loaded.reference[k], saved.reference[k]) for k in saved.reference)
    assert loaded.outbox == [(b"u", {"update_id": "w1-aa"})]
    manifest["format"] = 3
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format 1 or 2.*--fresh"):
        load_checkpoint(tmp_path, IDENTITY)


def test_an_alias_to_a_missing_set_is_a_damaged_checkpoint(tmp_path):
    _, opt = trained_adamw()
    save_checkpoint(tmp_path, checkpoint(opt))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["aliases"] = {"reference": "nothing"}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="damaged.*--fresh"):
        load_checkpoint(tmp_path, IDENTITY)
