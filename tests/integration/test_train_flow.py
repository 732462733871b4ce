"""The training flow on the real Prefect and S3 servers: tokenized shards from S3 (config.data, no
tokenize result), a tiny target, checkpoints uploaded with manifests, curves and metrics as artifacts,
a Checkpoint record naming the shards trained on, resume on a second run. Evaluation and export of
the checkpoint it returns: tests/integration/test_dag.py.

Run: `.venv/bin/python -m pytest tests/integration/test_train_flow.py -q`
"""

from __future__ import annotations

import asyncio
import logging

import pyarrow as pa

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import build_lineage, read_manifest, write_artifact
from dflash_core.tokenize.io import arrow_bytes
from dflash_core.train.data import read_shard_table
from dflash_core.train.report import read_metrics
from tests.train_fixtures import SYNTHETIC_VERDICT, synthetic_shard


def test_train_flow_trains_from_s3_uploads_checkpoints_and_resumes(prefect_server, store, env_settings,
                                                                   tmp_path) -> None:
    from prefect.client.orchestration import get_client

    from flows.train import TrainFlowParams, train

    short = synthetic_shard(tmp_path / "short.arrow", num_samples=200, min_len=12, max_len=24)
    long = synthetic_shard(tmp_path / "long.arrow", num_samples=2, min_len=130, max_len=140, seed=1)
    shard = tmp_path / "shard.arrow"  # two samples longer than the 96-token rows: their tails are cropped
    shard.write_bytes(arrow_bytes(pa.concat_tables([read_shard_table(short), read_shard_table(long)]),
                                  metadata=SYNTHETIC_VERDICT))
    shard_key = f"tokenized/flowtest/{tmp_path.name}/shard-00000.arrow"
    write_artifact(store, shard_key, shard, kind=ArtifactKind.TOKENIZED)
    run_name = f"flow-{tmp_path.name}"[:60]
    config = {"run_name": run_name, "target": "tiny:llama", "data": [f"tokenized/flowtest/{tmp_path.name}/"],
              "output_dir": str(tmp_path / "runs"), "token_budget": 96, "max_steps": 4, "checkpoint_every": 2,
              "log_every": 2, "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}}
    state = train(TrainFlowParams(config=config), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    assert result.uri == store.uri(f"checkpoints/{run_name}/step-000004") and result.step == 4
    assert [(s.uri, s.sha256) for s in result.data] == [(store.uri(shard_key), store.head(shard_key).sha256)]
    assert result.dataset is None and result.target == "tiny:llama"
    assert store.get_bytes(store.key_of(result.run_yaml)).decode().startswith("run_name:")
    weights_key = f"checkpoints/{run_name}/step-000004/model.safetensors"
    manifest = read_manifest(store, weights_key)
    assert [ref.uri for ref in manifest.inputs if ref.role is None] == [store.uri(shard_key)]
    assert any("tiny:llama" in ref.uri for ref in manifest.inputs if ref.role)  # the target built in code
    assert manifest.producer.flow_run_id == str(state.state_details.flow_run_id)
    graph = build_lineage(store, f"checkpoints/{run_name}/")
    assert store.uri(shard_key) in graph.ancestors(store.uri(weights_key))

    async def warnings():  # the trainer's warning stands out in the flow run's log
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        async with get_client() as client:
            flow_run = LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
            return [log.message for log in await client.read_logs(log_filter=LogFilter(flow_run_id=flow_run))
                    if log.level == logging.WARNING]

    assert any(m.startswith("warning: 2 of 202 samples are longer than a row's 96 tokens and lose their tail") for m in asyncio.run(
        warnings())), "the cropped tails were not reported at WARNING level"

    async def artifacts():  # this flow run's and its evaluation subflow's
        async with get_client() as client:
            runs = {state.state_details.flow_run_id} | {
                r.id for r in await client.read_flow_runs() if r.parent_task_run_id is not None}
            return [a for a in await client.read_artifacts() if a.flow_run_id in runs]

    ours = {a.key: a for a in asyncio.run(artifacts())}
    assert {"training-metrics", "training-curves"} <= set(ours)
    assert str(ours["training-curves"].data).startswith("data:image/png;base64,"), "the PNG is embedded, no link"
    access_key = env_settings.s3_access_key_id.get_secret_value()
    leaked = [a.key for a in ours.values() if access_key in str(a.data) or "X-Amz-" in str(a.data)]
    assert not leaked, f"key material (a presigned URL) in the Prefect database: {leaked}"

    # A second run of the same config with more steps continues from step 4 instead of starting over.
    config["max_steps"] = 6
    again = train(TrainFlowParams(config=config), return_state=True)
    assert again.is_completed(), again
    steps = [r["step"] for r in read_metrics(tmp_path / "runs" / run_name / "metrics.jsonl")]
    assert steps == [2, 4, 6]
    assert store.exists(f"checkpoints/{run_name}/step-000006/meta.json")
