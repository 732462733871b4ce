"""The DFlash drafter, its block plan, masks, loss and metrics. Needs torch only (no pydantic).

The names below load on first use, so that importing a torch-free submodule (`dflash_core.model.config`,
`loss_spec`, `dflash2_config`: what TrainConfig reads) does not import torch."""

from dflash_core.lazy_names import lazy_getattr

_HOMES = {
    "BlockPlan": "anchors", "plan_blocks": "anchors", "sample_anchors": "anchors",
    "DFlashConfig": "config", "tapped_layer_ids": "config",
    "ContextCache": "context_cache", "StaticContextCache": "context_cache", "DFlashDraftModel": "drafter",
    "DraftOutput": "drafter", "TargetHeads": "drafter",
    "chunked_lm_head_cross_entropy": "loss", "position_weights": "loss", "teacher_token_ids": "loss",
    "block_metrics": "metrics",
    "build_drafter": "build",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
