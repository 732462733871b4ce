"""The second step of a run's assembly: compile (config.compile) and wrap the drafter in DDP (several
processes). Returns the module a step calls; the parts keep the bare drafter (checkpoints, optimizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflash_core.train.parts import TrainingParts


def parallelize(parts: TrainingParts, *, world_size: int) -> torch.nn.Module:
    if parts.config.compile:
        from dflash_core.target.runtime import compile_decoder_layers

        mode = parts.config.compile_mode
        parts.drafter.compile_layers(mode=mode)
        compile_decoder_layers(parts.target, mode=mode)
    if world_size == 1:
        return parts.drafter
    from torch.nn.parallel import DistributedDataParallel

    device = parts.devices.drafter
    return DistributedDataParallel(parts.drafter, device_ids=[device.index] if device.type == "cuda" else None)
