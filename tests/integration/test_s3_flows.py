"""The s3-audit and s3-cleanup flows on the real Prefect and S3 servers: reports and Prefect artifacts
(table, markdown, bar chart, lineage table), then a reviewed plan run as a dry run and for real.

Run: `.venv/bin/python -m pytest tests/integration/test_s3_flows.py -q`
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from dflash_core.lineage import read_manifest
from dflash_core.s3audit import Retention
from dflash_core.storage import ObjectStore
from tests.integration.test_s3_audit import plant


def _artifacts(flow_run_id: str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read():
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            return {a.key: a for a in found}
    return asyncio.run(read())


def test_audit_flow_publishes_reports_and_artifacts_then_cleanup_runs_the_reviewed_plan(
        prefect_server, store: ObjectStore, env_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.s3 import S3AuditParams, S3CleanupParams, s3_audit, s3_cleanup

    p = plant(store)
    monkeypatch.setenv("DFLASH_S3_PREFIXES", json.dumps({str(k): v for k, v in p.prefixes.items()}))
    time.sleep(1.1)  # every planted object is older than "now" (abandoned_after_days=0 below)
    retention = Retention(keep_checkpoints=2, abandoned_after_days=0)
    state = s3_audit(S3AuditParams(prefix=f"{p.root}/", retention=retention), return_state=True)
    summary = state.result()
    assert summary["dead_objects"] == 15 and summary["unmanifested"] == 4 and summary["orphan_manifests"] == 1
    assert summary["hash_problems"] == 1
    records = {r["uri"]: r for r in summary["artifacts"]}  # what it stored, for a downstream deployment
    assert {summary["report"], summary["plan"]} <= set(records)
    assert records[summary["plan"]]["sha256"] == read_manifest(store, summary["plan"].split("/", 3)[3]).sha256
    artifacts = _artifacts(str(state.state_details.flow_run_id))
    assert {"s3-audit-by-kind", "s3-audit-summary", "s3-audit-bytes-by-kind", "s3-audit-lineage"} <= set(artifacts)
    assert "| → |" in artifacts["s3-audit-lineage"].data and "flowchart" not in artifacts["s3-audit-lineage"].data
    assert "abandoned-prefix" in artifacts["s3-audit-summary"].data
    assert artifacts["s3-audit-bytes-by-kind"].data.startswith("data:image/png;base64,")  # embedded, not a link
    key_id = env_settings.s3_access_key_id.get_secret_value()
    assert not any(key_id in str(a.data) or "X-Amz-Signature" in str(a.data) for a in artifacts.values())
    assert {row["kind"] for row in json.loads(artifacts["s3-audit-by-kind"].data)} >= {"checkpoint", "unknown"}
    plan_key = summary["plan"].removeprefix(store.uri(""))
    assert read_manifest(store, plan_key).kind == "report"
    png_key = plan_key.replace("plan.json", "bytes-by-kind.png")
    assert store.get_bytes(png_key).startswith(b"\x89PNG")

    dry = s3_cleanup(S3CleanupParams(plan_uri=summary["plan"]))
    assert dry == {"dry_run": True, "candidates": 15, "bytes": dry["bytes"]} and store.exists(p.hidden_states[0])
    done = s3_cleanup(S3CleanupParams(plan_uri=summary["plan"], confirm=True))
    assert done["deleted"] == 15 and done["failed"] == 0
    assert not store.exists(p.hidden_states[0]) and store.exists(p.referenced_hidden_state)
    record = read_manifest(store, done["record"].removeprefix(store.uri("")))
    assert [ref.uri for ref in record.inputs] == [summary["plan"]]
    body = json.loads(store.get_bytes(record.key))
    assert "via flow run" in body["who"] and len(body["deleted"]) == 15
