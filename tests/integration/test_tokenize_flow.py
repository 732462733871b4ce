"""The tokenize flow against the real S3 and Prefect servers: outputs with manifests whose inputs are
the completion shards, quarantine beside the output, stats artifacts, the quality gate, and reruns
that redo only the changed (or deleted) shard.

Run: .venv/bin/python -m pytest -q tests/integration/test_tokenize_flow.py
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from dflash_core.data.verdict import PENDING, DatasetManifest, UnusableData
from dflash_core.layout import QUARANTINE_SUFFIX, ArtifactKind, artifact_key, shard_name
from dflash_core.lineage import read_manifest
from dflash_core.storage import ObjectStore
from dflash_core.tokenize import arrow_bytes, read_arrow_bytes
from dflash_core.train.inputs import fetch_shards
from tests.unit.conftest_tokenize import MODEL_CACHE, jsonl, make_record


def put_shards(store: ObjectStore, settings, dataset: str, shards: list[bytes]) -> list[str]:
    keys = []
    for index, data in enumerate(shards):
        key = artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "run-a",
                           shard_name(index, suffix="jsonl"))
        store.put_bytes(key, data)
        keys.append(key)
    return keys


def outputs(result) -> list[str]:
    """The keys of every shard a tokenize result names, training then held-out."""
    return [s.uri.split("/", 3)[3] for s in result.train_shards + result.heldout_shards]


def shard(index: int, count: int = 6, **fields) -> bytes:
    return jsonl(*[make_record(id=f"s{index}-{i}", source="unit", reasoning=None,
                               content=fields.get("content", f"Answer {i} of shard {index}, in a few words."),
                               generation={"model": "unit"}) for i in range(count)])


@pytest.fixture
def params_for(settings):
    from dflash_core.embedded import embedded_tokenizer_dir
    from dflash_core.tokenize import GateThresholds
    from flows.tokenize import TokenizeParams

    tokenizer_dir = str(embedded_tokenizer_dir(MODEL_CACHE))  # converted once, shared with the unit tests

    def make(dataset: str, **changes) -> TokenizeParams:
        # One bad line in 19 is on purpose: allow it past the skipped-lines threshold.
        changes.setdefault("gate", GateThresholds(max_skipped_fraction=0.1))
        completions = f"s3://{settings.s3_bucket}/completions/{dataset}/run-a/"  # a completion run's prefix
        return TokenizeParams(completions=completions, tokenizer_dir=tokenizer_dir, workers=2, **changes)
    return make


def test_flow_tokenizes_registers_lineage_and_reruns_only_what_changed(prefect_server, store, env_settings, params_for):
    from prefect.client.orchestration import get_client

    from flows.tokenize import tokenize

    dataset = f"tok-{uuid.uuid4().hex[:8]}"
    inputs = put_shards(store, env_settings, dataset, [shard(0), shard(1) + b"{broken\n", shard(2)])
    first = tokenize(params_for(dataset))
    first_outputs = outputs(first)
    assert len(first_outputs) == 3 and first.gate == [] and first.quality_gate == "passed"
    # The verdict is part of the data: dataset.json beside the shards, and the trainer accepts them.
    gated = DatasetManifest.model_validate_json(store.get_bytes(first_outputs[0].rsplit("/", 1)[0] + "/dataset.json"))
    assert gated.gate.verdict == "passed" and set(gated.shards) == {k.rsplit("/", 1)[-1] for k in first_outputs}
    assert len(fetch_shards([first_outputs[0].rsplit("/", 1)[0] + "/"], store=store,
                            cache_dir=env_settings.work_path("test-cache"))) == 3
    assert first.overall["samples"] == 18 and first.overall["skipped"] == 1
    manifests = {key: read_manifest(store, key) for key in first_outputs}
    for input_key, (key, manifest) in zip(inputs, manifests.items()):
        assert [ref.uri for ref in manifest.inputs] == [store.uri(input_key)]
        assert manifest.inputs[0].sha256 == store.head(input_key).sha256
        assert manifest.kind == ArtifactKind.TOKENIZED and manifest.producer.task_run_id
    quarantine = store.get_bytes(first_outputs[1] + QUARANTINE_SUFFIX).decode().splitlines()
    assert [json.loads(line)["reason"] for line in quarantine] == ["malformed_json"]
    assert json.loads(quarantine[0])["line"] == 7 and json.loads(quarantine[0])["text"] == "{broken"
    assert not store.exists(first_outputs[0] + QUARANTINE_SUFFIX)

    async def artifact_keys():
        async with get_client() as client:
            return {artifact.key for artifact in await client.read_artifacts()}
    # Keyed by dataset/run: another dataset's run never replaces this one's table.
    assert {f"{kind}-{dataset}-run-a" for kind in ("tokenize-stats", "tokenize-report", "tokenize-loss-histogram")} \
        <= asyncio.run(artifact_keys())
    # The result lists the records of what the run stored: every shard, dataset.json, the reports.
    records = {record["uri"]: record for record in first.artifacts}
    assert {store.uri(key) for key in first_outputs} | {first.dataset_manifest, first.stats, first.result_uri} \
        <= set(records)
    for uri, record in records.items():
        manifest = read_manifest(store, uri.removeprefix(f"s3://{store.bucket}/"))
        assert record == {"uri": uri, "kind": manifest.kind.value, "sha256": manifest.sha256,
                          "manifest": uri + ".manifest.json"}
    assert first.stats.endswith(f"/reports/tokenize/{dataset}/run-a/{first.flow_run}/attempt-1/stats.json")
    # The result is stored beside the report: a stage started alone takes its URI.
    from dflash_core.stage_results import TokenizedDataset, parse_result

    assert parse_result(store.get_bytes(store.key_of(first.result_uri)), TokenizedDataset, name="r") == \
        first.model_copy(update={"artifacts": first.artifacts[:-1]})

    # Unchanged rerun: every shard comes from the cache, no output is rewritten.
    tokenize(params_for(dataset))
    assert {k: read_manifest(store, k).created_at for k in first_outputs} == \
        {k: m.created_at for k, m in manifests.items()}
    # refresh=true (how a finished run is rerun): every shard is tokenized again, the cache ignored.
    refreshed = tokenize(params_for(dataset, refresh=True))
    assert all(read_manifest(store, k).created_at != manifests[k].created_at for k in first_outputs)
    assert [s.sha256 for s in refreshed.train_shards] == [s.sha256 for s in first.train_shards]
    manifests = {key: read_manifest(store, key) for key in first_outputs}

    # One shard changes: only it is re-tokenized (its input hash flows into the new manifest).
    store.put_bytes(inputs[2], shard(2, count=4))
    third = tokenize(params_for(dataset))
    after = {key: read_manifest(store, key) for key in outputs(third)}
    changed = [key for key in after if after[key].created_at != manifests[key].created_at]
    assert changed == [first_outputs[2]]
    assert after[first_outputs[2]].inputs[0].sha256 == store.head(inputs[2]).sha256
    assert third.overall["samples"] == 16

    # A shard rewritten outside the flow (or after its gate ran) has no verdict until the gate runs again.
    prefix = first_outputs[0].rsplit("/", 1)[0] + "/"
    table = read_arrow_bytes(store.get_bytes(first_outputs[1]))
    store.put_bytes(first_outputs[1], arrow_bytes(table.slice(1), metadata=PENDING.arrow_metadata()))
    with pytest.raises(UnusableData, match=r"shard-00001.arrow: no quality-gate verdict \(written by the tokenize "
                                           r"flow, but no dataset.json beside it judged it \(it is not among"):
        fetch_shards([prefix], store=store, cache_dir=env_settings.work_path("test-cache"))

    # A deleted output is rebuilt, not replayed from the cache.
    store.delete_many([first_outputs[0]])
    tokenize(params_for(dataset))
    assert store.exists(first_outputs[0])
    assert read_manifest(store, first_outputs[0]).created_at != manifests[first_outputs[0]].created_at


def test_quality_gate_fails_an_empty_dataset_unless_overridden(prefect_server, store, env_settings, params_for):
    from dflash_core.tokenize import QualityGateError
    from flows.tokenize import tokenize

    dataset = f"empty-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0, content="")])
    state = tokenize(params_for(dataset), return_state=True)
    assert state.is_failed()
    with pytest.raises(QualityGateError, match=r"100% of samples have <= 8 loss tokens: completions look empty"):
        state.result()
    # A failed run's shards stay where training reads them, marked failed: the trainer refuses them by name.
    shard_key = artifact_key(env_settings.s3_prefixes, ArtifactKind.TOKENIZED, dataset, "run-a", "shard-00000.arrow")
    gated = DatasetManifest.model_validate_json(store.get_bytes(shard_key.rsplit("/", 1)[0] + "/dataset.json"))
    assert gated.gate.verdict == "failed" and "max_short_fraction" in {c.check for c in gated.gate.failed_checks}
    with pytest.raises(UnusableData, match=rf"{store.uri(shard_key)}: quality gate failed \(dataset.json of "
                                           rf"{dataset}/run-a\): .*max_short_fraction: .*100% of samples"):
        fetch_shards([shard_key], store=store, cache_dir=env_settings.work_path("test-cache"))
    result = tokenize(params_for(dataset, override_quality_gate=True))
    assert any("boilerplate" in message for message in result.gate)
    assert result.quality_gate == "failed", "a tokenize-time override finishes the flow; the data stays failed"
    gated = DatasetManifest.model_validate_json(store.get_bytes(shard_key.rsplit("/", 1)[0] + "/dataset.json"))
    assert gated.gate.overridden and gated.gate.verdict == "failed"


def test_duplicate_ids_fail_the_gate(prefect_server, store, env_settings, params_for):
    from flows.tokenize import tokenize

    dataset = f"dup-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0), shard(0)])  # the same completions twice
    state = tokenize(params_for(dataset), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"all datasets: 6 samples repeat the id of another sample"):
        state.result()


def run_logs(flow_run_id, timeout_s: float = 90.0) -> list:
    """Every log record of a flow run, once its last one ("Finished in state ...") has reached the server.

    Logs travel to the server in batches from a background worker; on a loaded 2-core CI machine a batch
    once took longer than 20 s, so drain this process's worker first and then wait generously.
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            if any(log.message.startswith("Finished in state") for log in logs):
                return logs
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {flow_run_id}: no 'Finished in state' log after {timeout_s:.0f} s; "
                                     f"got {[log.message[:60] for log in logs]}")
            time.sleep(0.5)


def test_a_gate_failure_logs_one_clear_error_and_a_retry_keeps_both_reports(prefect_server, store, env_settings,
                                                                            params_for):
    from prefect.client.orchestration import get_client

    from flows.tokenize import tokenize

    dataset = f"retry-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0, content="")])
    failed = tokenize(params_for(dataset), return_state=True)
    assert failed.is_failed()
    flow_run_id = failed.state_details.flow_run_id
    # One error record: the dataset, the failed check and what to do; no traceback anywhere.
    logs = run_logs(flow_run_id)
    [error] = [log for log in logs if log.level >= 40]
    assert f"dataset {dataset}/run-a (s3://{store.bucket}/tokenized/{dataset}/run-a/) failed the quality gate" \
        in error.message
    assert "max_short_fraction" in error.message and "override_quality_gate" in error.message
    assert not any("Traceback" in log.message for log in logs)

    # The fix, then the same flow run again (what Retry does): the failed attempt's report stays.
    put_shards(store, env_settings, dataset, [shard(0)])
    from prefect.flow_engine import run_flow

    from flows.deployments import retry_flow_run

    with get_client(sync_client=True) as client:
        retry_flow_run(client, flow_run_id)
        flow_run = client.read_flow_run(flow_run_id)
    retried = run_flow(tokenize, flow_run=flow_run, parameters={"params": params_for(dataset)}, return_type="state")
    assert retried.is_completed(), retried
    prefix = f"reports/tokenize/{dataset}/run-a/{flow_run_id}/"
    reports = sorted(i.key for i in store.list(prefix) if i.key.endswith("/stats.json"))
    assert reports == [f"{prefix}attempt-1/stats.json", f"{prefix}attempt-2/stats.json"]
    assert json.loads(store.get_bytes(reports[0]))["quality_gate"] == "failed"
    assert json.loads(store.get_bytes(reports[1]))["quality_gate"] == "passed"
