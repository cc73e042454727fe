"""Flags built from config dataclasses (protocol.cli.option): one declaration gives the flag, its default,
its help and its parsing, and the scripts' defaults are the library's defaults."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

import get_gateway_model
import run_coordinator
import run_worker
import serve
from coordinator.config import CoordinatorConfig, ServeOptions
from protocol.cli import add_flags, comma_list, flag_values, from_flags, json_object, option
from serving.config import EngineOptions, Limits


@dataclass(frozen=True, kw_only=True)
class Example:
    name: str = option(help="required: no default")
    rate: float = option(0.5, "a rate")
    path: Path | None = option(None, "a file", type=Path)
    verbose: bool = option(False, "say more")
    checks: bool = option(True, "skip the checks", flag="--no-checks")
    settings: dict = option(help="options (default: none)", default_factory=dict, parse=json_object,
                            metavar="JSON", group="advanced")
    modules: tuple[str, ...] = option((), "modules", parse=comma_list, group="advanced")
    internal: int = 7  # no help: not a flag


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example")
    add_flags(p, Example)
    return p


def test_one_field_gives_flag_type_default_and_parsed_value():
    args = parser().parse_args(["--name", "x", "--rate", "2", "--path", "a.txt", "--verbose", "--no-checks",
                                "--settings", '{"k": 1}', "--modules", "q_proj, v_proj,"])
    assert from_flags(Example, args) == Example(name="x", rate=2.0, path=Path("a.txt"), verbose=True, checks=False,
                                                settings={"k": 1}, modules=("q_proj", "v_proj"))
    defaults = from_flags(Example, parser().parse_args(["--name", "x"]))
    assert defaults == Example(name="x") and defaults.settings == {} and defaults.checks is True


def test_help_shows_defaults_groups_and_no_flag_for_fields_without_help():
    text = parser().format_help()
    assert "a rate (default: 0.5)" in text and "--no-checks" in text and "--internal" not in text
    assert "advanced:\n  --settings JSON" in text and "options (default: none)" in text
    assert "(default: None)" not in text and "say more (default" not in text


def test_required_field_and_bad_values_are_argparse_or_named_errors():
    with pytest.raises(SystemExit):
        parser().parse_args([])
    with pytest.raises(SystemExit):
        parser().parse_args(["--name", "x", "--rate", "fast"])
    with pytest.raises(ValueError, match="--settings is not valid JSON"):
        flag_values(Example, parser().parse_args(["--name", "x", "--settings", "{k: 1}"]))


def test_option_refuses_a_flag_without_help():
    with pytest.raises(TypeError, match="help"):
        option(1)


def test_coordinator_flag_defaults_are_the_config_defaults():
    args = run_coordinator.parse_args([])
    assert from_flags(CoordinatorConfig, args) == CoordinatorConfig()
    assert from_flags(ServeOptions, args) == ServeOptions()
    args = run_coordinator.parse_args(["--no-auth", "--gateway-weights", "a=2,b=1", "--port", "0"])
    config = from_flags(CoordinatorConfig, args)
    assert config.auth is False and dict(config.gateway_weights or {}) == {"a": 2.0, "b": 1.0}
    assert from_flags(ServeOptions, args).port == 0


def test_serve_flag_defaults_are_the_config_defaults():
    args = serve.parse_args([])
    assert from_flags(Limits, args) == Limits() and from_flags(EngineOptions, args) == EngineOptions()
    assert serve.parse_args(["--max-batch", "4"]).max_batch == 4
    from serving.server import ServeOptions as ServingOptions

    assert {f.name: f.default for f in fields(serve.ServeFlags) if f.name in ("host", "port", "poll_interval")} == \
        {f.name: f.default for f in fields(ServingOptions) if f.name in ("host", "port", "poll_interval")}


@pytest.mark.slow  # imports the worker's settings (torch)
def test_worker_flag_defaults_are_the_worker_settings_defaults():
    from worker.encoding import CompressionSettings, PullSettings
    from worker.federation import SyncSettings
    from worker.strategies import ParallelSettings
    from worker.trainer import LoraSettings, TrainSettings

    config = run_worker.build_config(run_worker.parse_args(["--specialty", "sql_expert"]))
    assert config.lora == LoraSettings() and config.compression == CompressionSettings()
    assert config.pull == PullSettings() and config.parallel == ParallelSettings()
    assert config.train == TrainSettings(lr=config.train.lr)  # --lr: by preset (models.presets)
    defaults = SyncSettings(specialty="sql_expert", worker_id="w")
    for name in ("duration", "max_steps", "sync_interval", "speed_factor", "resume", "overlap"):
        assert getattr(config.sync, name) == getattr(defaults, name), name
    assert config.device == "auto" and config.heldout_eval and config.profile is None
    from worker.splits import DataSettings

    assert config.data == DataSettings()


def test_workers_push_int8_and_pull_int8_diffs_unless_told_otherwise():
    def codecs(*flags: str) -> tuple[str, str | None]:
        args = run_worker.parse_args(["--specialty", "sql_expert", *flags])
        return args.compression, run_worker.pull_codec(args)

    assert codecs() == ("int8", "int8")
    assert codecs("--compression", "safetensors", "--pull-compression", "full") == ("safetensors", None)
    assert codecs("--pull-compression", "fp16") == ("int8", "fp16")
    # auto picks full weights or a diff at each sync, unless a pull codec is named
    assert codecs("--compression", "auto", "--sync-budget", "2") == ("auto", None)
    assert codecs("--compression", "auto", "--sync-budget", "2", "--pull-compression", "int4") == ("auto", "int4")


def test_gateway_tool_formats_are_the_library_formats():
    from gateway.local import FORMATS

    assert get_gateway_model.FORMATS == FORMATS


def test_a_repeatable_flag_collects_whole_strings():
    """--revoke-worker w9 once revoked worker ['w', '9'] (the list default became argparse's type)."""
    args = get_gateway_model.parse_args(["--revoke-worker", "w9", "--revoke-worker", "w10"])
    assert args.revoke_worker == ["w9", "w10"]
    assert get_gateway_model.parse_args(["--list-experts"]).revoke_worker == []
