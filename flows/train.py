"""Train a drafter online on a tokenized dataset: check the data (the shards of the tokenize stage's
result, by sha256, and their quality gate) -> plan capacity (refuse what cannot fit) -> train (torchrun
subprocess; capture validated on the first batches; resumes from the latest checkpoint on retry) ->
report (curves, metrics, run.yaml and provenance.json to S3). The result is a `Checkpoint`
(dflash_core/stage_results.py) naming the shards it was trained on, which the evaluate and export
stages take as their input.

Run: `dflash run train --params '{"dataset": "s3://dflash/reports/tokenize/.../result.json", "config": {"target": "embedded"}}'`
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import InputRef
from dflash_core.nodes import Node
from dflash_core.settings import load_settings
from dflash_core.stage_results import RESULT_FILE, Checkpoint, TokenizedDataset
from dflash_core.strict import StrictModel
from dflash_core.train.config import TrainConfig
from dflash_core.train.launch_argv import Rendezvous
from flows.command_line import run_from_command_line
from flows.nodes import preserve_on_failure
from tasks.artifacts import artifact_record, publish_stored, target_inputs, ui_key
from tasks.data_gate import check_training_data, verify_shards
from tasks.provenance import attempt_segments, flow_version
from tasks.results import resolve_result, store_result
from tasks.train import plan_training, report_training, run_training, stored_checkpoint


class TrainFlowParams(StrictModel):
    dataset: TokenizedDataset | str | None = Field(None, description=(
        "What to train on: the tokenize stage's result (the pipeline passes it) or the S3 URI of its result.json. "
        "Its training shards are used, by sha256; its held-out shards never. Leave config.data empty with it."))
    config: TrainConfig = Field(description="The run schema: every hyperparameter. config.data only to train on "
                                            "shards without a tokenize result (local files, S3 keys).")
    nproc_per_node: int = Field(1, ge=1, description="Processes on this node: one per GPU (colocated) or per GPU "
                                "pair (placement=pair); >1 runs torchrun with DDP.")
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description=(
        "Several nodes: run this flow once per node with these torchrun rendezvous settings (identical on every "
        "node with c10d); checkpoints must reach every node (S3 upload or a shared output_dir)."))
    s3_outage_limit_s: float = Field(300.0, gt=0, description=(
        "How long checkpoint uploads may keep failing (S3 down) before the run fails; training goes on with "
        "local checkpoints meanwhile. Keep it below the process-group timeout (600 s) on several GPUs."))
    gpu_memory_gib: float = Field(139.0, gt=0, description="For the capacity check.")
    expected_samples: int = Field(100_000, gt=0, description="For the capacity check, without a dataset (with one, "
                                  "its tokenize stage's counts are used).")
    expected_mean_tokens: float = Field(2_000, gt=0, description="As expected_samples, mean tokens per sample.")
    node: Node | None = Field(None, description=(
        "The node this runs on (from the inventory): preserved (logs, configs, inventory to S3; nothing deleted) "
        "when the flow fails, crashes or is cancelled."))


def training_config(settings, params: TrainFlowParams) -> tuple[TrainConfig, TokenizedDataset | None]:
    """The run's config with its data (the dataset's training shards by URI, or config.data as given), and
    the dataset."""
    config = params.config.model_copy(update={"output_dir": params.config.output_dir.resolve()})
    if params.dataset is None:
        if not config.data:
            raise ValueError("no training data: pass dataset (the tokenize stage's result or its result.json URI), "
                             "or config.data (tokenized shards: local paths or S3 keys)")
        return config, None
    if config.data:
        raise ValueError(f"pass dataset or config.data, not both (config.data is {config.data[:3]})")
    dataset = resolve_result(settings, params.dataset, TokenizedDataset)
    if not dataset.train_shards:
        raise ValueError(f"dataset {dataset.dataset}/{dataset.run} has no training shards")
    return config.model_copy(update={"data": [s.uri for s in dataset.train_shards]}), dataset


def data_size(params: TrainFlowParams, dataset: TokenizedDataset | None) -> tuple[int, float]:
    """(samples, mean tokens) the fit check plans with: the tokenize stage's counts when it made the data
    (so the plan's passes over the data are the run's), else the form's estimates."""
    overall = dataset.overall if dataset is not None else {}
    samples, tokens = overall.get("samples") or 0, overall.get("total_tokens") or 0
    if samples > 0 and tokens > 0:
        return int(samples), tokens / samples
    return params.expected_samples, params.expected_mean_tokens


@flow(name="dflash-train", log_prints=True, persist_result=True, version=flow_version(),
      on_failure=[preserve_on_failure], on_cancellation=[preserve_on_failure], on_crashed=[preserve_on_failure])
def train(params: TrainFlowParams) -> Checkpoint | dict:
    settings = load_settings()
    config, dataset = training_config(settings, params)
    if dataset is not None:
        verify_shards(settings, dataset.train_shards)  # the bytes the tokenize stage made, not a later re-tokenization
    gpus_per_process = 2 if config.placement == "pair" else 1
    check_training_data(settings, config)  # refuses data whose quality gate failed, before torchrun starts
    samples, mean_tokens = data_size(params, dataset)
    plan_training(config, gpu_memory_gib=params.gpu_memory_gib, num_gpus=params.nproc_per_node * gpus_per_process,
                  samples=samples, mean_tokens=mean_tokens)
    checkpoint = run_training(config, nproc_per_node=params.nproc_per_node, flow_run_id=str(flow_run.id or ""),
                              rendezvous=params.rendezvous, s3_outage_limit_s=params.s3_outage_limit_s)
    if checkpoint is None:  # another node hosted global rank 0; its flow run carries on from here
        return {"checkpoint": None, "run_dir": str(config.run_dir), "node_rank": params.rendezvous.node_rank}
    report = report_training(settings, config, checkpoint=checkpoint)
    stored = stored_checkpoint(settings, config, checkpoint)
    records = [artifact_record(m) for m in report.manifests]
    if stored.uri.startswith("s3://"):
        records += publish_stored(settings, prefix=stored.uri, key=ui_key("checkpoint", config.run_name),
                                  title=f"checkpoint {config.run_name}/{Path(checkpoint).name}")
    result = stored.model_copy(update={
        "dataset": dataset, "metrics": report.metrics, "run_yaml": report.run_yaml, "provenance": report.provenance,
        "final_metrics": report.final_metrics, "flow_run": str(flow_run.id or ""), "artifacts": records})
    key = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "train", config.run_name, *attempt_segments(),
                       RESULT_FILE)
    # What it was trained on, and the target it was trained for (its files by sha256).
    inputs = [*(InputRef(uri=s.uri, sha256=s.sha256) for s in result.data),
              *target_inputs(settings, config.target, seed=config.seed)]
    return store_result(settings, result, key=key, inputs=inputs)


if __name__ == "__main__":
    run_from_command_line(train, TrainFlowParams)
