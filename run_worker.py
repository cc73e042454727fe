#!/usr/bin/env python3
"""Run a FedMoE worker: fine-tune one expert on local data, syncing with the coordinator.

Examples:
  python run_worker.py --specialty python_expert
  python run_worker.py --specialty sql_expert --base-model tiny-qwen2 --duration 120 --sync-interval 5
  python run_worker.py --specialty docs_expert --dataset my_docs.jsonl --coordinator-url http://10.0.0.5:5000
  python run_worker.py --specialty sql_expert --compression randomk+terngrad --no-error-feedback \
      --compression-config '{"ratio": 0.1, "rescale": true}'   # ~143x; +0.15% loss on smollm2 (docs/benchmarks.md)
  python run_worker.py --specialty sql_expert --compression auto --sync-budget 2   # fit each push in ~2 s
  python run_worker.py --specialty sql_expert --compression safetensors --pull-compression full   # lossless both ways
  python run_worker.py --specialty python_expert --results runs/python.results.jsonl --log-format json
  torchrun --nproc_per_node 2 run_worker.py --specialty sql_expert --base-model tiny-qwen2   # data parallel
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.cli import add_common_flags, add_flags, check_coordinator_url, option, report_error, setup_logging
from protocol.errors import FedMoEError

# torch, transformers and peft take seconds to import: the worker modules that need them are imported
# once the flags are parsed, so --help and a mistyped flag answer at once (tests/cli/test_cli.py).
from worker.choices import (DATASET_FORMATS, DEFAULT_CODEC, DEFAULT_PULL_CODEC, FULL_PULL, OPTIMIZERS,
                            STRATEGY_CHOICES, check_sync_budget, default_pull_codec)
from worker.stopping import Handler, restore, stop_on_signals

if TYPE_CHECKING:
    from worker.profiling import ProfileSettings
    from worker.runner import WorkerConfig
    from worker.strategies import ParallelSettings

DEFAULT_BASE_MODEL = "qwen/Qwen2-0.5B-Instruct"


CHECKPOINT, COMPRESSION, TRAINING = "checkpoint and sync", "compression", "training"
PLACEMENT = "placement over a WAN (docs/wan.md)"
CHECKPOINTING_CHOICES = {"auto": None, "on": True, "off": False}
"""--gradient-checkpointing -> TrainSettings.gradient_checkpointing (None: decided from the model and batch size)."""
PRIVACY = "privacy (docs/privacy.md)"
PARALLEL = "inside a worker (torchrun ranks; docs/bigger-workers.md)"


@dataclass(frozen=True, kw_only=True)
class WorkerFlags:
    """run_worker.py's flags, one field each (protocol.cli.option); build_config maps them onto WorkerConfig.

    The worker's settings classes import torch, so they cannot feed --help; tests/cli checks that each
    default here is the default of the setting it fills."""

    coordinator_url: str = option("http://127.0.0.1:5000", "coordinator address, or a comma list of relays and the "
                                                           "root: the worker probes them and joins the best")
    worker_id: str | None = option(None, "unique worker name (default: <hostname>-<specialty>)")
    specialty: str = option(help="expert to train, e.g. python_expert")
    dataset: Path | None = option(None, "training data: a JSONL, JSON, CSV, Parquet or Arrow file, or a save_to_disk "
                                        "directory, in any --dataset-format (default: data/<specialty>.jsonl if "
                                        "shipped)", type=Path)
    dataset_format: str = option("auto", "how the rows are laid out: prompt-reference (prompt, reference_code), "
                                         "prompt-completion, messages (OpenAI chat), alpaca, sharegpt, text (plain, "
                                         "packed); auto detects it from the first rows", choices=DATASET_FORMATS)
    split_key: str | None = option(None, "hold out whole groups of rows that share this field's value, e.g. DS-1000's "
                                         "perturbation_origin_id, so variants of one problem never straddle the split",
                                   metavar="FIELD")
    eval_dataset: Path | None = option(None, "score held-out loss on this file instead of a split of --dataset (all of "
                                             "--dataset then trains)", type=Path, metavar="FILE")
    base_model: str = option(DEFAULT_BASE_MODEL, "ModelScope id, Hugging Face id (with --use-huggingface), local "
                                                 "directory, or the offline preset tiny-qwen2")
    use_huggingface: bool = option(False, "download --base-model from Hugging Face")
    speed_factor: float = option(1.0, "relative speed in (0, 1]; 0.5 simulates a machine half as fast")
    duration: float = option(3600.0, "seconds to train")
    max_steps: int | None = option(None, "optimiser steps to train (a resumed run counts the steps it resumed "
                                         "with); the run ends after N steps or --duration, whichever comes first, "
                                         "with the final push", type=int, metavar="N")
    sync_interval: float = option(10.0, "seconds between syncs")
    comm_share: float | None = option(None, "stretch the interval between syncs so that pushing and pulling take at "
                                            "most this share of the worker's time, e.g. 0.25 on a slow link "
                                            "(never below --sync-interval; default: sync every --sync-interval)",
                                      type=float, metavar="SHARE")
    use_proxy: bool = option(False, "honour HTTP(S)_PROXY for coordinator and hub")
    token: str | None = option(None, "the coordinator's join token (default: $FEDMOE_TOKEN, or found automatically "
                                     "when the coordinator runs on this machine)")
    ca_cert: Path | None = option(None, "PEM certificate (or CA) to trust for an https:// coordinator with a "
                                        "private certificate", type=Path)
    state_dir: Path | None = option(None, "checkpoint at every sync here and resume from it on restart "
                                          "(default: worker-state/<worker-id>)", type=Path, group=CHECKPOINT)
    fresh: bool = option(False, "discard the checkpoint in --state-dir and start over", group=CHECKPOINT)
    no_overlap: bool = option(False, "pause training during each push and pull (default: sync in the background)",
                              group=CHECKPOINT)
    secure_aggregation: bool = option(False, "push only masked, through secure-aggregation cohorts: the coordinator "
                                             "(started with --secure-aggregation) learns only each cohort's sum "
                                             "(docs/secure-aggregation.md); composes with dense codecs only",
                                      group=COMPRESSION)
    compression: str = option(DEFAULT_CODEC, "update codec: int8 (blockwise, ~3.8x smaller, with error feedback), "
                                              "safetensors (lossless, uncompressed), another compression spec "
                                              "such as topk+int8, or auto (picked at each sync to fit "
                                              "--sync-budget)", group=COMPRESSION)
    follow_placement: bool = option(False, "report link measurements to the root (--coordinator-url) and sync with the "
                                           "relay it assigns (the root groups workers by their links)",
                                    group=PLACEMENT)
    placement_interval: float = option(30.0, "with --follow-placement: seconds between two rounds of probes",
                                       metavar="SECONDS", group=PLACEMENT)
    can_relay: bool = option(False, "also run a relay the root may assign nearby workers to (implies "
                                    "--follow-placement; needs the relay join token)", group=PLACEMENT)
    relay_host: str | None = option(None, "with --can-relay: the address other workers reach this machine at "
                                          "(default: the one it reaches the root from)", group=PLACEMENT)
    relay_join_token_file: Path | None = option(None, "with --can-relay: file holding the root's relay join token "
                                                      "(default: $FEDMOE_RELAY_JOIN_TOKEN)", type=Path,
                                                group=PLACEMENT)
    relay_flags: str = option("", "with --can-relay: run_coordinator.py flags of the relay, e.g. "
                                  "'--forward-compression int8 --site-model'", metavar="FLAGS", group=PLACEMENT)
    sync_budget: float | None = option(None, "with --compression auto: seconds a push (and a pull) may take; the "
                                             "codec and ratio are picked from the measured throughput, and pulls "
                                             "become compressed diffs when full weights would take longer",
                                       type=float, metavar="SECONDS", group=COMPRESSION)
    compression_config: str = option("{}", 'codec options, e.g. \'{"ratio": 0.01}\'', metavar="JSON",
                                      group=COMPRESSION)
    no_error_feedback: bool = option(False, "drop what a lossy codec loses", group=COMPRESSION)
    pull_compression: str | None = option(None, f"pull only the compressed difference since our version with this "
                                                f"codec, or {FULL_PULL} for the full weights every time (default: "
                                                f"{DEFAULT_PULL_CODEC}; with --compression auto, full weights or a "
                                                "diff picked at each sync)", metavar="CODEC", group=COMPRESSION)
    pull_compression_config: str = option("{}", "options of --pull-compression", metavar="JSON", group=COMPRESSION)
    full_pull_every: int = option(10, "with diff pulls (the default), every N-th pull is a full one, so lossy diffs "
                                      "cannot drift far", group=COMPRESSION)
    lora_rank: int = option(8, "LoRA rank; 0 trains every weight (a full-parameter expert)", group=TRAINING)
    lora_alpha: float = option(16.0, "LoRA alpha", group=TRAINING)
    target_modules: str | None = option(None, "comma-separated module names (default: all attention and MLP "
                                              "projections)", group=TRAINING)
    lr: float | None = option(None, "AdamW learning rate (default: 2e-4; 1e-2 for the random tiny-qwen2 preset)",
                              type=float, group=TRAINING)
    optimizer: str = option("adamw", "adamw, or galore: Adam on a low-rank projection of each weight matrix's "
                                     "gradient (GaLore), for full-parameter experts (--lora-rank 0)",
                            choices=OPTIMIZERS, group=TRAINING)
    galore_rank: int = option(128, "--optimizer galore: rank of the gradient projection", metavar="R",
                              group=TRAINING)
    galore_update_interval: int = option(200, "--optimizer galore: steps between two SVDs of the gradient",
                                         metavar="STEPS", group=TRAINING)
    galore_scale: float = option(0.25, "--optimizer galore: scale of the projected-back update", group=TRAINING)
    batch_size: int = option(8, "examples per step", group=TRAINING)
    max_seq_len: int = option(256, "tokens per example", group=TRAINING)
    seed: int = option(0, "seed for init and shuffling", group=TRAINING)
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda or mps; under torchrun each rank takes its own "
                                 "GPU", group=TRAINING)
    precision: str = option("fp32", "autocast precision of the forward pass; fp16 adds a gradient scaler",
                            choices=("fp32", "bf16", "fp16"), group=TRAINING)
    grad_accum: int = option(1, "split each step's --batch-size examples into N micro-batches", metavar="N",
                             group=TRAINING)
    gradient_checkpointing: str = option("auto", "recompute each layer's activations in the backward pass: less "
                                                 "memory, ~25%% more compute; auto turns it on when a batch's "
                                                 "activations would pass 512 MiB (smollm2-135m at the default "
                                                 "batch); the bare flag means on", choices=CHECKPOINTING_CHOICES,
                                          nargs="?", const="on", group=TRAINING)
    threads: int | None = option(None, "CPU threads torch may use; give each of several workers on one machine its "
                                       "share of the cores (default: all cores)", type=int, metavar="N",
                                 group=TRAINING)
    no_heldout_eval: bool = option(False, "skip the held-out loss logged before and after training (on a large "
                                          "model it takes two forward passes over the held-out examples)",
                                   group=TRAINING)
    early_stopping_patience: int | None = option(
        None, "score every pulled expert version on the held-out split and stop (with the final push) after N "
              "versions in a row that did not improve on the best (Trainer's EarlyStoppingCallback); default: off",
        type=int, metavar="N", group=TRAINING)
    early_stopping_threshold: float = option(0.0, "with --early-stopping-patience: the least drop in held-out loss "
                                                  "that counts as an improvement", group=TRAINING)
    results: Path | None = option(None, "append one JSON line per sync to this file", type=Path, group=TRAINING)
    dp_sgd: str | None = option(None, "train with example-level DP-SGD (Opacus, LoRA parameters only): Poisson "
                                      "batches of expected --batch-size, each example's gradient clipped to "
                                      "MAX_GRAD_NORM, Gaussian noise of NOISE_MULTIPLIER x MAX_GRAD_NORM; the "
                                      "epsilon spent goes into --results and with every pushed update",
                                metavar="NOISE_MULTIPLIER,MAX_GRAD_NORM", group=PRIVACY)
    dp_delta: float = option(1e-5, "delta of the (epsilon, delta) --dp-sgd reports; keep it well below 1 / "
                                   "training examples", group=PRIVACY)
    min_dp_noise: float | None = option(None, "push only if the coordinator announces worker-level DP noise "
                                              "(its --dp-noise) of at least this multiplier for the expert, and "
                                              "with --secure-aggregation for each cohort; otherwise stop at joining "
                                              "(or keep updates queued) with nothing from the data sent",
                                        type=float, metavar="SIGMA", group=PRIVACY)
    strategy: str = option("auto", "ddp replicates the model; fsdp shards parameters, gradients and optimiser state "
                                   "(ZeRO-3-like); fsdp-grad-op shards gradients and optimiser state (ZeRO-2-like); "
                                   "auto picks by parameter count", choices=STRATEGY_CHOICES, group=PARALLEL)
    cpu_offload: bool = option(False, "keep FSDP shards and optimiser state in CPU memory", group=PARALLEL)
    comm_compress: str | None = option(None, "compress DDP's gradient all-reduce: fp16, bf16, powersgd, or a codec "
                                             "such as int8, topk", metavar="CODEC", group=PARALLEL)
    comm_config: str = option("{}", 'options of --comm-compress, e.g. \'{"ratio": 0.01}\'', metavar="JSON",
                              group=PARALLEL)
    deepspeed: Path | None = option(None, "a DeepSpeed config (ZeRO stage, offload, fp16/bf16, clipping, batch "
                                          "sizes) mapped onto --strategy, --cpu-offload, --precision, --batch-size "
                                          "and --grad-accum", type=Path, metavar="JSON", group=PARALLEL)
    profile: Path | None = option(None, "profile --profile-steps steps; each rank writes a torch.profiler trace and "
                                        "summary here", type=Path, metavar="DIR", group=PARALLEL)
    profile_steps: int = option(3, "steps to profile", metavar="N", group=PARALLEL)
    tensorboard: Path | None = option(None, "write per-step and per-sync scalars (loss, tokens/s, bytes, ratio) for "
                                            "TensorBoard here", type=Path, metavar="DIR", group=PARALLEL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, WorkerFlags)
    add_common_flags(p)
    return p.parse_args(argv)


def profile_settings(args: argparse.Namespace) -> ProfileSettings | None:
    if args.profile is None:
        if args.profile_steps != 3:
            raise ValueError("--profile-steps given without --profile DIR")
        return None
    from worker.profiling import ProfileSettings

    return ProfileSettings(directory=args.profile, steps=args.profile_steps)


def tensorboard_dir(args: argparse.Namespace) -> Path | None:
    if args.tensorboard is not None:
        from worker.tensorboard_log import check_tensorboard

        check_tensorboard()
    return args.tensorboard


def parallel_settings(args: argparse.Namespace, deepspeed=None) -> ParallelSettings:
    from protocol.schemas import parse_json_flag
    from worker.strategies import ParallelSettings

    strategy, offload = (args.strategy, args.cpu_offload) if deepspeed is None else \
        (deepspeed.parallel.strategy, deepspeed.parallel.cpu_offload)
    return ParallelSettings(strategy=strategy, cpu_offload=offload, comm_compress=args.comm_compress,
                            comm_config=parse_json_flag(args.comm_config, "--comm-config"))


# flag -> (its TrainSettings field, its default): --deepspeed refuses a flag that sets the same thing.
DEEPSPEED_OVERLAPS = {flag: (name, WorkerFlags.__dataclass_fields__[name].default)
                      for flag, name in (("--batch-size", "batch_size"), ("--grad-accum", "grad_accum"),
                                         ("--precision", "precision"))}


def deepspeed_plan(args: argparse.Namespace):
    """The mapped --deepspeed config, or None; refuses flags that would set the same thing twice."""
    if args.deepspeed is None:
        return None
    from worker.deepspeed_config import load_deepspeed_config

    plan = load_deepspeed_config(args.deepspeed, int(os.environ.get("WORLD_SIZE", "1")))
    given = [flag for flag, on in (("--strategy", args.strategy != "auto"), ("--cpu-offload", args.cpu_offload))
             if on]
    given += [flag for flag, (name, default) in DEEPSPEED_OVERLAPS.items()
              if name in plan.train and getattr(args, name) != default]
    if given:
        raise ValueError(f"--deepspeed conflicts with {', '.join(given)} (the config sets that); drop one of them")
    return plan


GALORE_FLAGS = ("galore_rank", "galore_update_interval", "galore_scale")


def optimizer_settings(args: argparse.Namespace):
    """--optimizer and its --galore-* settings; a --galore-* flag without --optimizer galore is refused."""
    from worker.galore import GaLoreSettings
    from worker.optimizers import OptimizerSettings

    given = [f"--{name.replace('_', '-')}" for name in GALORE_FLAGS
             if getattr(args, name) != WorkerFlags.__dataclass_fields__[name].default]
    if given and args.optimizer != "galore":
        raise ValueError(f"{', '.join(given)} set(s) GaLore, which --optimizer {args.optimizer} does not use; "
                         "add --optimizer galore or drop them")
    return OptimizerSettings(args.optimizer, GaLoreSettings(rank=args.galore_rank, scale=args.galore_scale,
                                                            update_interval=args.galore_update_interval))


def early_stopping(args: argparse.Namespace):
    """--early-stopping-patience's settings, or None when it is off."""
    from worker.early_stopping import EarlyStoppingSettings

    if args.early_stopping_patience is None:
        if args.early_stopping_threshold != 0.0:
            raise ValueError("--early-stopping-threshold given without --early-stopping-patience N")
        return None
    return EarlyStoppingSettings(args.early_stopping_patience, args.early_stopping_threshold)


def _check_secure_codec(codec: str) -> None:
    """--secure-aggregation masks every coordinate: a sparsifying codec (or auto, which picks one) is refused."""
    from privacy.secagg.compat import check_codec
    from privacy.secagg.errors import BadSecAggMessage

    if codec == "auto":
        raise ValueError("--secure-aggregation composes with dense codecs only, not --compression auto "
                         "(it picks sparsifiers); pick safetensors, fp16 or int8")
    if codec != "safetensors":
        try:
            check_codec(codec)
        except BadSecAggMessage as exc:
            raise ValueError(exc.message) from None


def default_worker_id(specialty: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "worker"
    return f"{host}-{specialty}"[:64]


def default_state_dir(worker_id: str) -> Path:
    """worker-state/<worker id>: stable for a stable --worker-id, so a plain restart resumes."""
    return Path("worker-state") / re.sub(r"[^A-Za-z0-9_.-]", "-", worker_id)


def build_config(args: argparse.Namespace) -> WorkerConfig:
    from protocol.schemas import parse_json_flag
    from worker.data import sample_dataset_path
    from worker.encoding import CompressionSettings, PullSettings
    from worker.federation import SyncSettings
    from models.presets import RECOMMENDED_LR
    from worker.runner import WorkerConfig
    from worker.splits import DataSettings
    from worker.trainer import LoraSettings, TrainSettings

    _check_names(args)
    _check_address_and_files(args)
    dataset = args.dataset or sample_dataset_path(args.specialty)
    if dataset is None:
        raise ValueError(f"no --dataset given and the project ships no sample data for {args.specialty!r}; "
                         "pass --dataset PATH.jsonl")
    modules = tuple(m.strip() for m in args.target_modules.split(",") if m.strip()) if args.target_modules else ()
    deepspeed = deepspeed_plan(args)
    train_kwargs = {"batch_size": args.batch_size, "max_seq_len": args.max_seq_len, "seed": args.seed,
                    "grad_accum": args.grad_accum, "precision": args.precision,
                    "gradient_checkpointing": CHECKPOINTING_CHOICES[args.gradient_checkpointing]}
    train_kwargs["optimizer"] = optimizer_settings(args)
    train_kwargs.update(deepspeed.train if deepspeed is not None else {})
    lr = args.lr if args.lr is not None else RECOMMENDED_LR.get(args.base_model)
    if lr is not None:
        train_kwargs["lr"] = lr
    compression = CompressionSettings(codec=args.compression, config=parse_json_flag(args.compression_config,
                                                                                "--compression-config"),
                                      error_feedback=not args.no_error_feedback, sync_budget=args.sync_budget)
    if args.secure_aggregation:
        _check_secure_codec(args.compression)
    pull = PullSettings(codec=pull_codec(args), full_every=args.full_pull_every,
                        config=parse_json_flag(args.pull_compression_config, "--pull-compression-config"))
    worker_id = args.worker_id or default_worker_id(args.specialty)
    lora = LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=modules)
    train = TrainSettings(**train_kwargs)
    return WorkerConfig(
        coordinator_url=args.coordinator_url, dataset=Path(dataset), base_model=args.base_model,
        sync=SyncSettings(specialty=args.specialty, worker_id=worker_id,
                          duration=args.duration, max_steps=args.max_steps, sync_interval=args.sync_interval,
                          speed_factor=args.speed_factor, results_path=args.results,
                          state_dir=args.state_dir or default_state_dir(worker_id), resume=not args.fresh,
                          overlap=not args.no_overlap, secure_aggregation=args.secure_aggregation,
                          comm_share=args.comm_share, min_dp_noise=args.min_dp_noise),
        lora=lora, train=train, dp_sgd=dp_sgd_settings(args, lora, train), use_huggingface=args.use_huggingface,
        use_proxy=args.use_proxy, device=args.device, compression=compression, pull=pull, token=args.token,
        ca_cert=args.ca_cert, progress=False if args.log_format == "json" else None, threads=args.threads,
        heldout_eval=not args.no_heldout_eval, early_stopping=early_stopping(args),
        parallel=parallel_settings(args, deepspeed),
        data=DataSettings(dataset_format=args.dataset_format, split_key=args.split_key,
                          eval_dataset=args.eval_dataset),
        profile=profile_settings(args), tensorboard=tensorboard_dir(args), placement=placement_settings(args, worker_id))


def placement_settings(args: argparse.Namespace, worker_id: str):
    """--follow-placement and --can-relay's settings, or None when the worker syncs where --coordinator-url says."""
    from worker.runner import PlacementSettings

    if not (args.follow_placement or args.can_relay):
        for flag in ("relay_host", "relay_join_token_file", "relay_flags"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} applies to --can-relay only; add it or drop the flag")
        return None
    if "," in args.coordinator_url:
        raise ValueError("--follow-placement takes the root's URL alone in --coordinator-url (the root assigns the "
                         f"relays), got {args.coordinator_url!r}")
    if not 1 <= args.placement_interval <= 86_400:
        raise ValueError(f"--placement-interval must be 1-86400 seconds, got {args.placement_interval}")
    return PlacementSettings(interval=args.placement_interval, can_relay=args.can_relay, relay_host=args.relay_host,
                             relay_join_token_file=args.relay_join_token_file,
                             relay_id=f"{worker_id}-relay", relay_flags=tuple(shlex.split(args.relay_flags)))


def pull_codec(args: argparse.Namespace) -> str | None:
    """PullSettings.codec of --pull-compression: None (full weights) for full, and by default under
    --compression auto (which then picks full weights or a diff at each sync); else the codec, int8 by default."""
    if args.pull_compression == FULL_PULL:
        return None
    return args.pull_compression or default_pull_codec(args.compression)


def dp_sgd_settings(args: argparse.Namespace, lora, train):
    """--dp-sgd's settings, or None; ValueError (naming the flag) for a value or a combination it cannot take."""
    if args.dp_sgd is None:
        if args.dp_delta != WorkerFlags.__dataclass_fields__["dp_delta"].default:
            raise ValueError("--dp-delta applies to --dp-sgd only; pass --dp-sgd NOISE_MULTIPLIER,MAX_GRAD_NORM")
        return None
    from worker.dp_sgd import DPSGDSettings, check_dp_sgd_settings  # imports Opacus

    check_dp_sgd_settings(lora, train, int(os.environ.get("WORLD_SIZE", "1")))
    return DPSGDSettings.parse(args.dp_sgd, args.dp_delta)


def _check_address_and_files(args: argparse.Namespace) -> None:
    """The checks that need no worker module: main() runs them before importing torch, so they answer at once."""
    check_coordinator_url(args.coordinator_url)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be at least 1, got {args.max_steps}")
    for flag, path in (("--dataset", args.dataset), ("--eval-dataset", args.eval_dataset)):
        if path is not None and (not path.exists() or path.is_dir() and not any(path.iterdir())):
            what = "is an empty directory" if path.exists() else "does not exist"
            raise ValueError(f"{flag} {str(path)!r} {what}; pass a dataset file (JSONL, JSON, CSV, Parquet) or a "
                             "directory written by save_to_disk")
    if args.results is not None:
        _check_results_path(args.results)
    if args.ca_cert is not None and not args.ca_cert.is_file():
        raise ValueError(f"--ca-cert {str(args.ca_cert)!r} does not exist")
    check_sync_budget(args.compression, args.sync_budget)  # worker.encoding checks the same rules
    if args.comm_share is not None and not 0 < args.comm_share < 1:
        raise ValueError(f"--comm-share must be a share of the worker's time in (0, 1), got {args.comm_share}")
    if args.min_dp_noise is not None and not (math.isfinite(args.min_dp_noise) and args.min_dp_noise > 0):
        raise ValueError(f"--min-dp-noise must be a positive noise multiplier (e.g. 1.0), got {args.min_dp_noise}")


def _check_results_path(path: Path) -> None:
    """--results is appended to at every sync: a directory there was a traceback after the first sync's training."""
    if path.is_dir():
        raise ValueError(f"--results {str(path)!r} is a directory; give a file name, e.g. {str(path / 'results.jsonl')!r}")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--results {str(path)!r}: {str(parent)!r} is a file, not a directory")


def _check_names(args: argparse.Namespace) -> None:
    """Names the coordinator would refuse, refused here before minutes of model loading."""
    from protocol.schemas import check_name

    try:
        check_name(args.specialty, "--specialty")
        if args.worker_id is not None:
            check_name(args.worker_id, "--worker-id")
    except FedMoEError as exc:
        raise ValueError(f"{exc}, e.g. python_expert") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args)
    try:  # everything that needs no worker module answers before torch is imported
        _check_names(args)
        _check_address_and_files(args)
    except ValueError as exc:
        return report_error(args, exc)
    from models.errors import ModelError
    from worker.errors import WorkerError
    from worker.runner import run_worker

    # peft asks transformers for is_gradient_checkpointing; the deprecation notice is not the user's to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    replaced = _stop_on_signals()
    try:
        run_worker(build_config(args))
    except (ValueError, WorkerError, ModelError, FedMoEError) as exc:
        return report_error(args, exc)
    except KeyboardInterrupt:  # before training started: nothing to push
        return 130
    finally:
        restore(replaced)
    return 0


def _stop_on_signals() -> dict[int, Handler]:
    """SIGTERM (systemd, docker stop, kill) and Ctrl-C end training at the next step boundary with the final
    push that flushes the error-feedback residual (worker.stopping). Not under torchrun: there a rank that
    died would leave the others' final sync waiting in a collective, so a signal ends them at once."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {}
    return stop_on_signals()


if __name__ == "__main__":
    sys.exit(main())
