"""Train a drafter online: plan capacity (refuse what cannot fit) -> train (torchrun subprocess;
capture validated on the first batches; resumes from the latest checkpoint on retry) -> report ->
evaluate (speculative decoding against the target) -> export (native and speculators formats); evaluate
and export run as their own deployment runs when this flow is one.

Run: `dflash run train --params '{"config": {"target": "embedded", "data": ["tokenized/demo/smollm2/"]}}'`
"""

from __future__ import annotations


from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from dflash_core.nodes import Node
from dflash_core.settings import load_settings
from dflash_core.train.config import TrainConfig
from dflash_core.train.entry import Rendezvous
from flows.command_line import run_from_command_line
from flows.deployments import StageFailed, run_stage
from flows.failures import fail_run
from flows.evaluate import EvaluateParams
from flows.export import ExportParams
from flows.nodes import preserve_on_failure
from tasks.artifacts import artifact_record, publish_stored, ui_key
from tasks.data_gate import check_training_data
from tasks.provenance import flow_version
from tasks.train import plan_training, report_training, run_training


class TrainFlowParams(BaseModel):
    config: TrainConfig = Field(description="The run schema: every hyperparameter and path.")
    nproc_per_node: int = Field(1, ge=1, description="Processes on this node: one per GPU (colocated) or per GPU "
                                "pair (placement=pair); >1 runs torchrun with DDP.")
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description=(
        "Several nodes: run this flow once per node with these torchrun rendezvous settings (identical on every "
        "node with c10d); checkpoints must reach every node (S3 upload or a shared output_dir)."))
    s3_outage_limit_s: float = Field(300.0, gt=0, description=(
        "How long checkpoint uploads may keep failing (S3 down) before the run fails; training goes on with "
        "local checkpoints meanwhile. Keep it below the process-group timeout (600 s) on several GPUs."))
    gpu_memory_gib: float = Field(139.0, gt=0, description="For the capacity check.")
    expected_samples: int = Field(100_000, gt=0, description="For the capacity check's storage figures.")
    expected_mean_tokens: float = Field(2_000, gt=0)
    evaluate: bool = Field(True, description="Measure acceptance by real draft/verify rounds after training.")
    eval_prompts: str | None = Field(None, description="Held-out prompts (.arrow/.jsonl, local or S3); None: the first data item's first shard.")
    eval_num_prompts: int = Field(4, gt=0)
    eval_max_new_tokens: int = Field(32, gt=0)
    export_formats: list[Literal["native", "speculators"]] = Field(
        default_factory=lambda: ["native", "speculators"], description="Formats a format-incompatible drafter skips.")
    node: Node | None = Field(None, description=(
        "The node this runs on (from the inventory): preserved (logs, configs, inventory to S3; nothing deleted) "
        "when the flow fails, crashes or is cancelled."))


@flow(name="dflash-train", log_prints=True, persist_result=True, version=flow_version(),
      on_failure=[preserve_on_failure], on_cancellation=[preserve_on_failure], on_crashed=[preserve_on_failure])
def train(params: TrainFlowParams) -> dict:
    settings = load_settings()
    config = params.config.model_copy(update={"output_dir": params.config.output_dir.resolve()})
    gpus_per_process = 2 if config.placement == "pair" else 1
    check_training_data(settings, config)  # refuses data whose quality gate failed, before torchrun starts
    plan_training(config, gpu_memory_gib=params.gpu_memory_gib, num_gpus=params.nproc_per_node * gpus_per_process,
                  samples=params.expected_samples, mean_tokens=params.expected_mean_tokens)
    checkpoint = run_training(config, nproc_per_node=params.nproc_per_node, flow_run_id=str(flow_run.id or ""),
                              rendezvous=params.rendezvous, s3_outage_limit_s=params.s3_outage_limit_s)
    if checkpoint is None:  # another node hosted global rank 0; its flow run carries on from here
        return {"checkpoint": None, "run_dir": str(config.run_dir), "node_rank": params.rendezvous.node_rank}
    report = report_training(settings, config, checkpoint=checkpoint)
    result = {"checkpoint": checkpoint, "metrics": report.uri, "run_dir": str(config.run_dir),
              "artifacts": _evidence(settings, config, checkpoint=checkpoint, report=report)}
    try:
        _evaluate_and_export(settings, params, config, checkpoint=checkpoint, result=result)
    except StageFailed as failed:
        return fail_run(failed, already_logged=True)  # the stage's own run logged the cause
    return result


def _evaluate_and_export(settings, params: TrainFlowParams, config: TrainConfig, *, checkpoint: str,
                         result: dict) -> None:
    """Evaluate and export the checkpoint, each as its own stage run; their results go into `result`."""
    if params.evaluate:
        result["evaluation"] = run_stage("evaluate", EvaluateParams(
            checkpoint=_stored_checkpoint(settings, config, checkpoint),
            prompts=params.eval_prompts or _first_shard(settings, config.data[0]),
            target=config.target, target_seed=config.seed, run=config.run_name, num_prompts=params.eval_num_prompts,
            max_new_tokens=params.eval_max_new_tokens))
    if params.export_formats:  # its own deployment run (a Retry of its own), records in its result
        result["export"] = run_stage("export", ExportParams(
            checkpoint=_stored_checkpoint(settings, config, checkpoint), run_name=config.run_name,
            target=config.target, target_seed=config.seed, formats=params.export_formats))
        result["exports"] = result["export"]["exports"]
        result["artifacts"] += result["export"]["artifacts"]


def _evidence(settings, config: TrainConfig, *, checkpoint: str, report) -> list[dict]:
    """Records of what this run stored; the checkpoint also gets a manifest artifact in the UI."""
    records = [artifact_record(report)]
    stored = _stored_checkpoint(settings, config, checkpoint)
    if stored.startswith("s3://"):
        records += publish_stored(settings, prefix=stored, key=ui_key("checkpoint", config.run_name),
                                  title=f"checkpoint {config.run_name}/{Path(checkpoint).name}")
    return records


def _stored_checkpoint(settings, config: TrainConfig, checkpoint: str) -> str:
    """The S3 URI of the uploaded checkpoint (so evaluation's inputs are the stored files, and any host
    can run it), else the local dir."""
    from dflash_core.evaluate.inputs import CHECKPOINT_META_FILE
    from dflash_core.layout import ArtifactKind, artifact_key
    from dflash_core.storage import ObjectStore

    store = ObjectStore.from_settings(settings)
    key = f"{artifact_key(settings.s3_prefixes, ArtifactKind.CHECKPOINT, config.run_name)}/{Path(checkpoint).name}"
    return store.uri(key) if store.exists(f"{key}/{CHECKPOINT_META_FILE}") else checkpoint


def _first_shard(settings, item: str) -> str:
    """`item` itself, or the first .arrow shard under it when it is an S3 prefix."""
    if not item.endswith("/"):
        return item
    from dflash_core.storage import ObjectStore

    store = ObjectStore.from_settings(settings)
    keys = sorted(i.key for i in store.list(item.removeprefix(f"s3://{store.bucket}/")) if i.key.endswith(".arrow"))
    if not keys:
        raise ValueError(f"no .arrow shard under {item!r} to evaluate on: pass eval_prompts")
    return keys[0]



if __name__ == "__main__":
    run_from_command_line(train, TrainFlowParams)
