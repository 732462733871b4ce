"""The drafter's optimizer and learning-rate schedule: AdamW (fused on a GPU), linear warmup then
cosine decay to `min_lr_ratio` of the peak at `max_steps`."""

from __future__ import annotations

import math

import torch

from dflash_core.train.config import TrainConfig


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(drafter: torch.nn.Module, config: TrainConfig, *, device: torch.device
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    o = config.optim
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=o.warmup_steps, total=config.max_steps, min_ratio=o.min_lr_ratio))
    return optimizer, scheduler


def optimizer_step(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, *, grad_clip: float) -> torch.Tensor:
    """Clip, step, advance the schedule, clear the gradients; the gradient norm before clipping (on the
    device, no sync)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach()
