"""worker.deepspeed_config: a DeepSpeed JSON mapped onto --strategy, --cpu-offload and the training flags."""
from __future__ import annotations

import json
import math

import pytest

from worker.deepspeed_config import map_deepspeed_config
from worker.strategies import ParallelSettings

ZERO3_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
    "bf16": {"enabled": True}, "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu"}, "overlap_comm": True, "reduce_bucket_size": 5e8},
}


def test_zero3_with_offload_maps_onto_fsdp_with_cpu_offload():
    plan = map_deepspeed_config(ZERO3_OFFLOAD, world_size=2)
    assert plan.parallel == ParallelSettings(strategy="fsdp", cpu_offload=True)
    assert plan.train == {"precision": "bf16", "grad_accum": 4, "batch_size": 2 * 4 * 2, "max_grad_norm": 0.5}


@pytest.mark.parametrize("stage, strategy", [(0, "ddp"), (1, "fsdp-grad-op"), (2, "fsdp-grad-op"), (3, "fsdp")])
def test_zero_stages(stage, strategy):
    plan = map_deepspeed_config({"zero_optimization": {"stage": stage}, "fp16": {"enabled": True},
                                 "gradient_clipping": 0}, world_size=1)
    assert plan.parallel.strategy == strategy and not plan.parallel.cpu_offload
    assert plan.train == {"precision": "fp16", "max_grad_norm": math.inf}  # DeepSpeed's 0 means no clipping


def test_auto_values_leave_the_flags_alone():
    plan = map_deepspeed_config({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                 "fp16": {"enabled": "auto"}, "gradient_clipping": "auto"}, world_size=4)
    assert plan.train == {} and plan.parallel.strategy == "ddp"
    assert map_deepspeed_config({"train_batch_size": 32}, 4).train == {"batch_size": 32}


@pytest.mark.parametrize("config, message", [
    ({"optimizer": {"type": "AdamW"}, "scheduler": {}}, "--deepspeed: unsupported key(s) optimizer, scheduler; "),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization: unsupported key(s) cpu_offload"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.device 'nvme'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs zero_optimization"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload_optimizer needs zero_optimization"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16: unsupported key(s) loss_scale"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 10},
     "train_batch_size 10 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 2 x 2 rank(s)"),
    ({"gradient_clipping": -1}, "gradient_clipping must be a number >= 0"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a positive integer"),
])
def test_unsupported_or_inconsistent_configs_are_refused_naming_the_key(config, message):
    with pytest.raises(ValueError) as err:
        map_deepspeed_config(config, world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


def run(argv, capsys):
    import run_worker

    code = run_worker.main(["--specialty", "sql_expert", "--coordinator-url", "http://127.0.0.1:9", *argv])
    return code, capsys.readouterr().err


def test_run_worker_maps_the_file_and_refuses_flags_that_set_the_same_thing(tmp_path, capsys, monkeypatch):
    import run_worker

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_OFFLOAD))
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = run_worker.build_config(run_worker.parse_args(["--specialty", "sql_expert", "--deepspeed", str(path)]))
    assert config.parallel == ParallelSettings(strategy="fsdp", cpu_offload=True)
    assert (config.train.batch_size, config.train.grad_accum, config.train.precision, config.train.max_grad_norm) == \
        (16, 4, "bf16", 0.5)
    code, err = run(["--deepspeed", str(path), "--strategy", "ddp", "--grad-accum", "2"], capsys)
    assert code == 2 and "error: --deepspeed conflicts with --strategy, --grad-accum (the config sets that)" in err
    code, err = run(["--deepspeed", str(path), "--comm-compress", "fp16"], capsys)
    assert code == 2 and "error: --comm-compress conflicts with --strategy fsdp" in err
    code, err = run(["--deepspeed", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    path.write_text("{not json")
    code, err = run(["--deepspeed", str(path)], capsys)
    assert code == 2 and "is not a readable JSON file" in err
