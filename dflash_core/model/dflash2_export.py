"""The native (z-lab) DFlash 2 format: z-lab's `DFlash2DraftModel` reads it.

    {"architectures": ["DFlash2DraftModel"], ...the DFlash native fields...,
     "dflash_config": {"mask_token_id", "target_layer_ids", "block_size",
                       "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                       "output_multiplier", "final_logit_softcapping", "input_embedding_scale",
                       ...our extras: qk_norm, loss_gamma, target_model_type, selector_loss_weight}}

Weights: the DFlash body plus `layers.N.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}`
and `candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}`
(bare codebook names, as published drafters and speculators 0.9 store them; z-lab's
`from_pretrained` maps them onto its embeddings). Glue for `dflash_core.export`, which handles
the DFlash format; see `export_native_dflash2` / `load_native_dflash2`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_core.export.checks import DRAFTER_PREFIXES, check_against_target
from dflash_core.export.native import config_from_native, native_config
from dflash_core.model.config import _text_config
from dflash_core.model.dflash2 import DFLASH2_FIELDS, DFlash2Config, DFlash2DraftModel

ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_PREFIXES = (*DRAFTER_PREFIXES, "candidate_selector.")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def native_dflash2_config(
    config: DFlash2Config, *, max_position_embeddings: int, dtype: str
) -> dict[str, Any]:
    """config.json for z-lab's `DFlash2DraftModel`."""
    data = native_config(config, max_position_embeddings=max_position_embeddings, dtype=dtype)
    data["architectures"] = [ARCHITECTURE]
    data["dflash_config"].update({name: getattr(config, name) for name in DFLASH2_FIELDS})
    # z-lab scales F.embedding(ids, target weight) by this; our drafter uses the target's embedding
    # module as is, which for the families we support (Llama, Qwen) is the same thing at 1.0.
    data["dflash_config"]["input_embedding_scale"] = 1.0
    return data


def dflash2_config_from_native(data: dict[str, Any]) -> DFlash2Config:
    """Inverse of `native_dflash2_config` (also reads published DFlash 2 configs)."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise ValueError(f"config.json architectures {data.get('architectures')} lacks {ARCHITECTURE!r}")
    dflash = data.get("dflash_config") or {}
    scale = float(dflash.get("input_embedding_scale", 1.0))
    if scale != 1.0:
        raise ValueError(
            f"input_embedding_scale {scale} is not supported (the drafter embeds with the target's module)"
        )
    base = config_from_native({**data, "architectures": ["DFlashDraftModel"]})
    fields = {name: dflash[name] for name in DFLASH2_FIELDS if dflash.get(name) is not None}
    return DFlash2Config.from_dflash(base, **fields)


def check_dflash2_state_dict(config: DFlash2Config, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError on target weights, missing/unexpected keys or wrong shapes."""
    foreign = sorted(k for k in state if not k.startswith(DFLASH2_PREFIXES))
    if foreign:
        raise ValueError(f"refusing to export non-drafter weights (target weights?): {foreign[:5]}")
    expected = config.build(device="meta").state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(
            f"drafter weights do not match its config: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, config says {tuple(expected[name].shape)}"
            )


def export_native_dflash2(
    drafter: DFlash2DraftModel, *, target_config: Any, out_dir: Path, dtype: torch.dtype | None = None
) -> Path:
    """Write `out_dir/{config.json, model.safetensors}`, validated first; returns out_dir."""
    config: DFlash2Config = drafter.config
    state = {name: t.detach() for name, t in drafter.state_dict().items()}
    dtype = dtype or next(iter(state.values())).dtype
    check_dflash2_state_dict(config, state)
    check_against_target(config, target_config=target_config)
    text = _text_config(target_config)
    max_positions = int(getattr(text, "max_position_embeddings", None) or 32768)
    data = native_dflash2_config(
        config, max_position_embeddings=max_positions, dtype=str(dtype).removeprefix("torch.")
    )
    again = dflash2_config_from_native(json.loads(json.dumps(data)))
    if again.to_dict() != config.to_dict():
        raise ValueError(
            f"native DFlash 2 config does not round-trip: {again.to_dict()} != {config.to_dict()}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: t.to(device="cpu", dtype=dtype).contiguous() for k, t in state.items()},
        out_dir / WEIGHTS_FILE,
        metadata={"format": "pt"},
    )
    (out_dir / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out_dir


def load_native_dflash2(path: Path, *, device: str | torch.device = "cpu") -> DFlash2DraftModel:
    """A fp32 `DFlash2DraftModel` from a native export; attach the target after."""
    config = dflash2_config_from_native(json.loads((Path(path) / CONFIG_FILE).read_text()))
    state = {k: t.float() for k, t in load_file(Path(path) / WEIGHTS_FILE, device=str(device)).items()}
    check_dflash2_state_dict(config, state)
    drafter = config.build(device=device)
    drafter.load_state_dict(state, strict=True)
    return drafter


def speculators_dflash2_config(
    config: DFlash2Config,
    *,
    max_position_embeddings: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    dtype: str,
) -> dict[str, Any]:
    """config.json for speculators 0.9's `DFlash2DraftModel` (experimental in 0.9). Its contract has
    no output_multiplier or final_logit_softcapping: drafters that use them are refused."""
    from dflash_core.export.checks import check_speculators_compatible
    from dflash_core.export.speculators import speculators_config

    if config.output_multiplier != 1.0 or config.final_logit_softcapping is not None:
        raise ValueError(
            "speculators 0.9's DFlash2 applies neither output_multiplier nor final_logit_softcapping; "
            "export this drafter in the native format only"
        )
    check_speculators_compatible(config, num_target_layers=config.target_num_layers or 10**9)
    data = speculators_config(
        config,
        max_position_embeddings=max_position_embeddings,
        verifier_name_or_path=verifier_name_or_path,
        verifier_architectures=verifier_architectures,
        dtype=dtype,
    )
    data["speculators_model_type"] = "dflash2"
    data["architectures"] = [ARCHITECTURE]
    data["speculators_config"]["algorithm"] = "dflash2"
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        data[name] = getattr(config, name)
    data["transformer_layer_config"]["dflash_pipeline"]["selector_loss_weight"] = config.selector_loss_weight
    return data
