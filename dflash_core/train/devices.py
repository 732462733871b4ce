"""Where a training process runs: its rank among the run's processes and its devices, resolved once
(the entry point, the assembly and the loop all read the same `TrainDevices`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflash_core.train.config import TrainConfig


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class TrainDevices:
    """The target's device and the drafter's (the same one unless placement is pair). The drafter's
    is the process's device: DDP, NCCL collectives and barriers run there."""

    target: torch.device
    drafter: torch.device

    @property
    def process(self) -> torch.device:
        return self.drafter


def resolve_devices(config: TrainConfig, dist_info: Distributed) -> TrainDevices:
    """The devices of this process. Unset devices: cuda:LOCAL_RANK when there is a GPU, else the CPU;
    the pair layout without explicit devices gives local rank r the GPU pair (2r, 2r+1), target on
    the first, so a node of N GPUs runs N/2 processes. A bare `cuda` means cuda:LOCAL_RANK."""
    cuda = torch.cuda.is_available()
    if config.placement == "pair" and config.target_device is None and cuda:
        target, drafter = 2 * dist_info.local_rank, 2 * dist_info.local_rank + 1
        if drafter >= torch.cuda.device_count():
            raise ValueError(f"placement=pair: local rank {dist_info.local_rank} needs cuda:{target} and "
                             f"cuda:{drafter}, this node has {torch.cuda.device_count()} GPUs; run "
                             "nproc_per_node = GPUs / 2")
        return TrainDevices(torch.device("cuda", target),
                            _indexed(config.drafter_device or f"cuda:{drafter}", dist_info))
    target = _indexed(config.target_device or ("cuda" if cuda else "cpu"), dist_info)
    drafter = _indexed(config.drafter_device, dist_info) if config.placement == "pair" and config.drafter_device \
        else target
    return TrainDevices(target, drafter)


def _indexed(name: str, dist_info: Distributed) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", dist_info.local_rank)
    return device
