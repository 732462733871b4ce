"""The DFlash 2 drafter's configuration (torch-free: what TrainConfig, checkpoints' metadata and the planner
read); the modules are in dflash_core/model/dflash2.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_core.model.config import DFlashConfig
from dflash_core.model.loss_spec import LOSS_SPEC_FIELDS

VARIANTS = ("dflash", "dflash2")
DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "selector_loss_weight",
    "output_multiplier",
    "final_logit_softcapping",
)


@dataclasses.dataclass
class DFlash2Config(DFlashConfig):
    """A DFlashConfig plus the DFlash 2 modules. Defaults are those of released DFlash 2 drafters
    (speculators 0.9's too); `selector_loss_weight` is alpha in loss = dflash + alpha * selector."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_weight: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k must be in [1, {self.vocab_size}], got {self.selector_top_k}")
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")
        if self.output_multiplier <= 0:
            raise ValueError(
                f"output_multiplier must be > 0 (top-K must not flip), got {self.output_multiplier}"
            )
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(
                f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping}"
            )

    @property
    def conv_num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_dflash(cls, base: DFlashConfig, **dflash2_fields: Any) -> DFlash2Config:
        """`base` with the DFlash 2 fields set (the rest at their defaults)."""
        unknown = sorted(set(dflash2_fields) - set(DFLASH2_FIELDS))
        if unknown:
            raise ValueError(f"unknown DFlash 2 fields {unknown}; use {DFLASH2_FIELDS}")
        shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig) if f.init}
        return cls(**shared, **dflash2_fields)

    @classmethod
    def from_target(cls, target_config: Any, **kwargs: Any) -> DFlash2Config:  # type: ignore[override]
        """`DFlashConfig.from_target(target_config, ...)` plus DFlash 2 fields, in one keyword set."""
        extra = {name: kwargs.pop(name) for name in DFLASH2_FIELDS if name in kwargs}
        return cls.from_dflash(DFlashConfig.from_target(target_config, **kwargs), **extra)


def drafter_config(variant: str, base: DFlashConfig, **dflash2_fields: Any) -> DFlashConfig:
    """The trainer's `variant` setting: 'dflash' keeps `base`; 'dflash2' adds the DFlash 2 fields."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "dflash":
        if dflash2_fields:
            raise ValueError(f"DFlash 2 settings {sorted(dflash2_fields)} given for variant 'dflash'")
        return base
    return DFlash2Config.from_dflash(base, **dflash2_fields)


def variant_of(config: DFlashConfig) -> str:
    """'dflash2' for a DFlash2Config, else 'dflash' (the trainer's `variant` setting)."""
    return "dflash2" if isinstance(config, DFlash2Config) else "dflash"


def config_from_dict(data: dict[str, Any]) -> DFlashConfig:
    """Inverse of `config.to_dict()` for either variant (a checkpoint's `drafter_config`; older ones also
    carry the loss fields, which belong to the LossSpec: `LossSpec.from_dict` reads them)."""
    is_dflash2 = any(name in data for name in DFLASH2_FIELDS)
    return (DFlash2Config if is_dflash2 else DFlashConfig)(
        **{name: value for name, value in data.items() if name not in LOSS_SPEC_FIELDS})
