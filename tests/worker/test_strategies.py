"""worker.strategies: --strategy/--cpu-offload flags, auto's choice, and a step under each strategy on two
gloo CPU ranks equal to the single-process step on the same batch (LoRA and full-parameter experts)."""
from __future__ import annotations

import json
import logging
import socket

import pytest
import torch
from safetensors.torch import load_file

from tests.worker import strategy_ranks
from tests.worker.conftest import spawn_ranks
from worker.distributed import DistributedSetupError
from models.loading import load_base_model
from worker.strategies import ParallelSettings, choose_strategy, decoder_layers
from worker.trainer import LoraSettings, LoraTrainer

# fp32: same tolerances as the accumulation tests (two AdamW steps at lr 1e-2 move near-zero-gradient
# elements by up to ~lr on rounding noise alone). bf16 autocast rounds differently on 3-4 row shards, and
# AdamW turns that into moves of up to ~lr per element, so there the first-step gradient carries the check.
# (gradient error / largest gradient, weight error after the two steps). AdamW's first steps move each entry by
# about lr whatever its gradient's size, so an entry whose tiny gradient rounds to the other sign in bf16 (the
# ranks sum in another order than one process) ends up to 2 lr per step away: measured 0.021-0.034 on 0.05% of
# the entries; the bound is 2 lr x 2 steps plus rounding.
TOLERANCES = {"fp32": (1e-4, 1e-3), "bf16": (2e-2, 4 * strategy_ranks.TRAIN.lr + 4e-3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """Every case of strategy_ranks.CASES trained on two spawned ranks; (output dir, rank 0 and 1 reports)."""
    out = tmp_path_factory.mktemp("ranks")
    spawn_ranks(strategy_ranks.main, free_port(), str(out), list(strategy_ranks.CASES))
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def single_process(case: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, first-step gradients, adapter after two steps) of one process on the same batches."""
    lora_rank, _, extra = strategy_ranks.CASES[case]
    settings = strategy_ranks.train_settings({**extra, "grad_accum": 1})
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=lora_rank), settings,
                          strategy_ranks.examples())
    losses = [trainer.train_steps(1).loss]
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    losses.append(trainer.train_steps(1).loss)
    return losses, grads, trainer.adapter_state()


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
@pytest.mark.parametrize("case", list(strategy_ranks.CASES))
def test_a_two_rank_step_equals_the_single_process_step(two_rank_run, case):
    out, reports = two_rank_run
    lora_rank, parallel, extra = strategy_ranks.CASES[case]
    first, second = (r[case] for r in reports)
    assert first["strategy"] == second["strategy"] == parallel.strategy
    assert first["sharded"] == (parallel.strategy != "ddp")
    losses, grads, state = single_process(case)
    grad_tol, weight_tol = TOLERANCES[extra.get("precision", "fp32")]
    assert first["losses"] == second["losses"]  # the ranks agree on the global batch's loss
    assert first["losses"] == pytest.approx(losses, rel=1e-5 if grad_tol < 1e-3 else 1e-3)
    rank_grads = load_file(out / f"{case}-grads.safetensors")
    assert rank_grads.keys() == grads.keys()
    scale = max(float(g.abs().max()) for g in grads.values())
    assert max(float((rank_grads[k] - grads[k]).abs().max()) for k in grads) < grad_tol * scale
    rank_state = load_file(out / f"{case}-state.safetensors")
    assert rank_state.keys() == state.keys()
    diffs = torch.cat([(rank_state[k].float() - state[k].float()).abs().flatten() for k in state])
    assert float(diffs.max()) < weight_tol
    if extra.get("precision") == "bf16":  # nearly every entry agrees; the few that do not moved the other way
        assert float((diffs > strategy_ranks.TRAIN.lr).float().mean()) < 0.01
    assert len(state) == (len(grads) if lora_rank == 0 else 2 * 7 * 2)  # 2 layers x 7 projections x (A, B)


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
@pytest.mark.parametrize("case", list(strategy_ranks.CASES))
def test_rank_zero_weights_reach_every_shard_and_only_rank_zero_holds_the_gathered_adapter(two_rank_run, case):
    _, reports = two_rank_run
    first, second = (r[case] for r in reports)
    assert first["shared_is_rank0_plus_one"] and second["shared_is_rank0_plus_one"]
    assert second["adapter_state_on_rank1"] == ("refused" if first["sharded"] else "ok")


# choosing and refusing ----------------------------------------------------------------------------

@pytest.mark.parametrize("parameters, expected", [
    (494_000_000, "ddp"), (1_500_000_000, "fsdp-grad-op"), (6_999_999_999, "fsdp-grad-op"), (7_600_000_000, "fsdp"),
])
def test_auto_picks_by_parameter_count_and_says_why(parameters, expected, caplog):
    with caplog.at_level(logging.INFO, logger="worker.strategies"):
        assert choose_strategy(ParallelSettings(), parameters, world_size=2) == expected
    assert f"--strategy auto picked {expected}: " in caplog.text and "B parameters" in caplog.text


def test_auto_follows_offload_and_compression_and_one_process_is_unwrapped(caplog):
    assert choose_strategy(ParallelSettings(cpu_offload=True), 10, 2) == "fsdp"
    assert choose_strategy(ParallelSettings(comm_compress="fp16"), 10**10, 2) == "ddp"
    assert choose_strategy(ParallelSettings(strategy="fsdp-grad-op"), 10, 2) == "fsdp-grad-op"
    with caplog.at_level(logging.WARNING, logger="worker.strategies"):
        assert choose_strategy(ParallelSettings(strategy="fsdp"), 10**10, 1) == "single"
    assert "apply across torchrun ranks" in caplog.text


def test_decoder_layers_are_the_shard_groups():
    model = load_base_model("tiny-qwen2").model
    assert [type(m).__name__ for m in decoder_layers(model)] == ["Qwen2DecoderLayer"] * model.config.num_hidden_layers


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "ddp", "--cpu-offload"], "--cpu-offload conflicts with --strategy ddp"),
    (["--strategy", "fsdp", "--comm-compress", "fp16"], "--comm-compress conflicts with --strategy fsdp"),
    (["--strategy", "fsdp-grad-op", "--comm-compress", "int8"], "--comm-compress conflicts with --strategy fsdp-grad-op"),
    (["--cpu-offload", "--comm-compress", "fp16"], "--comm-compress conflicts with --cpu-offload"),
    (["--comm-config", '{"ratio": 0.1}'], "--comm-config given without --comm-compress"),
    (["--comm-compress", "zip"], "--comm-compress zip: unknown codec 'zip'"),
    (["--comm-compress", "topk", "--comm-config", '{"ratio": 2}'], "--comm-compress topk: "),
    (["--comm-compress", "fp16", "--comm-config", '{"ratio": 0.1}'], "--comm-config: --comm-compress fp16 takes no"),
    (["--comm-compress", "powersgd", "--comm-config", '{"rank": 2}'], "--comm-config: unknown PowerSGD option(s)"),
    (["--comm-config", "[1]"], "--comm-config must be a JSON object"),
])
def test_impossible_combinations_exit_2_in_one_line_naming_the_flags(flags, message, capsys):
    import run_worker

    code = run_worker.main(["--specialty", "sql_expert", "--base-model", "tiny-qwen2",
                            "--coordinator-url", "http://127.0.0.1:9", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: " + message), err


def test_run_worker_passes_the_parallel_flags():
    import run_worker

    config = run_worker.build_config(run_worker.parse_args(
        ["--specialty", "sql_expert", "--strategy", "fsdp", "--cpu-offload"]))
    assert config.parallel == ParallelSettings(strategy="fsdp", cpu_offload=True)
    config = run_worker.build_config(run_worker.parse_args(
        ["--specialty", "sql_expert", "--comm-compress", "topk", "--comm-config", '{"ratio": 0.1}']))
    assert (config.parallel.strategy, config.parallel.comm_compress, config.parallel.comm_config) == \
        ("auto", "topk", {"ratio": 0.1})
    assert run_worker.build_config(run_worker.parse_args(["--specialty", "sql_expert"])).parallel == ParallelSettings()
    with pytest.raises(DistributedSetupError, match="--strategy must be one of"):
        ParallelSettings(strategy="zero3")
