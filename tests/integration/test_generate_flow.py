"""The generate flow end to end on the real Prefect server, S3 server and `transformers serve`.

Run: `.venv/bin/python -m pytest tests/integration/test_generate_flow.py -q`
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dflash_core.data.completion import CompletionRecord
from dflash_core.lineage import build_lineage, read_manifest
from dflash_core.serving import launcher
from dflash_core.services.process import is_alive
from tests.conftest import free_port


def _sources(tmp_path) -> list[dict]:
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"q{i}", "conversations": [{"from": "human", "value": f"Count to {i}"},
                                              {"from": "gpt", "value": "1, 2"}]} for i in range(10)]
    rows += [{"conversations": [{"from": "gpt", "value": "no user turn"}]}, "not even an object"]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut")
    return [{"path": str(path), "name": "counting"}]


def _params(tmp_path, tiny_model_dir, **changes):
    from flows.generate import GenerateParams

    base = {
        "dataset": "flowtest", "prompts_version": tmp_path.name, "run": tmp_path.name,
        "prompt_sources": _sources(tmp_path), "shard_size": 4, "base_port": free_port(),
        "engine": {"engine": "transformers", "model": str(tiny_model_dir)},
        "sampling": {"max_tokens": 5, "temperature": 0.0, "enable_thinking": False},
        "client": {"concurrency": 4, "backoff_s": 0.1},
        "canary_prompts": 3, "canary": {"max_length_fraction": 1.0},  # a random model never says stop
    }
    return GenerateParams.model_validate({**base, **changes})


def test_generate_flow_imports_generates_and_stops(prefect_server, store, env_settings, tiny_model_dir,
                                                   tmp_path) -> None:
    from flows.generate import generate

    params = _params(tmp_path, tiny_model_dir)
    state = generate(params, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["completed"] == 10 and summary["failed"] == 0 and len(summary["shards"]) == 3
    ids = Counter()
    for uri in summary["shards"]:
        key = uri if not uri.startswith("s3://") else uri.split("/", 3)[3]
        for line in store.get_bytes(key).splitlines():
            record = CompletionRecord.model_validate_json(line)
            ids[record.id] += 1
            assert [m.role for m in record.prompt] == ["user"], "assistant turns stripped"
    assert ids == Counter(f"q{i}" for i in range(10))
    report = json.loads(store.get_bytes(f"prompts/flowtest/{tmp_path.name}/import-report.json"))
    assert report["rejected"] == {"empty": 1, "malformed": 1, "truncated": 1}
    graph = build_lineage(store, "completions/flowtest/") 
    manifest = read_manifest(store, summary["shards"][0])
    assert manifest.inputs[0].uri.startswith(store.uri("prompts/flowtest/"))
    assert graph.manifests
    run_dir = env_settings.work_path("servers", params.run)
    assert not any(is_alive(i.record) for i in launcher.load_instances(run_dir)), "servers stopped"
    (run_dir / "instances.json").unlink()
    again = generate(params.model_copy(update={"prompt_sources": []}), return_state=True).result()
    assert again["generated_now"] == 0 and again["shards"] == summary["shards"]
    assert not (run_dir / "instances.json").exists(), "nothing to generate: no server was started"


def test_failed_canary_stops_the_run_and_the_servers(prefect_server, store, env_settings, tiny_model_dir,
                                                     tmp_path) -> None:
    from flows.generate import generate

    params = _params(tmp_path, tiny_model_dir, sampling={"max_tokens": 5, "enable_thinking": True})
    state = generate(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="no reasoning although thinking mode is on"):
        state.result()
    run_dir = env_settings.work_path("servers", params.run)
    assert launcher.load_instances(run_dir) and not any(is_alive(i.record) for i in launcher.load_instances(run_dir))
    assert not list(store.list(f"completions/flowtest/{params.run}/"))
