"""engines.py: which engine release serves which drafter variant, and the speculative config of an export.

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_export_engines.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dflash_core.export import export_drafter
from dflash_core.export.engines import ENGINES, VLLM_CHECKED_VERSION, check_servable, speculative_config
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import DFlash2Config
from dflash_core.target import tiny_target_config

_DOCS = Path(__file__).resolve().parents[2] / "docs" / "drafter.md"


def _export(tmp_path: Path, *, block_size: int, dflash2: bool = False) -> dict[str, Path]:
    """Both formats of a tiny drafter, written by our exporter."""
    target_config = tiny_target_config("qwen3", num_layers=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=2, block_size=block_size, num_tapped_layers=2)
    if dflash2:
        config = DFlash2Config.from_dflash(config, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                           selector_top_k=4)
    return export_drafter(build_drafter(config), target_config=target_config, out_dir=tmp_path,
                          verifier_name_or_path="/models/target")


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("form", ["native", "speculators"])
def test_speculative_config_drafts_block_size_minus_one(tmp_path, block_size, form):
    path = _export(tmp_path, block_size=block_size)[form]
    want = {"method": "dflash", "model": str(path), "num_speculative_tokens": block_size - 1}
    assert speculative_config(path) == want
    assert speculative_config(path / "config.json") == want
    assert speculative_config(path, version="0.34.0") == want


@pytest.mark.parametrize("form", ["native", "speculators"])
def test_dflash2_is_refused_by_name_on_vllm_0_26(tmp_path, form):
    path = _export(tmp_path, block_size=8, dflash2=True)[form]
    said_by = "DFlash2DraftModel" if form == "native" else "speculators_model_type dflash2"
    message = (rf"this export is a DFlash 2 drafter \({said_by}\); vLLM 0\.26\.0 serves DFlash only: export a "
               r"dflash drafter \(drafter\.variant dflash\) or serve it with vLLM >= 0\.34\.0")
    with pytest.raises(ValueError, match=message):
        check_servable(json.loads((path / "config.json").read_text()), engine="vllm", version="0.26.0")
    with pytest.raises(ValueError, match=message):
        speculative_config(path)
    assert speculative_config(path, version="0.34.0") == {
        "method": "dflash2", "model": str(path), "num_speculative_tokens": 7}


def test_sglang_on_the_registry_serves_neither_and_says_which_vllm_does(tmp_path):
    paths = {False: _export(tmp_path / "d", block_size=4)["native"],
             True: _export(tmp_path / "d2", block_size=4, dflash2=True)["native"]}
    for dflash2, path in paths.items():
        with pytest.raises(ValueError, match=rf"SGLang 0\.5\.10\.post1 serves no DFlash drafter: serve it with "
                                             rf"vLLM >= {'0.34.0' if dflash2 else '0.26.0'}"):
            speculative_config(path, engine="sglang", version="0.5.10.post1")


def test_unknown_releases_and_a_wrong_draft_length_are_refused(tmp_path):
    path = _export(tmp_path, block_size=4)["native"]
    with pytest.raises(ValueError, match="no entry for vllm 0.99.0 .*vllm 0.26.0"):
        speculative_config(path, version="0.99.0")
    data = json.loads((path / "config.json").read_text())
    data["n_predict"] = 15
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config\.json: n_predict is 15, but block_size 4 .* = 3"):
        speculative_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        speculative_config(tmp_path / "nowhere")


def test_the_docs_table_is_the_engines_table():
    """docs/drafter.md's serving table: one row per release, with the methods engines.py gives."""
    docs = _DOCS.read_text()
    rows = [line for line in docs.splitlines()
            if line.startswith("| ") and ("vLLM " in line or "SGLang " in line)]
    names = {"vllm": "vLLM", "sglang": "SGLang"}
    assert len(rows) == len(ENGINES)
    for entry, row in zip(ENGINES, rows):
        assert row.startswith(f"| {names[entry.engine]} {entry.version} |"), row
        for method in entry.methods.values():
            assert f'"method": "{method}"' in row, row
    assert VLLM_CHECKED_VERSION in docs and "num_speculative_tokens = block_size - 1" in docs
