"""The main flow against the real Prefect server and the real S3 server.

Run: `.venv/bin/python -m pytest tests/integration/test_pipeline_flow.py -q`
"""

from __future__ import annotations

import asyncio

import pytest

from dflash_core.lineage import read_manifest
from dflash_core.storage import ObjectStore


def test_pipeline_flow_writes_verified_report_and_artifacts(prefect_server, store: ObjectStore, env_settings):
    from prefect.client.orchestration import get_client

    from flows.pipeline import PipelineParams, pipeline

    state = pipeline(PipelineParams(), return_state=True)  # the real pipeline's form, empty: the plan only
    assert state.is_completed(), state
    result = state.result()
    key = result.report.removeprefix(f"s3://{store.bucket}/")
    manifest = read_manifest(store, key)
    assert manifest.sha256 == result.sha256
    assert manifest.producer.flow_run_id == str(state.state_details.flow_run_id)
    assert manifest.producer.task_run_id is not None
    assert manifest.config["target_preset"] == "smollm2-135m"
    assert "colocated" in result.fits

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    keys = {artifact.key for artifact in asyncio.run(artifacts())}
    assert {"capacity-plan-smollm2-135m", "plan-report"} <= keys
    assert result.artifacts[0] == {"uri": manifest.uri, "kind": "report", "sha256": manifest.sha256,
                                   "manifest": manifest.uri + ".manifest.json"}
    assert result.artifacts[1]["uri"].endswith("/usage.json")  # the run's S3 usage, on every pipeline run
    assert manifest.producer.git_sha == pipeline.version


def test_pipeline_refuses_a_layout_that_does_not_fit(prefect_server, env_settings):
    from flows.pipeline import PipelineParams, pipeline

    state = pipeline(PipelineParams(target_preset="qwen3-32b", gpu_memory_gib=24), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="no GPU layout fits"):
        state.result()
