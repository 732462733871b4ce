"""The pipeline: one DAG of stages, each a run of its own deployment that takes the previous stage's
result (dflash_core/stage_results.py) as its input, so Prefect draws the edges and a failed stage can
be retried alone from the UI.

    plan -> (provision) -> generate -> tokenize -> train -> evaluate -> export -> (served) -> (preserve) -> (S3 audit)
            CompletionsDataset -> TokenizedDataset -> Checkpoint -> EvaluationReport, ExportResult -> ServedReport
         -> S3 usage and run summary, on the pipeline run's own page

Each stage's result has a lineage page per artifact group it made (tasks/artifacts.py); the run ends with
its S3 usage (what it wrote, the bucket by kind and prefix, dead data, what a cleanup would reclaim) and its
summary (stages, tau, speedup, artifacts linked to their lineage pages), whether it completed or failed.

Stages left out of the form are skipped; a run may start from earlier work by giving the first stage
its input (tokenization.completions, training.dataset, evaluation.checkpoint: an earlier result or its
result.json URI). The form is checked as a DAG before anything runs. The embedded demo is this pipeline
with `demo_pipeline()`'s parameters (flows/demo.py; the `embedded-demo` deployment); a real target fills
the `pipeline` deployment's form or `infra/examples/qwen3.6-27b-4gpu.json`. Evaluation measures the
held-out split by default.

Run: `dflash demo`, or `dflash run pipeline --params infra/examples/qwen3.6-27b-4gpu.json`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.annotations import opaque
from pydantic import Field, model_validator

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.planner import PRESETS, PlanInputs
from dflash_core.run_summary import StageRun, settle_pipeline
from dflash_core.s3audit import Retention
from dflash_core.settings import Settings, load_settings
from dflash_core.stage_results import Checkpoint, CompletionsDataset, PipelineResult, ProvisionedNode
from dflash_core.strict import StrictModel
from flows.command_line import run_from_command_line
from flows.demo import demo_stages
from flows.deployments import StageFailed, run_stage
from flows.evaluate import EvaluateParams
from flows.export import ExportParams
from flows.failures import fail_run
from flows.node_stages import model_field_problems, stage_runner
from flows.generate import GenerateParams
from flows.nodes import PreserveParams, ProvisionParams, preserve_after
from flows.s3 import S3AuditParams
from flows.served import ServedParams
from flows.tokenize import TokenizeParams
from flows.train import TrainFlowParams
from tasks.artifacts import artifact_record
from tasks.pipeline_report import publish_run_summary, publish_usage, stage_runs
from tasks.plan import plan_capacity
from tasks.provenance import attempt_segments, flow_version
from tasks.store import check_store, publish_report

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


class PipelineParams(StrictModel):
    target_preset: PresetName = Field("smollm2-135m", description="Target model shape, for the capacity plan.")
    samples: int = Field(2_000, gt=0, description="Prompts to generate completions for (capacity plan).")
    mean_tokens: int = Field(1_024, gt=0, description="Expected mean tokens per sample (capacity plan).")
    gpu_memory_gib: float = Field(139.0, gt=0, description="Usable memory of one training GPU (capacity plan).")
    num_gpus: int = Field(1, gt=0, description="Training GPUs (capacity plan).")
    generation_tokens_per_s: float = Field(20.0, gt=0, description="Per-instance generation speed (capacity plan).")
    provision: ProvisionParams | None = Field(None, description=(
        "Provision this node first (from the inventory: node_name + inventory, or inline); None: no node step."))
    generation: GenerateParams | None = Field(None, description="Generation stage; None skips it.")
    tokenization: TokenizeParams | None = Field(None, description=(
        "Tokenization stage; None skips it. Its input is the generation stage's result: leave its completions "
        "empty, or set them (an earlier result, its result.json URI or a completion run's prefix) without one."))
    training: TrainFlowParams | None = Field(None, description=(
        "Training stage; None skips it. Its input is the tokenization stage's result: leave its dataset and "
        "config.data empty, or set the dataset without one."))
    train_deployment: Literal["train", "train-demo"] = Field("train", description="The deployment training runs as.")
    evaluation: EvaluateParams | None = Field(None, description=(
        "Evaluation stage (its input: the checkpoint; prompts: the dataset's held-out split unless split=train); "
        "None skips it."))
    export: ExportParams | None = Field(None, description="Export stage (its input: the checkpoint); None skips it.")
    served: ServedParams | None = Field(None, description=(
        "The drafter served by vLLM (its inputs: the export and the evaluation, whose prompts it serves and whose tau "
        "it stands beside); None skips it. vLLM 0.26 serves DFlash drafters only (training.config.drafter.variant "
        "dflash)."))
    preserve: PreserveParams | None = Field(None, description=(
        "Preserve this node at the end, and when a stage fails (logs, configs, inventory to S3; nothing deleted)."))
    audit: S3AuditParams | None = Field(None, description="An S3 audit at the end: what the run wrote, dead data.")

    @model_validator(mode="after")
    def _a_dag(self) -> PipelineParams:
        """Every stage has exactly one source for its input: the stage before it, or the form."""
        problems = []
        links = (("tokenization", "completions", "generation"), ("training", "dataset", "tokenization"),
                 ("evaluation", "checkpoint", "training"), ("export", "checkpoint", "training"),
                 ("served", "export", "export"))
        for stage, field, upstream in links:
            params = getattr(self, stage)
            if params is None:
                continue
            given = getattr(params, field) is not None or (stage == "training" and bool(params.config.data))
            if getattr(self, upstream) is not None and given:
                problems.append(f"{stage}.{field} is set, but the {upstream} stage's result is its input: leave it "
                                f"empty")
            elif getattr(self, upstream) is None and not given:
                problems.append(f"the {stage} stage needs {field}: add a {upstream} stage or set {stage}.{field}")
        node_model = self.provision is not None and bool(self.provision.provision.model_dir)
        problems += model_field_problems(self, node_model=node_model)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def plan_inputs(self) -> PlanInputs:
        training = self.training.config if self.training is not None else None
        target = PRESETS[self.target_preset]
        steps = {} if training is None else {
            "max_steps": training.max_steps, "target_fp8": training.target_fp8, "drafter_fp8": training.drafter_fp8,
            "tokens_per_step": training.token_budget * training.optim.grad_accum * self.num_gpus,
            "drafter_layers": training.drafter.num_layers,
            "tapped_layers": training.drafter.tap_count(num_target_layers=target.num_layers)}
        return PlanInputs(target=target, samples=self.samples, mean_tokens=self.mean_tokens,
                          gpu_memory_gib=self.gpu_memory_gib, num_gpus=self.num_gpus,
                          generation_tokens_per_s=self.generation_tokens_per_s, **steps)


def demo_pipeline() -> PipelineParams:
    """The embedded demo (flows/demo.py): the `embedded-demo` deployment's form."""
    return PipelineParams(**demo_stages())


def _preserve_on_crash(flow_obj, flow_run_obj, state) -> None:
    """Hook for a crashed or cancelled pipeline run: preserve the form's node, in this process."""
    raw = (flow_run_obj.parameters or {}).get("params") or {}
    preserve = raw.get("preserve") if isinstance(raw, dict) else getattr(raw, "preserve", None)
    if preserve:
        params = preserve if isinstance(preserve, PreserveParams) else PreserveParams.model_validate(preserve)
        preserve_after(params.resolve, state)


@flow(name="dflash-pipeline", log_prints=True, version=flow_version(), on_crashed=[_preserve_on_crash],
      on_cancellation=[_preserve_on_crash])
def pipeline(params: PipelineParams = PipelineParams()) -> PipelineResult:
    """Plan here; each stage runs as a run of its own deployment (a subflow with its own Retry) on the result
    of the stage before it. Tasks take the settings `opaque`: Prefect links a task's input to an earlier task's
    result by identity, through every field of the input, and a Manifest's kind is an ArtifactKind that the
    settings hold too (as s3_prefixes keys): each task given them would draw a false edge from the last report."""
    settings = load_settings()
    bucket_uri = check_store(opaque(settings))
    capacity = plan_capacity(params.plan_inputs(), name=params.target_preset)
    manifest = publish_report(opaque(settings), name="plan", run_id=str(flow_run.id or "local"),
                              report=capacity.model_dump(mode="json"), config=params.model_dump(mode="json"))
    print(f"bucket {bucket_uri} ok; plan report at {manifest.uri} (sha256 {manifest.sha256[:12]})")
    result = PipelineResult(report=manifest.uri, sha256=manifest.sha256,
                            fits=[v.layout for v in capacity.layouts if v.fits], artifacts=[artifact_record(manifest)])
    try:
        if params.provision is not None:
            result.provision = run_stage("provision", params.provision)
        _run_stages(params, result)
    except StageFailed as failed:
        _preserve(params, result, when="failure")
        _publish_evidence(settings, params, result, failed=failed)
        return fail_run(failed, already_logged=True)  # the stage's own run logged the cause
    _preserve(params, result, when="end")
    if params.audit is not None:
        try:
            result.audit = run_stage("s3-audit", params.audit)
        except StageFailed as failed:  # the drafter is made; the audit's own run says what went wrong
            get_run_logger().warning("the S3 audit failed: %s", failed)
    _publish_evidence(settings, params, result)
    return result


def _run_stages(params: PipelineParams, result: PipelineResult) -> None:
    """generate -> tokenize -> train -> evaluate, export -> served: each stage's input is the result before it (the form's
    own value for the first stage that runs); with a provision stage, each runs on that node with the model it
    placed (flows/node_stages.py)."""
    node = result.provision if isinstance(result.provision, ProvisionedNode) else None
    run = stage_runner(run_stage, node)
    if params.generation is not None:
        result.generation = run("generation", "generate", params.generation)
    if params.tokenization is not None:
        given = {"completions": result.generation} if result.generation is not None else {}
        result.tokenization = run("tokenization", "tokenize", params.tokenization.model_copy(update=given))
    if params.training is not None:
        given = {"dataset": result.tokenization} if result.tokenization is not None else {}
        result.training = run("training", params.train_deployment, params.training.model_copy(update=given))
        if not isinstance(result.training, Checkpoint):  # another node of a multi-node run holds rank 0
            return
    for field, stage in (("evaluation", "evaluate"), ("export", "export")):
        stage_params = getattr(params, field)
        if stage_params is not None:
            given = {"checkpoint": result.training} if result.training is not None else {}
            setattr(result, field, run(field, stage, stage_params.model_copy(update=given)))
    if params.served is not None:
        given = {"export": result.export} if result.export is not None else {}
        if result.evaluation is not None and params.served.evaluation is None:
            given["evaluation"] = result.evaluation
        result.served = run("served", "served", params.served.model_copy(update=given))


def _preserve(params: PipelineParams, result: PipelineResult, *, when: str) -> None:
    """Preserve the node, once per attempt of this run (a Retry preserves again after its own stages); a failed
    backup is logged, never the run's story."""
    if params.preserve is None:
        return
    try:
        result.preserve = run_stage("preserve", params.preserve,
                                    key=f"preserve-{when}-attempt-{flow_run.run_count or 1}")
    except StageFailed as failed:
        get_run_logger().warning("preserving the node failed: %s", failed)


def _publish_evidence(settings: Settings, params: PipelineParams, result: PipelineResult, *,
                      failed: StageFailed | None = None) -> None:
    """This run's page ends with its S3 usage and its summary (stages, tau, speedup, artifacts and their lineage
    pages; the run's own outcome: Completed, or Failed with `failed`'s message); either failing is logged (its
    task run says why), never the run's story."""
    result.artifacts = _records(result)
    stages = stage_runs(opaque(settings), flow_run_id=str(flow_run.id), return_state=True)
    runs = _settled(stages.result(), failed=failed) if stages.is_completed() else []
    key = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "usage", *attempt_segments(), "usage.json")
    by_node = [share.model_dump(mode="json") for share in result.generation.by_node] \
        if isinstance(result.generation, CompletionsDataset) else []
    usage = publish_usage(opaque(settings), run_ids=[run.id for run in runs] or [str(flow_run.id)], key=key,
                          by_node=by_node, retention=params.audit.retention if params.audit else Retention(),
                          return_state=True)
    if usage.is_completed():
        result.artifacts.append(artifact_record(usage.result()))
    summary = publish_run_summary(opaque(settings), result, stages=runs, failure=str(failed) if failed else None,
                                  return_state=True)
    for name, state in (("stage list", stages), ("S3 usage", usage), ("run summary", summary)):
        if not state.is_completed():
            get_run_logger().warning("the run's %s was not published: %s", name, state.message)


def _settled(stages: list[StageRun], *, failed: StageFailed | None) -> list[StageRun]:
    """The stage list with this run's own row as it is about to end (the server still says Running): Failed
    with the stage's error, else Completed, after the time since it started."""
    return settle_pipeline(stages, state="Failed" if failed else "Completed", now=datetime.now(UTC))


def _records(result: PipelineResult) -> list[dict]:
    """Every artifact record of the pipeline and its stages, each URI once."""
    found = {record["uri"]: record for record in result.artifacts}
    for part in (result.provision, result.generation, result.tokenization, result.training, result.evaluation,
                 result.export, result.served, result.preserve, result.audit):
        records = part.get("artifacts", []) if isinstance(part, dict) else getattr(part, "artifacts", [])
        found.update({record["uri"]: record for record in records})
    return list(found.values())


if __name__ == "__main__":
    run_from_command_line(pipeline, PipelineParams)
