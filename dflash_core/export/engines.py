"""Which serving engine releases serve which drafter variant, and the `--speculative-config` to start one.

    check_servable(json.loads(text), engine="vllm", version="0.26.0")   # ValueError: not served there
    speculative_config(export_dir)  # {"method": "dflash", "model": export_dir, "num_speculative_tokens": 15}

Read from each release's wheel (docs/drafter.md, "Serving an export"); tests/unit/test_export_vllm.py runs
`VLLM_CHECKED_VERSION`'s own config code on our exports.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dflash_core.export.checks import check_draft_lengths
from dflash_core.nodes.wheelhouse import VLLM_VERSION
from dflash_core.export.native import ARCHITECTURE, DFLASH2_ARCHITECTURE, num_speculative_tokens

# The vLLM release the node's wheelhouse carries, whose loader code the CPU test executes on our exports
# (infra/setup.sh downloads its wheel).
VLLM_CHECKED_VERSION = VLLM_VERSION
_VARIANT_NAMES = {"dflash": "DFlash", "dflash2": "DFlash 2"}
_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
_VLLM_START = ("vllm serve TARGET --speculative-config "
               "'{\"method\": METHOD, \"model\": EXPORT_DIR, \"num_speculative_tokens\": BLOCK_SIZE - 1}'")


@dataclasses.dataclass(frozen=True)
class EngineRelease:
    """One release of a serving engine: drafter variant -> its speculative-config method, and how to start it."""

    engine: str
    version: str
    methods: dict[str, str]
    start: str
    note: str = ""


ENGINES = (
    EngineRelease(
        "vllm", VLLM_CHECKED_VERSION, {"dflash": "dflash"}, _VLLM_START,
        note="A drafter mixing sliding and full attention layers needs VLLM_USE_V2_MODEL_RUNNER=1. "
             "`vllm serve SPECULATORS_EXPORT_DIR` also works (target from its verifier, draft length from "
             "speculative_tokens; any --speculative-config is then ignored).",
    ),
    EngineRelease("vllm", "0.34.0", {"dflash": "dflash", "dflash2": "dflash2"}, _VLLM_START,
                  note="Pins torch 2.14."),
    EngineRelease("sglang", "0.5.10.post1", {}, "", note="The registry's latest: no DFlash."),
)


def release(engine: str, version: str) -> EngineRelease:
    for entry in ENGINES:
        if (entry.engine, entry.version) == (engine, version):
            return entry
    known = ", ".join(f"{entry.engine} {entry.version}" for entry in ENGINES)
    raise ValueError(f"no entry for {engine} {version} (known: {known})")


def export_variant(config: dict[str, Any]) -> tuple[str, str]:
    """(variant, the field that says so) of an export's config.json dict, either format."""
    if "speculators_model_type" in config:
        model_type = config["speculators_model_type"]
        if model_type not in _VARIANT_NAMES:
            raise ValueError(f"speculators_model_type {model_type!r} is not a DFlash drafter")
        return model_type, f"speculators_model_type {model_type}"
    architectures = config.get("architectures") or []
    for variant, architecture in (("dflash2", DFLASH2_ARCHITECTURE), ("dflash", ARCHITECTURE)):
        if architecture in architectures:
            return variant, architecture
    raise ValueError(f"architectures {architectures} names no DFlash drafter")


def _label(entry: EngineRelease) -> str:
    return f"{_ENGINE_NAMES[entry.engine]} {entry.version}"


def check_servable(config: dict[str, Any], *, engine: str, version: str) -> None:
    """Raise ValueError, naming the variant, this release and one that serves it, unless it serves `config`."""
    entry = release(engine, version)
    variant, said_by = export_variant(config)
    if variant in entry.methods:
        return
    serves = [_VARIANT_NAMES[v] for v in entry.methods]
    served = f"serves {' and '.join(serves)} only" if serves else "serves no DFlash drafter"
    others = [e for e in ENGINES if variant in e.methods]
    others.sort(key=lambda e: e.engine != engine)  # the same engine first, then the table's (oldest first) order
    where = f"serve it with {_ENGINE_NAMES[others[0].engine]} >= {others[0].version}"
    if "dflash" in entry.methods:
        where = f"export a dflash drafter (drafter.variant dflash) or {where}"
    raise ValueError(
        f"this export is a {_VARIANT_NAMES[variant]} drafter ({said_by}); {_label(entry)} {served}: {where}"
    )


def speculative_config(
    export_dir_or_config: str | Path, *, engine: str = "vllm", version: str = VLLM_CHECKED_VERSION,
) -> dict[str, Any]:
    """The `--speculative-config` of an export directory (or its config.json) on this engine release;
    ValueError if the release does not serve its variant or the export states another draft length."""
    path = Path(export_dir_or_config)
    config_path = path if path.name == "config.json" else path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist")
    config = json.loads(config_path.read_text())
    check_servable(config, engine=engine, version=version)
    block_size = config.get("block_size") or (config.get("dflash_config") or {}).get("block_size")
    if block_size is None:
        raise ValueError(f"{config_path} has no block_size (top level or dflash_config)")
    check_draft_lengths(config, block_size=block_size, source=str(config_path))
    return {
        "method": release(engine, version).methods[export_variant(config)[0]],
        "model": str(config_path.parent),
        "num_speculative_tokens": num_speculative_tokens(block_size),
    }
