"""Export a trained drafter in the native (z-lab) and speculators (vLLM) formats, and import either
back as an equal `DFlashDraftModel` (a `DFlash2DraftModel` for a DFlash 2 drafter: the same formats
with architecture `DFlash2DraftModel` / `speculators_model_type` "dflash2", see native.py and
speculators.py).

    paths = export_drafter(drafter, target_config=cfg, out_dir=d, verifier_name_or_path="Qwen/Qwen3-8B")
    drafter = load_drafter(paths["native"])          # or paths["speculators"]

Everything is validated before a byte is written (`checks`): layer ids in range and equal (+1)
across formats, the mask id a real row of the target embedding, window and RoPE carried, no target
weights in the file. Both formats state the draft length vLLM reads (`n_predict` = block_size - 1); an
import that states another is refused. `engines` says which serving engine versions serve each variant,
and gives the `--speculative-config` for an export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_core.export.checks import (
    DRAFTER_PREFIXES,
    check_against_target,
    check_draft_lengths,
    check_formats_agree,
    check_runtime_conventions,
    check_speculators_compatible,
    check_state_dict,
)
from dflash_core.export.native import config_from_native, exported_loss, loss_from_extras, native_config
from dflash_core.export.speculators import config_from_speculators, speculators_config
from dflash_core.model.build import build_drafter
from dflash_core.model.config import DFlashConfig, _text_config
from dflash_core.model.loss_spec import LossSpec

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMATS = ("native", "speculators")

__all__ = [
    "FORMATS",
    "build_export_configs",
    "export_drafter",
    "load_drafter",
    "read_export_config",
]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_export_configs(
    config: DFlashConfig, *, target_config: Any, verifier_name_or_path: str, dtype: torch.dtype,
    formats: tuple[str, ...] = FORMATS, loss: LossSpec | None = None,
) -> dict[str, dict[str, Any]]:
    """The config.json dict of each format, validated against the target and against each other; `loss`
    (the drafter's LossSpec, None: the defaults) rides along as training metadata."""
    loss = loss or LossSpec()
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {formats}")
    check_runtime_conventions(config)
    check_against_target(config, target_config=target_config)
    text = _text_config(target_config)
    max_positions = int(getattr(text, "max_position_embeddings", None) or 32768)
    out = {"native": native_config(config, loss=loss, max_position_embeddings=max_positions, dtype=_dtype_name(dtype))}
    if "speculators" in formats:
        if not verifier_name_or_path:
            raise ValueError("verifier_name_or_path is required for the speculators format")
        check_speculators_compatible(config, num_target_layers=text.num_hidden_layers)
        out["speculators"] = speculators_config(
            config, loss=loss, max_position_embeddings=max_positions, verifier_name_or_path=verifier_name_or_path,
            verifier_architectures=list(getattr(target_config, "architectures", None) or []),
            dtype=_dtype_name(dtype),
        )
        check_formats_agree(out["native"], out["speculators"])
    # Each written config must read back to the drafter it describes.
    for name, data in out.items():
        check_draft_lengths(data, block_size=config.block_size, source=f"{name} config.json")
        again = (config_from_native if name == "native" else config_from_speculators)(json.loads(json.dumps(data)))
        if again.to_dict() != config.to_dict():
            diff = {k: (v, again.to_dict()[k]) for k, v in config.to_dict().items() if again.to_dict()[k] != v}
            raise ValueError(f"{name} config does not round-trip: {diff}")
        if _loss_of(json.loads(json.dumps(data))) != loss_from_extras(exported_loss(loss, block_size=config.block_size)):
            raise ValueError(f"{name} config does not carry the drafter's loss settings back")
    return {name: out[name] for name in formats}


def export_drafter(
    drafter: torch.nn.Module, *, target_config: Any, out_dir: Path, verifier_name_or_path: str = "",
    formats: tuple[str, ...] = FORMATS, dtype: torch.dtype | None = None,
) -> dict[str, Path]:
    """Write `out_dir/<format>/{config.json, model.safetensors}` for each format; returns the dirs."""
    config: DFlashConfig = drafter.config
    state = {name: t.detach() for name, t in drafter.state_dict().items()}
    dtype = dtype or next(iter(state.values())).dtype
    check_state_dict(config, state)
    configs = build_export_configs(
        config, target_config=target_config, verifier_name_or_path=verifier_name_or_path, dtype=dtype,
        formats=formats, loss=getattr(drafter, "loss", None),
    )
    tensors = {name: t.to(device="cpu", dtype=dtype).contiguous() for name, t in state.items()}
    written = {}
    for name, data in configs.items():
        directory = Path(out_dir) / name
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        written[name] = directory
    return written


def read_export_config(path: Path) -> tuple[str, DFlashConfig]:
    """(format, config) of an export directory, detected from its config.json."""
    name, config, _ = _read_export(path)
    return name, config


def _read_export(path: Path) -> tuple[str, DFlashConfig, LossSpec]:
    """(format, config, the loss settings it carries) from one read of config.json."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist")
    data = json.loads(config_path.read_text())
    name = "speculators" if "speculators_model_type" in data else "native"
    config = (config_from_speculators if name == "speculators" else config_from_native)(data)
    check_draft_lengths(data, block_size=config.block_size, source=str(config_path))
    return name, config, _loss_of(data)


def _loss_of(data: dict[str, Any]) -> LossSpec:
    """The training metadata an export carries (native: dflash_config; speculators: dflash_pipeline)."""
    if "speculators_model_type" in data:
        return loss_from_extras((data.get("transformer_layer_config") or {}).get("dflash_pipeline") or {})
    return loss_from_extras(data.get("dflash_config") or {})


def load_drafter(path: Path, *, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A `DFlashDraftModel` or `DFlash2DraftModel` (fp32) from a native or speculators export directory;
    attach the target after."""
    _, config, loss = _read_export(path)
    state = load_file(Path(path) / WEIGHTS_FILE, device=str(device))
    # speculators' own save_pretrained may also hold verifier-owned tensors: not drafter weights.
    state = {name: t.float() for name, t in state.items() if name.startswith(DRAFTER_PREFIXES)}
    check_state_dict(config, state)
    drafter = build_drafter(config, device=device, loss=loss)
    drafter.load_state_dict(state, strict=True)
    return drafter
