"""A rerun of the same prompt import on the real S3 server keeps the stored prompt set: every shard, the
import report and the quarantine file stay as the first run wrote them, manifests included, so the first
run stays their producer (its lineage and S3 usage keep their prompts). Changed content is written anew.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_prompt_reimport.py`
"""

from __future__ import annotations

import json
import uuid

from prefect.logging import disable_run_logger

from dflash_core.data.holdout import HoldoutSpec
from dflash_core.data.prompts import PromptSource
from dflash_core.layout import manifest_key
from dflash_core.lineage import read_manifest
from tasks.generate import import_prompt_set


def _prompts(count: int) -> bytes:
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(count)]
    return json.dumps([*records, {"text": "not a conversation"}]).encode()  # one quarantined record


def _stored(store, keys: list[str]) -> dict[str, tuple[str, bytes]]:
    """key -> (the object's ETag, its manifest's bytes)."""
    return {key: (store.head(key).etag, store.get_bytes(manifest_key(key))) for key in keys}


def test_a_rerun_of_the_same_import_keeps_the_prompt_set_and_its_producer(store, env_settings, tmp_path,
                                                                           monkeypatch):
    source = tmp_path / "prompts.json"
    source.write_bytes(_prompts(5))
    dataset = f"reimport-{uuid.uuid4().hex[:8]}"

    def run_import(flow_run_id: str) -> list[str]:
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", flow_run_id)  # what prefect.runtime reads outside a run
        with disable_run_logger():
            return import_prompt_set.fn(env_settings, sources=[PromptSource(source, "s")], dataset=dataset,
                                        version="v1", total=None, shard_size=2, seed=0,
                                        holdout=HoldoutSpec(count=1))

    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    keys = run_import(first)
    base = keys[0].rsplit("/", 1)[0] + "/import-report.json"
    every = [*keys, base, base + ".quarantine.jsonl"]
    before = _stored(store, every)
    assert {read_manifest(store, key).producer.flow_run_id for key in every} == {first}

    assert run_import(second) == keys
    assert _stored(store, every) == before, "a rerun with the same content rewrote the prompt set"

    source.write_bytes(_prompts(6))  # one more prompt: the content changes, so the import is written anew
    changed = run_import(second)
    assert second in {read_manifest(store, key).producer.flow_run_id for key in changed}
    assert read_manifest(store, base).producer.flow_run_id == second
