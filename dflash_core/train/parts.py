"""What a training run is made of once assembled (dflash_core.train.assemble builds it; the step
strategies and the loop read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dflash_core.target import HiddenStateCapture
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import PackedBatchSampler, TokenizedCorpus
from dflash_core.train.devices import TrainDevices

if TYPE_CHECKING:
    from dflash_core.target.gdn_packing import GDNKernels
    from dflash_core.lineage import InputRef
    from dflash_core.model import DFlashConfig


@dataclass
class TrainingParts:
    """Everything a run trains with, before parallelizing: the data, the frozen target and its capture,
    the drafter (fp32, on its device, the target's heads attached) and its optimizer and schedule."""

    config: TrainConfig
    devices: TrainDevices
    corpus: TokenizedCorpus
    sampler: PackedBatchSampler
    target: torch.nn.Module
    target_kernels: GDNKernels | None
    capture: HiddenStateCapture
    drafter_config: DFlashConfig
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    inputs: list[InputRef] = field(default_factory=list)  # the shards read, then the target's files, for the checkpoints' lineage

    @property
    def teacher(self) -> bool:
        """Whether the drafter learns the target's predictions (its capture then keeps the final states)."""
        return self.config.drafter.loss_target == "teacher"
