"""The run graph's edges into a stage, on the real Prefect server: only the stage results given as the
stage's own inputs draw one. An export takes the train stage's Checkpoint, which carries the tokenized
dataset it was trained on; that dataset is train's input, so tokenize -> export is no edge. Inside the pipeline's
own run, the settings every task takes draw no edge.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_stage_edges.py`
"""

from __future__ import annotations


def test_only_the_stage_results_given_as_inputs_draw_an_edge(prefect_server):
    from prefect import Task, flow
    from prefect.client.orchestration import get_client

    from dflash_core.stage_results import Checkpoint, StoredShard, TokenizedDataset
    from flows.demo import demo_training
    from flows.deployments import _upstream_stage_runs
    from flows.export import ExportParams

    @flow(name="edges-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        pipeline = client.create_flow_run(probe)

        def stage(name: str):
            """A stage's flow run as run_stage makes it: started by a stand-in task run of the pipeline."""
            stand_in = client.create_task_run(task=Task(fn=lambda: None, name=name), flow_run_id=pipeline.id,
                                              dynamic_key=name)
            return client.create_flow_run(probe, parent_task_run_id=stand_in.id, name=name)

        tokenized, trained = stage("tokenize"), stage("train")
        dataset = TokenizedDataset(dataset="d", run="r", train_shards=[StoredShard(uri="s3://b/t/0.arrow", sha256="0")],
                                   dataset_manifest="s3://b/t/dataset.json", quality_gate="passed",
                                   flow_run=str(tokenized.id))
        checkpoint = Checkpoint(uri="s3://b/checkpoints/r/step-000001", run_name="r", step=1, target="embedded",
                                dataset=dataset, flow_run=str(trained.id))

        assert _upstream_stage_runs(client, ExportParams(checkpoint=checkpoint), pipeline.id) == [trained.id]
        # given as a stage's own input (train's), the dataset draws its edge
        training = demo_training().model_copy(update={"dataset": dataset})
        assert _upstream_stage_runs(client, training, pipeline.id) == [tokenized.id]


def test_the_pipelines_tasks_draw_no_edge_through_the_settings_they_all_take(prefect_server, store, env_settings):
    """Prefect links a task's input to an earlier task's result by object identity, one level into the result and
    all the way into the input: publish_report's Manifest holds `ArtifactKind.REPORT`, a key of every Settings'
    s3_prefixes, so each later task given the settings drew an edge from publish_report. A pipeline with no stages
    on the real servers: no task's `settings` has an upstream, and stage_runs (settings and a flow run id) none."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import PipelineParams, pipeline

    state = pipeline(PipelineParams(), return_state=True)
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    inputs = {task.name.rsplit("-", 1)[0]: task.task_inputs for task in tasks}
    assert {"check_store", "publish_report", "stage_runs", "publish_usage", "publish_run_summary"} <= inputs.keys()
    assert {task.state_name for task in tasks} == {"Completed"}, [(task.name, task.state_name) for task in tasks]
    assert {name: given["settings"] for name, given in inputs.items() if given.get("settings")} == {}
    assert all(not upstream for upstream in inputs["stage_runs"].values()), inputs["stage_runs"]
