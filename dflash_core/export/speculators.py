"""The speculators (vLLM) DFlash format, as speculators 0.9's `DFlashSpeculatorConfig` writes it.

    {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
     "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34], "block_size": 16, "mask_token_id": ...,
     "draft_vocab_size": V, "transformer_layer_config": {Qwen3 fields, "n_predict": B-1},
     "sliding_window_non_causal": true,
     "speculators_config": {"algorithm": "dflash", "proposal_methods": [greedy, B-1 tokens],
                            "verifier": {"name_or_path": ..., "architectures": [...]}}}

Its aux id k is the INPUT of decoder layer k (transformers `hidden_states[k]`), so aux = native + 1.
vLLM takes `num_speculative_tokens` from `transformer_layer_config.n_predict` (its default) or, serving
this directory as the model, from the proposal method's `speculative_tokens`: both are block_size - 1.
Written without importing speculators; the parity test loads it with speculators itself.

DFlash 2 (speculators 0.9's experimental `DFlash2SpeculatorConfig`): `speculators_model_type` and
`algorithm` "dflash2", `architectures: ["DFlash2DraftModel"]`, and conv_kernel_size,
conv_group_size, selector_rank, selector_top_k at the top level. Its contract has no
output_multiplier or final_logit_softcapping (checks.py refuses drafters that use them).
"""

from __future__ import annotations

from typing import Any

from dflash_core.export.native import (
    DFLASH2_ARCHITECTURE, config_from_layer_fields, exported_loss, layer_config, num_speculative_tokens,
)
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.config import DFlashConfig
from dflash_core.model.dflash2 import variant_of

SPECULATORS_VERSION = "0.9.0"
MODEL_TYPES = ("dflash", "dflash2")
# The DFlash 2 fields speculators 0.9 names (top level); the rest ride in dflash_pipeline.
SPECULATORS_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def speculators_config(
    config: DFlashConfig, *, loss: LossSpec, max_position_embeddings: int, verifier_name_or_path: str,
    verifier_architectures: list[str], dtype: str,
) -> dict[str, Any]:
    """config.json of the speculators format."""
    layer = layer_config(config, max_position_embeddings=max_position_embeddings)
    layer["dtype"] = dtype
    layer["n_predict"] = num_speculative_tokens(config.block_size)
    # Fields speculators has no name for; Qwen3Config keeps unknown keys, so they survive its loader.
    layer["dflash_pipeline"] = {
        "target_model_type": config.target_model_type,
        "num_target_layers": config.target_num_layers,
        **exported_loss(loss, block_size=config.block_size),
    }
    model_type = variant_of(config)
    dflash2 = model_type == "dflash2"
    if dflash2:
        layer["dflash_pipeline"]["selector_loss_weight"] = config.selector_loss_weight
    return {
        "architectures": [DFLASH2_ARCHITECTURE if dflash2 else "DFlashSpeculator"],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": [k + 1 for k in config.target_layer_ids],
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        "mask_token_id": config.mask_token_id,
        "target_hidden_size": None,
        # Our blocks are non-causal inside the block on every layer type.
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "transformer_layer_config": layer,
        **({name: getattr(config, name) for name in SPECULATORS_DFLASH2_FIELDS} if dflash2 else {}),
        "speculators_config": {
            "algorithm": model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": num_speculative_tokens(config.block_size),
                "accept_tolerance": 0.0, "verifier_accept_k": 1,
            }],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
    }


def config_from_speculators(data: dict[str, Any]) -> DFlashConfig:
    """Inverse of `speculators_config` (aux ids - 1 back to native ids)."""
    model_type = data.get("speculators_model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"speculators_model_type is {model_type!r}, expected one of {MODEL_TYPES}")
    layer = data["transformer_layer_config"]
    if data.get("draft_vocab_size", layer["vocab_size"]) != layer["vocab_size"]:
        raise ValueError("reduced draft vocabularies (draft_vocab_size != vocab_size) are not supported")
    if data.get("sample_from_anchor"):
        raise ValueError("sample_from_anchor=True drafters are not DFlash drafters this project can run")
    aux = data.get("aux_hidden_state_layer_ids")
    if not aux or data.get("mask_token_id") is None:
        raise ValueError("config.json needs aux_hidden_state_layer_ids and mask_token_id")
    extras = dict(layer.get("dflash_pipeline") or {})
    extras.update({name: data[name] for name in SPECULATORS_DFLASH2_FIELDS if name in data})
    return config_from_layer_fields(
        layer, target_layer_ids=[k - 1 for k in aux], mask_token_id=data["mask_token_id"],
        block_size=data["block_size"], extras={**extras, "qk_norm": True},
        num_target_layers=extras.get("num_target_layers"), dflash2=model_type == "dflash2",
    )
