"""The DFlash drafter, its block plan, masks, loss and metrics. Needs torch only (no pydantic)."""

from dflash_core.model.anchors import BlockPlan, plan_blocks, sample_anchors
from dflash_core.model.config import DFlashConfig, tapped_layer_ids
from dflash_core.model.drafter import ContextCache, DFlashDraftModel, DraftOutput, TargetHeads
from dflash_core.model.loss import chunked_lm_head_cross_entropy, position_weights, teacher_token_ids
from dflash_core.model.metrics import block_metrics

__all__ = [
    "BlockPlan",
    "ContextCache",
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftOutput",
    "TargetHeads",
    "block_metrics",
    "chunked_lm_head_cross_entropy",
    "plan_blocks",
    "position_weights",
    "sample_anchors",
    "tapped_layer_ids",
    "teacher_token_ids",
]
