"""The native (z-lab) DFlash format: a Qwen3-style `config.json` plus `model.safetensors`.

    {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
     "dflash_config": {"mask_token_id": ..., "target_layer_ids": [1, 9, 17, 25, 33]},
     "layer_types": [...], "sliding_window": null, "num_hidden_layers": 5, "num_target_layers": 36,
     "hidden_size": ..., "head_dim": ..., "rope_parameters": {...}, ...}

Layer id k is the OUTPUT of target decoder layer k (transformers `hidden_states[k+1]`). The
weights hold the drafter body only (fc, hidden_norm, layers.*, norm), never the target's
embedding or LM head. Fields this project needs to rebuild an equal drafter that z-lab's format
has no name for (qk_norm, target_model_type and the training loss settings) ride along inside
`dflash_config`.

Draft length: `n_predict` = block_size - 1 (the block is [anchor, MASK x (B-1)]). No runtime reads
`block_size`; vLLM defaults `num_speculative_tokens` to `n_predict` and builds 1 + that many query
slots, so a wrong value there would silently change every drafted token.

DFlash 2 (a `DFlash2Config`) is the same format with `architectures: ["DFlash2DraftModel"]`, the
DFlash 2 fields in `dflash_config` (conv_kernel_size, conv_group_size, selector_rank,
selector_top_k, output_multiplier, final_logit_softcapping, input_embedding_scale 1.0; our
selector_loss_weight rides along), and weights that add `layers.N.{attention,mlp}_conv.*` and
`candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}`: the
codebooks bare, without `.weight`, as published drafters and speculators store them and z-lab's
`from_pretrained` key mapping expects.

Causality: our blocks are non-causal on every layer type. z-lab's reference and vLLM make
`sliding_attention` layers causal unless the config says otherwise, each in its own field (z-lab:
top-level `is_causal`; vLLM: `dflash_config.causal`, it never reads `is_causal`), so both are written
as false. SGLang builds before it read `is_causal` run sliding layers causally: serve sliding-window
drafters on a build that reads it. The window is per query, as every runtime applies it: slot k of
the block anchored at p sees context j when (p + k) - j < sliding_window. (speculators trains the
window relative to the anchor, p - j <= sliding_window, which no runtime serves; we train what is
served.)
"""

from __future__ import annotations

from typing import Any

from dflash_core.model.config import SLIDING_ATTENTION, DFlashConfig
from dflash_core.model.dflash2 import DFLASH2_FIELDS, DFlash2Config
from dflash_core.model.loss_spec import LossSpec

ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# Training settings no runtime reads (the drafter's LossSpec, its regularizers left out); carried so an
# export reads back to the drafter it was.
LOSS_FIELDS = ("loss_gamma", "loss_type", "loss_weighting", "dpace_alpha")


def num_speculative_tokens(block_size: int) -> int:
    """Tokens one block drafts ([anchor, MASK x (B-1)]): what an export writes as `n_predict`, and the
    `num_speculative_tokens` a vLLM server must be started with."""
    return block_size - 1


def exported_loss(loss: LossSpec, *, block_size: int) -> dict[str, Any]:
    """The LOSS_FIELDS of `loss` as an export writes them (loss_gamma resolved for the block size)."""
    return {**{name: getattr(loss, name) for name in LOSS_FIELDS}, "loss_gamma": loss.gamma_or_none(block_size)}


def loss_from_extras(extras: dict[str, Any]) -> LossSpec:
    """The LossSpec an export carries (absent fields: the defaults)."""
    return LossSpec(**{name: extras[name] for name in LOSS_FIELDS if extras.get(name) is not None})


def architecture(config: DFlashConfig) -> str:
    return DFLASH2_ARCHITECTURE if isinstance(config, DFlash2Config) else ARCHITECTURE


def rope_parameters(config: DFlashConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def layer_config(config: DFlashConfig, *, max_position_embeddings: int) -> dict[str, Any]:
    """The Qwen3-style decoder fields a loader needs to build the drafter's layers."""
    sliding = SLIDING_ATTENTION in config.layer_types
    return {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_parameters(config),
        # Loaders that predate transformers 5's rope_parameters (the MLX port among them) read this.
        "rope_theta": config.rope_theta,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": max_position_embeddings,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "max_window_layers": config.num_layers,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
    }


def native_config(config: DFlashConfig, *, loss: LossSpec, max_position_embeddings: int, dtype: str) -> dict[str, Any]:
    """config.json of the native format (DFlash or DFlash 2, by the config's type)."""
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "causal": False,
        "qk_norm": config.qk_norm,
        "target_model_type": config.target_model_type,
        **exported_loss(loss, block_size=config.block_size),
    }
    if isinstance(config, DFlash2Config):
        dflash.update({name: getattr(config, name) for name in DFLASH2_FIELDS})
        # z-lab scales F.embedding(ids, target weight) by this; our drafter uses the target's embedding
        # module as is, which for the families we support (Llama, Qwen) is the same thing at 1.0.
        dflash["input_embedding_scale"] = 1.0
    return {
        "architectures": [architecture(config)],
        **layer_config(config, max_position_embeddings=max_position_embeddings),
        "block_size": config.block_size,
        # vLLM's default num_speculative_tokens (it never reads block_size).
        "n_predict": num_speculative_tokens(config.block_size),
        "num_target_layers": config.target_num_layers,
        "is_causal": False,
        "dflash_config": dflash,
        "dtype": dtype,
    }


def config_from_layer_fields(
    layer: dict[str, Any], *, target_layer_ids: list[int], mask_token_id: int, block_size: int,
    extras: dict[str, Any], num_target_layers: int | None, dflash2: bool = False,
) -> DFlashConfig:
    """A DFlashConfig from Qwen3-style decoder fields plus the DFlash ones (shared by both importers);
    with `dflash2`, a DFlash2Config whose fields `extras` gives (absent ones: the published defaults)."""
    rope = layer.get("rope_parameters") or {"rope_theta": layer.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported by the drafter (only 'default')")
    layer_types = layer.get("layer_types") or None
    base = DFlashConfig(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=layer["vocab_size"],
        target_layer_ids=list(target_layer_ids),
        mask_token_id=mask_token_id,
        num_layers=layer["num_hidden_layers"],
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=layer.get("sliding_window") if layer_types and SLIDING_ATTENTION in layer_types else None,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        qk_norm=bool(extras.get("qk_norm", True)),
        attention_bias=bool(layer.get("attention_bias", False)),
        target_model_type=extras.get("target_model_type", "qwen3"),
        target_num_layers=num_target_layers,
        initializer_range=layer.get("initializer_range", 0.02),
    )
    if not dflash2:
        return base
    return DFlash2Config.from_dflash(base, **{name: extras[name] for name in DFLASH2_FIELDS if name in extras})


def _causal_layers(data: dict[str, Any]) -> list[int]:
    """Layers some runtime would run causally. Each reads its own flag (z-lab's reference: top-level
    `is_causal`; vLLM: `dflash_config.causal`) and, where its flag is absent, runs sliding_attention layers
    causally."""
    layer_types = data.get("layer_types") or ["full_attention"] * int(data.get("num_hidden_layers", 0))
    sliding = {index for index, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION}
    causal: set[int] = set()
    for flag in (data.get("is_causal"), (data.get("dflash_config") or {}).get("causal")):
        causal |= sliding if flag is None else set(range(len(layer_types))) if flag else set()
    return sorted(causal)


def config_from_native(data: dict[str, Any]) -> DFlashConfig:
    """Inverse of `native_config` (also reads z-lab configs, where block_size may sit at the top, and
    published DFlash 2 configs)."""
    architectures = data.get("architectures") or []
    dflash2 = DFLASH2_ARCHITECTURE in architectures
    if ARCHITECTURE not in architectures and not dflash2:
        raise ValueError(f"config.json architectures {architectures} lacks {ARCHITECTURE!r} "
                         f"or {DFLASH2_ARCHITECTURE!r}")
    dflash = data.get("dflash_config") or {}
    if dflash2:
        scale = float(dflash.get("input_embedding_scale", 1.0))
        if scale != 1.0:
            raise ValueError(f"input_embedding_scale {scale} is not supported (the drafter embeds with the "
                             "target's own embedding module)")
    elif any(name in dflash for name in DFLASH2_FIELDS):
        raise ValueError(f"config.json says {ARCHITECTURE!r} but its dflash_config holds DFlash 2 fields "
                         f"{sorted(set(dflash) & set(DFLASH2_FIELDS))}: is it a {DFLASH2_ARCHITECTURE!r}?")
    if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
        raise ValueError("config.json dflash_config needs target_layer_ids and mask_token_id")
    block_size = data.get("block_size") or dflash.get("block_size")
    if block_size is None:
        raise ValueError("config.json has no block_size (top level or dflash_config)")
    causal_layers = _causal_layers(data)
    if causal_layers:
        raise ValueError(
            f"config.json makes drafter layers {causal_layers} causal inside the block (z-lab reads "
            "`is_causal`, vLLM `dflash_config.causal`; where its flag is absent a runtime runs "
            "sliding_attention layers causally); this project's drafter is non-causal on every layer and "
            "would draft differently"
        )
    return config_from_layer_fields(
        data, target_layer_ids=dflash["target_layer_ids"], mask_token_id=dflash["mask_token_id"],
        block_size=block_size, extras=dflash, num_target_layers=data.get("num_target_layers"), dflash2=dflash2,
    )
