"""The DFlash drafter, its block plan, masks, loss and metrics. Needs torch only (no pydantic).

The names below load on first use, so that importing a torch-free submodule (`dflash_core.model.config`,
`loss_spec`, `dflash2_config`: what TrainConfig reads) does not import torch."""

from importlib import import_module

_HOMES = {
    "BlockPlan": "anchors", "plan_blocks": "anchors", "sample_anchors": "anchors",
    "DFlashConfig": "config", "tapped_layer_ids": "config",
    "ContextCache": "drafter", "DFlashDraftModel": "drafter", "DraftOutput": "drafter", "TargetHeads": "drafter",
    "chunked_lm_head_cross_entropy": "loss", "position_weights": "loss", "teacher_token_ids": "loss",
    "block_metrics": "metrics",
    "build_drafter": "build",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
