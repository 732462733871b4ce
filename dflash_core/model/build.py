"""The drafter module a configuration describes (`AutoModel.from_config`'s shape): the configurations stay
torch-free data that do not know their modules, so no import runs from a config back to a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_core.model.dflash2_config import DFlash2Config

if TYPE_CHECKING:
    from dflash_core.model.config import DFlashConfig
    from dflash_core.model.drafter import DFlashDraftModel
    from dflash_core.model.loss_spec import LossSpec


def build_drafter(config: DFlashConfig, *, device=None, loss: LossSpec | None = None) -> DFlashDraftModel:
    """A DFlashDraftModel, or a DFlash2DraftModel for a DFlash2Config (fp32 parameters; run it under bf16
    autocast on GPU) that trains with `loss` (None: the LossSpec defaults)."""
    if isinstance(config, DFlash2Config):
        from dflash_core.model.dflash2 import DFlash2DraftModel

        return DFlash2DraftModel(config, device=device, loss=loss)
    from dflash_core.model.drafter import DFlashDraftModel

    return DFlashDraftModel(config, device=device, loss=loss)
