"""The drafter's optimizer and learning-rate schedule: linear warmup then cosine decay to
`min_lr_ratio` of the peak at `max_steps`, over AdamW (fused on a GPU) or, with `optimizer: muon`,
torch's Muon over the drafter's weight matrices and AdamW over the rest (norms, biases, the DFlash 2
selector's codebooks), split as speculators splits them."""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_core.train.config import TrainConfig

# 2-D parameters that stay with AdamW under Muon: vocabulary-indexed rows (speculators' rule).
_ADAMW_MATRIX_NAMES = ("embed_tokens", "lm_head", "codebook")


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Optimizers:
    """Several optimizers stepped as one (Muon + AdamW), each with its own schedule; state_dict holds
    each one's, in order."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizers")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(saved) if saved else 1} optimizer state(s), this run has "
                             f"{len(self.optimizers)}: resume with the optim.optimizer it was trained with")
        for optimizer, one in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(one)


class Schedulers:
    """One LambdaLR per optimizer of an `Optimizers`, advanced together."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [lr for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler, one in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(one)


def muon_split(drafter: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's parameters, AdamW's): trainable matrices with both sides > 1 that are not vocabulary rows go
    to Muon; everything else to AdamW."""
    muon, adamw = [], []
    for name, parameter in drafter.named_parameters():
        if not parameter.requires_grad:
            continue
        matrix = parameter.ndim == 2 and min(parameter.shape) > 1
        (muon if matrix and not any(part in name for part in _ADAMW_MATRIX_NAMES) else adamw).append(parameter)
    return muon, adamw


def build_optimizer(drafter: torch.nn.Module, config: TrainConfig, *, device: torch.device):
    """(optimizer, scheduler) of the run: AdamW and its LambdaLR, or `Optimizers` / `Schedulers` over
    Muon and AdamW."""
    o = config.optim
    warmup = o.resolved_warmup_steps(config.max_steps)
    fused = device.type == "cuda"

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, warmup=warmup, total=config.max_steps, min_ratio=o.min_lr_ratio))

    if o.optimizer == "adamw":
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                      fused=fused)
        return optimizer, schedule(optimizer)
    matrices, rest = muon_split(drafter)
    optimizers = [torch.optim.Muon(matrices, lr=o.muon_lr or o.lr, momentum=o.muon_momentum,
                                   weight_decay=o.muon_weight_decay, adjust_lr_fn="match_rms_adamw")]
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused))
    return Optimizers(optimizers), Schedulers([schedule(optimizer) for optimizer in optimizers])


def optimizer_step(drafter: torch.nn.Module, optimizer, scheduler, *, grad_clip: float) -> torch.Tensor:
    """Clip, step, advance the schedule, clear the gradients; the gradient norm before clipping (on the
    device, no sync)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach()
