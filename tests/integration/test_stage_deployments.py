"""Every stage a deployment, against the real Prefect and S3 servers and the real stage server
(`python -m flows.serve`, as `dflash services up` starts it): the pipeline, started as a deployment
run the way `dflash demo` starts it, runs its stages as separate deployment runs; a stage that fails
for a fixable cause is retried alone (what the UI's Retry does), and a Retry of the pipeline then
reuses that stage's result instead of running it again. Results live in the bucket: the same stage
run again from another process, with another local result dir, is all cache hits.

Run: `.venv/bin/python -m pytest -q tests/integration/test_stage_deployments.py`
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.integration.test_tokenize_flow import put_shards, shard
from tests.unit.conftest_tokenize import MODEL_CACHE


@pytest.fixture(scope="module")
def stage_server(settings, s3_server, prefect_server):
    from dflash_core.services import local
    from dflash_core.services.stages import stage_service

    service = stage_service(settings)
    local.start(service)
    yield service
    local.shutdown(service)


def _wait_final(client, flow_run_id, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout_s} s")


def _children(client, parent_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("stage-target"), num_layers=4)


def test_a_failed_stage_is_retried_alone_and_the_pipeline_retry_reuses_it(stage_server, store, env_settings,
                                                                          monkeypatch, tmp_path, tiny_target):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    from dflash_core.embedded import embedded_tokenizer_dir
    from dflash_core.tokenize import GateThresholds
    from flows.deployments import deployment_for, retry_flow_run
    from flows.pipeline import PipelineParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    from dflash_core.services.stages import result_store_env

    for name, value in result_store_env(env_settings).items():  # S3 keys to read results from the bucket
        monkeypatch.setenv(name, value)
    dataset = f"stages-{uuid.uuid4().hex[:8]}"
    tokenization = TokenizeParams(completions=f"s3://{store.bucket}/completions/{dataset}/run-a/",
                                  tokenizer_dir=str(embedded_tokenizer_dir(MODEL_CACHE)),
                                  workers=1, gate=GateThresholds(max_skipped_fraction=0.1))
    training = TrainFlowParams(config={
        "run_name": dataset, "target": str(tiny_target), "output_dir": str(tmp_path / "runs"), "token_budget": 96,
        "max_steps": 2, "checkpoint_every": 2, "log_every": 1, "validate_capture_batches": 1,
        # selector_rank 8: the default 256 gives 2 x 49,152 x 256 codebook weights, a 290 MB checkpoint
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0,
                    "selector_rank": 8}})
    params = PipelineParams(tokenization=tokenization, training=training)
    with get_client(sync_client=True) as client:
        # The pipeline as `dflash demo` starts it: a run of its deployment, on the stage server.
        pipeline_run = run_deployment(deployment_for("pipeline"), parameters={"params": params.model_dump(mode="json")},
                                      timeout=0, as_subflow=False)
        pipeline_run = _wait_final(client, pipeline_run.id)
        assert pipeline_run.state.is_failed()  # no completions yet: a fixable cause
        [stage] = _children(client, pipeline_run.id)
        tokenize_deployment = client.read_deployment_by_name("dflash-tokenize/tokenize")
        assert stage.deployment_id == tokenize_deployment.id and stage.state.is_failed()
        assert "no completion shards" in stage.state.message
        assert pipeline_run.deployment_id is not None  # the pipeline itself has a Retry too

        put_shards(store, env_settings, dataset, [shard(0), shard(1)])  # the fix
        retry_flow_run(client, stage.id)  # the stage alone
        stage = _wait_final(client, stage.id)
        assert stage.state.is_completed(), stage.state
        assert stage.run_count == 2
        assert client.read_flow_run(pipeline_run.id).state.is_failed()  # untouched by the stage's retry

        retry_flow_run(client, pipeline_run.id)
        pipeline_run = _wait_final(client, pipeline_run.id, timeout_s=400)
        assert pipeline_run.state.is_completed(), pipeline_run.state
        again, trained = sorted(_children(client, pipeline_run.id), key=lambda run: run.start_time)
        assert again.id == stage.id and again.run_count == 2  # reused, not run a third time
        assert trained.deployment_id == client.read_deployment_by_name("dflash-train/train").id
        result = pipeline_run.state.result()
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

        # Another process (this one), another local result dir: every shard comes back Cached from S3.
        assert any(i.key.startswith("prefect-results/") for i in store.list("prefect-results/"))
        from prefect.settings import (PREFECT_LOCAL_STORAGE_PATH, PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK,
                                      temporary_settings)

        from dflash_core.services.stages import RESULTS_BLOCK
        from flows.tokenize import tokenize

        with temporary_settings(updates={PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK: RESULTS_BLOCK,
                                         PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
            rerun = tokenize(tokenization, return_state=True)
        assert rerun.is_completed(), rerun
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[rerun.state_details.flow_run_id])))
        shard_runs = [t for t in task_runs if t.name.startswith("tokenize ")]
        assert len(shard_runs) == 2 and {t.state.name for t in shard_runs} == {"Cached"}


def test_dflash_deploy_registers_the_same_deployments_as_the_stage_server(stage_server):
    """No collision: `dflash deploy` (register_deployments) and the stage server write the same table to
    the same pool, so registering again changes no id, pool, entrypoint or pull step."""
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
        run = _wait_final(client, run.id)
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
        run = _wait_final(client, run.id)
        [stage] = _children(client, run.id)
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
        time.sleep(1)
    assert len(errors) == 1 and errors[0].flow_run_id == stage.id, [(e.name, e.flow_run_id, e.message[:80]) for e in errors]
    assert f"dataset {dataset}/run-a" in errors[0].message and "max_short_fraction" in errors[0].message
    assert not any("Traceback" in log.message for log in logs)
