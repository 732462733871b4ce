"""The served stage's refusals before any engine starts, on the real Prefect and S3 servers: a DFlash 2 export on
vLLM 0.26.0 (named, with the release that serves it), an interpreter without vLLM, an export format the export
stage did not make. The engine's version is read from vLLM 0.26.0's own wheel metadata (the wheel infra/setup.sh
downloads), installed for a separate interpreter as its dist-info only: nothing here can start a server.

Run: .venv/bin/python -m pytest tests/integration/test_served_flow.py -q
"""

from __future__ import annotations

import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from dflash_core.export import export_drafter
from dflash_core.stage_results import ExportResult

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vllm_0_26_python(tmp_path_factory) -> str:
    """An interpreter (a wrapper of this one) whose environment has vLLM 0.26.0's distribution metadata."""
    from dflash_core.export.engines import VLLM_CHECKED_VERSION

    wheels = sorted((REPO / ".venv" / "share" / "vllm-wheel").glob(f"vllm-{VLLM_CHECKED_VERSION}-*.whl"))
    assert wheels, "vLLM's wheel is missing from .venv/share/vllm-wheel: run `bash infra/setup.sh`"
    site = tmp_path_factory.mktemp("vllm-metadata")
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in wheel.namelist():
            if name.startswith(f"vllm-{VLLM_CHECKED_VERSION}.dist-info/"):
                wheel.extract(name, site)
    wrapper = site / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def _export(tmp_path: Path, variant: str) -> ExportResult:
    from dflash_core.model import DFlashConfig
    from dflash_core.model.build import build_drafter
    from dflash_core.model.dflash2 import drafter_config
    from dflash_core.train.inputs import load_target_model

    target = load_target_model("tiny:qwen3", device=torch.device("cpu"), models_dir=tmp_path, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target.config, num_layers=1, block_size=4, num_tapped_layers=2)
    config = drafter_config(variant, config, **({"selector_rank": 8} if variant == "dflash2" else {}))
    dirs = export_drafter(build_drafter(config), target_config=target.config, out_dir=tmp_path / "export",
                          formats=("native",))
    return ExportResult(checkpoint="unused", exports={"native": str(dirs["native"])})


def test_a_dflash2_export_is_refused_by_name_before_any_server(prefect_server, env_settings, tmp_path,
                                                              vllm_0_26_python) -> None:
    from flows.served import ServedParams, served

    params = ServedParams(export=_export(tmp_path, "dflash2"), format="native", python=vllm_0_26_python,
                          run=tmp_path.name)
    state = served(params, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "DFlash 2 drafter (DFlash2DraftModel)" in message and "vLLM 0.26.0 serves DFlash only" in message
    assert ">= 0.34.0" in message
    assert not (Path(env_settings.work_dir) / "served" / tmp_path.name / "servers").exists()  # no server started


def test_an_interpreter_without_vllm_and_a_missing_format_are_named(prefect_server, env_settings, tmp_path) -> None:
    from flows.served import ServedParams, served

    export = _export(tmp_path, "dflash")
    state = served(ServedParams(export=export, format="native", python=sys.executable, run=tmp_path.name),
                   return_state=True)
    assert state.is_failed() and f"no vLLM for {sys.executable}" in str(state.result(raise_on_failure=False))
    state = served(ServedParams(export=export, format="speculators", run=tmp_path.name), return_state=True)
    assert state.is_failed()
    assert "has no speculators format (it has ['native'])" in str(state.result(raise_on_failure=False))
