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
    result = state.result()
    assert result.outcomes["completed"] == 10 and result.outcomes["failed"] == 0
    # One of the ten held out (the default 5% of a source, at least one): a shard of its own.
    assert [s.split for s in result.shards] == ["train", "train", "train", "heldout"]
    assert len(result.heldout_prompt_ids) == 1
    ids = Counter()
    for shard in result.shards:
        for line in store.get_bytes(store.key_of(shard.uri)).splitlines():
            record = CompletionRecord.model_validate_json(line)
            ids[record.id] += 1
            assert [m.role for m in record.prompt] == ["user"], "assistant turns stripped"
            assert (record.id in result.heldout_prompt_ids) == (shard.split == "heldout")
    assert ids == Counter(f"q{i}" for i in range(10))
    # The result lists the records of what it stored (shards, the run's report and itself, keyed by flow run).
    flow_run_id = state.state_details.flow_run_id
    prefix = f"reports/generate/flowtest/{params.run}/{flow_run_id}/attempt-1"
    assert result.report == store.uri(f"{prefix}/summary.json")
    assert result.result_uri == store.uri(f"{prefix}/result.json") and result.flow_run == str(flow_run_id)
    records = {r["uri"]: r for r in result.artifacts}
    assert set(records) == {s.uri for s in result.shards} | {result.report, result.result_uri}
    for uri, record in records.items():
        assert record["sha256"] == read_manifest(store, store.key_of(uri)).sha256
    assert {s.uri: s.sha256 for s in result.shards} == {uri: records[uri]["sha256"] for uri in records
                                                          if "/completions/" in uri}
    report = json.loads(store.get_bytes(f"prompts/flowtest/{tmp_path.name}/import-report.json"))
    assert report["rejected"] == {"empty": 1, "malformed": 1, "truncated": 1}
    assert report["heldout"] == 1 and report["train"] == 9
    graph = build_lineage(store, "completions/flowtest/")
    manifest = read_manifest(store, store.key_of(result.shards[0].uri))
    assert manifest.inputs[0].uri.startswith(store.uri("prompts/flowtest/"))
    assert graph.manifests
    run_dir = env_settings.work_path("servers", params.run)
    assert not any(is_alive(i.record) for i in launcher.load_instances(run_dir)), "servers stopped"
    (run_dir / "instances.json").unlink()
    again = generate(params.model_copy(update={"prompt_sources": []}), return_state=True).result()
    assert again.outcomes["generated_now"] == 0 and again.shards == result.shards
    assert again.heldout_prompt_ids == result.heldout_prompt_ids
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


def test_failures_past_the_threshold_fail_the_flow(prefect_server, store, env_settings, tiny_model_dir,
                                                   tmp_path) -> None:
    from flows.generate import generate

    # A 1 ms request timeout: every prompt fails after the client's one attempt.
    params = _params(tmp_path, tiny_model_dir, canary_prompts=0,
                     client={"concurrency": 4, "max_attempts": 1, "request_timeout_s": 0.001})
    state = generate(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"10 of 10 prompts failed \(100.0%; max_failed_fraction 2.0%\).*"
                                        r"first errors: q\d: .*Timeout"):
        state.result()
    keys = [info.key for info in store.list(f"completions/flowtest/{params.run}/")]
    assert keys and all(".failures.jsonl" in key for key in keys), "an empty shard was registered"
    # The failed attempt's evidence stays, under its flow run and attempt.
    report_key = f"reports/generate/flowtest/{params.run}/{state.state_details.flow_run_id}/attempt-1/summary.json"
    assert json.loads(store.get_bytes(report_key))["verdict"].startswith("10 of 10 prompts failed")
    run_dir = env_settings.work_path("servers", params.run)
    assert not any(is_alive(i.record) for i in launcher.load_instances(run_dir)), "servers stopped"


def test_failures_within_the_threshold_only_warn() -> None:
    from dflash_core.serving.generation import GenerationFailed, ShardOutcome, failure_verdict

    outcomes = [ShardOutcome("c/shard-0", 100, 99, 1, 99, 500, first_errors=["p7: HTTP 500"]),
                ShardOutcome("c/shard-1", 100, 100, 0, 100, 500)]
    assert failure_verdict(outcomes[1:], max_failed_fraction=0.0) is None
    warning = failure_verdict(outcomes, max_failed_fraction=0.01)
    assert warning.startswith("1 of 200 prompts failed (0.5%; max_failed_fraction 1.0%)") and "p7: HTTP 500" in warning
    with pytest.raises(GenerationFailed, match="1 of 200 prompts failed"):
        failure_verdict(outcomes, max_failed_fraction=0.004)
