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

from dflash_core.layout import QUARANTINE_SUFFIX, ArtifactKind, artifact_key, shard_name
from dflash_core.lineage import read_manifest
from dflash_core.storage import ObjectStore
from tests.unit.conftest_tokenize import MODEL_CACHE, jsonl, make_record


def put_shards(store: ObjectStore, settings, dataset: str, shards: list[bytes]) -> list[str]:
    keys = []
    for index, data in enumerate(shards):
        key = artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "run-a",
                           shard_name(index, suffix="jsonl"))
        store.put_bytes(key, data)
        keys.append(key)
    return keys


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
        return TokenizeParams(dataset=dataset, run="run-a", tokenizer_dir=tokenizer_dir, workers=2, **changes)
    return make


def test_flow_tokenizes_registers_lineage_and_reruns_only_what_changed(prefect_server, store, env_settings, params_for):
    from prefect.client.orchestration import get_client

    from flows.tokenize import tokenize

    dataset = f"tok-{uuid.uuid4().hex[:8]}"
    inputs = put_shards(store, env_settings, dataset, [shard(0), shard(1) + b"{broken\n", shard(2)])
    first = tokenize(params_for(dataset))
    assert len(first["outputs"]) == 3 and first["gate"] == []
    assert first["overall"]["samples"] == 18 and first["overall"]["skipped"] == 1
    manifests = {key: read_manifest(store, key) for key in first["outputs"]}
    for input_key, (key, manifest) in zip(inputs, manifests.items()):
        assert [ref.uri for ref in manifest.inputs] == [store.uri(input_key)]
        assert manifest.inputs[0].sha256 == store.head(input_key).sha256
        assert manifest.kind == ArtifactKind.TOKENIZED and manifest.producer.task_run_id
    quarantine = store.get_bytes(first["outputs"][1] + QUARANTINE_SUFFIX).decode().splitlines()
    assert [json.loads(line)["reason"] for line in quarantine] == ["malformed_json"]
    assert json.loads(quarantine[0])["line"] == 7 and json.loads(quarantine[0])["text"] == "{broken"
    assert not store.exists(first["outputs"][0] + QUARANTINE_SUFFIX)

    async def artifact_keys():
        async with get_client() as client:
            return {artifact.key for artifact in await client.read_artifacts()}
    assert {"tokenize-stats", "tokenize-report", "tokenize-loss-histogram"} <= asyncio.run(artifact_keys())

    # Unchanged rerun: every shard comes from the cache, no output is rewritten.
    tokenize(params_for(dataset))
    assert {k: read_manifest(store, k).created_at for k in first["outputs"]} == \
        {k: m.created_at for k, m in manifests.items()}

    # One shard changes: only it is re-tokenized (its input hash flows into the new manifest).
    store.put_bytes(inputs[2], shard(2, count=4))
    third = tokenize(params_for(dataset))
    after = {key: read_manifest(store, key) for key in third["outputs"]}
    changed = [key for key in after if after[key].created_at != manifests[key].created_at]
    assert changed == [first["outputs"][2]]
    assert after[first["outputs"][2]].inputs[0].sha256 == store.head(inputs[2]).sha256
    assert third["overall"]["samples"] == 16

    # A deleted output is rebuilt, not replayed from the cache.
    store.delete_many([first["outputs"][0]])
    tokenize(params_for(dataset))
    assert store.exists(first["outputs"][0])
    assert read_manifest(store, first["outputs"][0]).created_at != manifests[first["outputs"][0]].created_at


def test_quality_gate_fails_an_empty_dataset_unless_overridden(prefect_server, store, env_settings, params_for):
    from dflash_core.tokenize import QualityGateError
    from flows.tokenize import tokenize

    dataset = f"empty-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0, content="")])
    state = tokenize(params_for(dataset), return_state=True)
    assert state.is_failed()
    with pytest.raises(QualityGateError, match=r"100% of samples have <= 8 loss tokens: completions look empty"):
        state.result()
    result = tokenize(params_for(dataset, override_quality_gate=True))
    assert any("boilerplate" in message for message in result["gate"])
