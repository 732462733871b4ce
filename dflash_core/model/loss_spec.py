"""How a drafter trains, apart from what it is: the loss (cross-entropy or KL, slot weights, label
smoothing) and the training-only regularizers. A drafter module holds one (`DFlashDraftModel.loss`);
its `DFlashConfig` is only the architecture, which serving, exports and the planner read."""

from __future__ import annotations

import dataclasses
from typing import Any

# Position-weight decay of the loss, per block size, as the DFlash paper sets it.
DEFAULT_LOSS_GAMMA = {16: 7.0, 8: 4.0}
LOSS_TYPES = ("ce", "kl")
LOSS_WEIGHTINGS = ("exp_decay", "dpace")
DPACE_SOURCES = ("unary", "selector")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """loss_type "ce" learns the target's argmax (or the data tokens), "kl" its whole distribution at
    the block's positions; slot weights "exp_decay" (exp(-(k-1)/loss_gamma); None: the block size's
    default) or "dpace" (speculators' D-PACE, smoothing dpace_alpha; dpace_source: whose probability
    of the label is a slot's confidence, the unary LM head's or, DFlash 2 only, the candidate
    selector's K-way one). Training only, 0 = off, never when drafting: feature_noise (Gaussian noise
    on the tapped target states, std = feature_noise x each state's RMS), dropout (on every sublayer's
    output before its residual add), label_smoothing (of the LM-head cross-entropy)."""

    loss_type: str = "ce"
    loss_weighting: str = "exp_decay"
    loss_gamma: float | None = None
    dpace_alpha: float = 0.5
    dpace_source: str = "unary"
    feature_noise: float = 0.0
    dropout: float = 0.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}")
        if self.dpace_source not in DPACE_SOURCES:
            raise ValueError(f"dpace_source must be one of {DPACE_SOURCES}, got {self.dpace_source!r}")
        if self.dpace_source != "unary" and self.loss_weighting != "dpace":
            raise ValueError(f"dpace_source {self.dpace_source!r} chooses D-PACE's confidences: it needs "
                             f"loss_weighting 'dpace', got {self.loss_weighting!r}")
        if self.loss_gamma is not None and self.loss_gamma <= 0:
            raise ValueError(f"loss_gamma must be > 0, got {self.loss_gamma}")
        if self.feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0, got {self.feature_noise}")
        for name in ("dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.label_smoothing and self.loss_type != "ce":
            raise ValueError(f"label_smoothing smooths the cross-entropy's labels: it needs loss_type 'ce', "
                             f"got {self.loss_type!r}")

    def gamma(self, block_size: int) -> float:
        """`loss_gamma`, or the DFlash paper's for `block_size`."""
        if self.loss_gamma is not None:
            return self.loss_gamma
        if block_size not in DEFAULT_LOSS_GAMMA:
            raise ValueError(f"no default loss_gamma for block_size {block_size}; pass one (defaults exist for "
                             f"{sorted(DEFAULT_LOSS_GAMMA)})")
        return DEFAULT_LOSS_GAMMA[block_size]

    def gamma_or_none(self, block_size: int) -> float | None:
        """`gamma(block_size)`, or None where no default exists and none was given."""
        if self.loss_gamma is None and block_size not in DEFAULT_LOSS_GAMMA:
            return None
        return self.gamma(block_size)

    @property
    def stochastic(self) -> bool:
        """Whether a training pass draws random numbers (feature noise or dropout)."""
        return self.feature_noise > 0 or self.dropout > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LossSpec:
        """From `to_dict()`, or from an older checkpoint's drafter config that carried these fields; unknown
        keys are ignored."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in (data or {}).items() if name in names})


LOSS_SPEC_FIELDS = tuple(field.name for field in dataclasses.fields(LossSpec))
