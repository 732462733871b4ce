"""Every stage a deployment, against the real Prefect and S3 servers and the real stage server
(`python -m flows.serve`, as `dflash services up` starts it): the pipeline, started as a deployment
run the way `dflash demo` starts it, runs its stages as separate deployment runs; a stage that fails
for a fixable cause is retried alone (what the UI's Retry does), and a Retry of the pipeline then
reuses that stage's result instead of running it again. Results live in the bucket: the same stage
run again from another process, with another local result dir, is all cache hits. The retried pipeline
is `retried_pipeline` (tests/integration/shared_runs.py), whose run graph and evidence test_ui_browser.py
follows in a browser.

Run: `.venv/bin/python -m pytest -q tests/integration/test_stage_deployments.py`
"""

from __future__ import annotations

import time
import uuid

from tests.integration.shared_runs import children, wait_final
from tests.integration.test_tokenize_flow import put_shards, shard
from tests.unit.conftest_tokenize import MODEL_CACHE


def test_a_failed_stage_is_retried_alone_and_the_pipeline_retry_reuses_it(retried_pipeline, store, env_settings,
                                                                          monkeypatch, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey,
                                                FlowRunFilter, FlowRunFilterId)
    from prefect.client.schemas.sorting import ArtifactSort

    from dflash_core.services.stages import result_store_env

    for name, value in result_store_env(env_settings).items():  # S3 keys to read results from the bucket
        monkeypatch.setenv(name, value)
    run = retried_pipeline
    with get_client(sync_client=True) as client:
        # The pipeline as `dflash demo` starts it: a run of its deployment, on the stage server.
        assert run.first.state.is_failed()  # no completions yet: a fixable cause
        tokenize_deployment = client.read_deployment_by_name("dflash-tokenize/tokenize")
        assert run.first_stage.deployment_id == tokenize_deployment.id and run.first_stage.state.is_failed()
        assert "no completion shards" in run.first_stage.state.message
        assert run.first.deployment_id is not None  # the pipeline itself has a Retry too

        # the fix, then the stage alone retried
        assert run.retried_stage.state.is_completed(), run.retried_stage.state
        assert run.retried_stage.run_count == 2
        assert run.after_stage_retry.state.is_failed()  # untouched by the stage's retry

        pipeline_run = run.completed  # after its own Retry
        assert pipeline_run.state.is_completed(), pipeline_run.state
        again, trained = run.children
        assert again.id == run.first_stage.id and again.run_count == 2  # reused, not run a third time
        assert trained.deployment_id == client.read_deployment_by_name("dflash-train/train").id
        result = run.result
        assert result.tokenization.quality_gate == "passed" and len(result.tokenization.train_shards) == 2
        # train took tokenize's result: the edge the UI draws, and the shards in the checkpoint's manifest
        assert [(s.uri, s.sha256) for s in result.training.data] == \
            [(s.uri, s.sha256) for s in result.tokenization.train_shards]
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[pipeline_run.id])))
        assert sorted(t.task_key for t in task_runs if t.task_key.startswith("dflash.stage.")) == \
            ["dflash.stage.tokenize", "dflash.stage.train"], "a Retry reuses each stage's stand-in task run"
        stand_ins = {t.task_key: t for t in task_runs}
        train_inputs = stand_ins["dflash.stage.train"].task_inputs["params"]
        assert [i.id for i in train_inputs] == [again.id]  # the run graph's edge: tokenize's flow run -> train
        assert stand_ins["dflash.stage.tokenize"].id == again.parent_task_run_id
        assert trained.parent_task_run_id == stand_ins["dflash.stage.train"].id
        # The run's summary is of its last attempt: the stages as they ended, not as the first attempt saw them.
        summaries = client.read_artifacts(sort=ArtifactSort.CREATED_DESC, artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["pipeline-summary"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[pipeline_run.id])))
        last = summaries[0].data
        assert "| ↳ tokenize | Completed |" in last and "| ↳ train | Completed |" in last

        # Another process (this one), another local result dir: every shard comes back Cached from S3.
        assert any(i.key.startswith("prefect-results/") for i in store.list("prefect-results/"))
        from prefect.settings import (PREFECT_LOCAL_STORAGE_PATH, PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK,
                                      temporary_settings)

        from dflash_core.services.stages import RESULTS_BLOCK
        from flows.tokenize import tokenize

        with temporary_settings(updates={PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK: RESULTS_BLOCK,
                                         PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
            rerun = tokenize(run.tokenization, return_state=True)
        assert rerun.is_completed(), rerun
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[rerun.state_details.flow_run_id])))
        shard_runs = [t for t in task_runs if t.name.startswith("tokenize ")]
        assert len(shard_runs) == 2 and {t.state.name for t in shard_runs} == {"Cached"}


def test_dflash_deploy_registers_the_same_deployments_as_the_stage_server(stage_server, env_settings):
    """No collision: `dflash deploy` (register_deployments) and the stage server write the same table to
    the same pool, so registering again changes no id, pool, entrypoint or pull step. `env_settings`: the
    form defaults name the session's bucket, as the stage server's do (later tests run those forms)."""
    from prefect.client.orchestration import get_client

    from flows.deployment_table import DEPLOYMENTS, WORK_POOL
    from flows.deployments import PULL_STEPS, register_deployments

    def ours(client):
        return {d.name: d for d in client.read_deployments() if d.name in {s.name for s in DEPLOYMENTS}}

    with get_client(sync_client=True) as client:
        before = ours(client)
        registered = register_deployments()
        after = ours(client)
    assert set(before) == {s.name for s in DEPLOYMENTS} == set(after)
    assert {name.split("/")[1]: id_ for name, id_ in registered.items()} == {n: d.id for n, d in before.items()}
    for name, deployment in after.items():
        assert deployment.id == before[name].id and deployment.work_pool_name == WORK_POOL
        assert deployment.entrypoint == before[name].entrypoint and deployment.pull_steps == PULL_STEPS
        assert deployment.status.value == "READY", f"{name}: no worker polls it"


def test_the_export_deployment_exports_a_checkpoint(stage_server, store, env_settings, monkeypatch, prefix, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.lineage import read_manifest
    from dflash_core.services.stages import result_store_env
    from flows.deployments import deployment_for
    from flows.export import ExportParams
    from tests.integration.test_evaluate_flow import _checkpoint_in_s3

    for name, value in result_store_env(env_settings).items():
        monkeypatch.setenv(name, value)
    checkpoint_key, _ = _checkpoint_in_s3(store, prefix, tmp_path)
    run_name = f"export-{uuid.uuid4().hex[:8]}"
    params = ExportParams(checkpoint=checkpoint_key, run_name=run_name, target="tiny:qwen3", target_seed=3)
    run = run_deployment(deployment_for("export"), parameters={"params": params.model_dump(mode="json")}, timeout=0,
                         as_subflow=False)
    with get_client(sync_client=True) as client:
        run = wait_final(client, run.id)
    assert run.state.is_completed(), run.state
    result = run.state.result()
    assert set(result.exports) == {"native", "speculators"}
    config_key = f"exports/{run_name}/native/config.json"
    manifest = read_manifest(store, config_key)
    assert manifest.inputs[0].uri == store.uri(f"{checkpoint_key}/model.safetensors")
    assert manifest.producer.flow_run_id == str(run.id)
    records = {r["uri"]: r for r in result.artifacts}
    assert records[store.uri(config_key)] == {"uri": store.uri(config_key), "kind": "export", "sha256": manifest.sha256,
                                             "manifest": store.uri(config_key) + ".manifest.json"}


def test_a_gate_failure_in_the_pipeline_logs_one_error_and_no_traceback(stage_server, store, env_settings,
                                                                        monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.embedded import embedded_tokenizer_dir
    from flows.deployments import deployment_for
    from flows.pipeline import PipelineParams
    from flows.tokenize import TokenizeParams
    from tests.integration.test_tokenize_flow import run_logs

    dataset = f"gate-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0, content="")])  # empty answers: the gate refuses them
    tokenization = TokenizeParams(completions=f"s3://{store.bucket}/completions/{dataset}/run-a/",
                                  tokenizer_dir=str(embedded_tokenizer_dir(MODEL_CACHE)), workers=1)
    params = PipelineParams(tokenization=tokenization)
    run = run_deployment(deployment_for("pipeline"), parameters={"params": params.model_dump(mode="json")},
                         timeout=0, as_subflow=False)
    with get_client(sync_client=True) as client:
        run = wait_final(client, run.id)
        [stage] = children(client, run.id)
    assert run.state.is_failed() and stage.state.is_failed()
    assert "failed the quality gate" in run.state.message  # the pipeline says why, and where to retry
    # The stage's error record can reach the server after both runs' "Finished in state" lines (log
    # batches from the served subprocess; seen once on a loaded 2-core machine): wait for it a while.
    deadline = time.monotonic() + 60
    while True:
        logs = run_logs(run.id) + run_logs(stage.id)
        errors = [log for log in logs if log.level >= 40]
        if errors or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert len(errors) == 1 and errors[0].flow_run_id == stage.id, [(e.name, e.flow_run_id, e.message[:80]) for e in errors]
    assert f"dataset {dataset}/run-a" in errors[0].message and "max_short_fraction" in errors[0].message
    assert not any("Traceback" in log.message for log in logs)
