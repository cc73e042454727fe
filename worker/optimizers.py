"""The optimiser of a worker's trainer, chosen by name (--optimizer): AdamW, or GaLore (worker.galore)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from worker.choices import OPTIMIZERS
from worker.galore import GaLoreAdamW, GaLoreSettings

GALORE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Linear layers whose weights GaLore projects: the attention and MLP matrices, as the paper's code does
("attn" and "mlp" modules); embeddings, norms and the LM head train with plain AdamW."""


@dataclass(frozen=True)
class OptimizerSettings:
    name: str = "adamw"
    """adamw, or galore (full-parameter experts only: --lora-rank 0)."""
    galore: GaLoreSettings = GaLoreSettings()
    """Rank, update interval and scale of --optimizer galore."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")


Builder = Callable[[OptimizerSettings, torch.nn.Module, list[torch.nn.Parameter], float, float], torch.optim.Optimizer]


def _adamw(settings: OptimizerSettings, model: torch.nn.Module, params: list[torch.nn.Parameter], lr: float,
           weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _galore(settings: OptimizerSettings, model: torch.nn.Module, params: list[torch.nn.Parameter], lr: float,
            weight_decay: float) -> torch.optim.Optimizer:
    trainable = {id(p) for p in params}
    projected = [module.weight for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in GALORE_TARGETS
                 and id(module.weight) in trainable]
    if not projected:
        raise ValueError("--optimizer galore projects the gradients of full weight matrices; it trains "
                         "full-parameter experts: add --lora-rank 0")
    chosen = {id(p) for p in projected}
    galore = settings.galore
    plain = [p for p in params if id(p) not in chosen]
    groups: list[dict[str, Any]] = [{"params": plain}] if plain else []
    groups.append({"params": projected, "rank": galore.rank, "update_interval": galore.update_interval,
                   "scale": galore.scale})
    return GaLoreAdamW(groups, lr=lr, weight_decay=weight_decay)


OPTIMIZER_BUILDERS: dict[str, Builder] = {"adamw": _adamw, "galore": _galore}


def build_optimizer(settings: OptimizerSettings, model: torch.nn.Module, params: list[torch.nn.Parameter], *,
                    lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The named optimiser over params (the trainable parameters of model)."""
    return OPTIMIZER_BUILDERS[settings.name](settings, model, params, lr, weight_decay)
