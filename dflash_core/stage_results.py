"""What each pipeline stage made, as typed records: the DAG's edges are these values.

generate -> `CompletionsDataset` -> tokenize -> `TokenizedDataset` -> train -> `Checkpoint` ->
evaluate -> `EvaluationReport`; export takes the checkpoint too and gives `ExportResult`. A stage
takes its upstream's record as input (the pipeline passes it, so Prefect draws the edge), or, started
alone from its form, the URI of the record's `result.json` that the upstream stage wrote to S3. No
stage rebuilds an upstream path from dataset or run names.

Every record names the flow run that made it and lists the artifact records (uri, kind, sha256,
manifest) of what it stored, which the run summary and the audit read. No Prefect here.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

Split = Literal["train", "heldout"]
MeasuredOn = Literal["heldout", "train", "file"]
# What an evaluation measured, as its report, the UI and the run summary say it.
MEASURED_ON: dict[str, str] = {"heldout": "held-out prompts (never trained on)",
                               "train": "IN-SAMPLE training prompts (asked for: overstates acceptance)",
                               "file": "a prompt file given by the user"}
RESULT_FILE = "result.json"  # each stage's record, beside its report in S3


class StoredShard(BaseModel):
    """One data shard in the bucket, by URI and content hash."""

    model_config = ConfigDict(frozen=True)

    uri: str
    sha256: str
    split: Split = "train"


class StageResult(BaseModel):
    """Fields every stage's record has."""

    flow_run: str = Field("", description="Id of the flow run that made this.")
    result_uri: str | None = Field(None, description="Where this record is stored (s3://.../result.json).")
    artifacts: list[dict[str, Any]] = Field(default_factory=list, description="Records of the objects stored.")

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


# A model field of a stage that the pipeline fills with the model its provision stage placed on the node
# (`provision.provision.model_dir`, after the RAM-disk copy): the form names the model once.
MODEL_FROM_NODE = "@node"


class ProvisionedNode(StageResult):
    """provision's result: the node the stages run on and what provision put there."""

    kind: Literal["node"] = "node"
    node: dict[str, Any] = Field(description="The node (the inventory's fields): stages record it and preserve it.")
    hostname: str = ""
    work_dir: str = Field(description="The node's work dir.")
    venv: str = Field(description="The provisioned venv (its bin/python runs the node's worker and stages).")
    model: str | None = Field(None, description="Where the target model was placed (RAM disk or its home): "
                                                "what every stage loads.")
    num_gpus: int = Field(0, description="GPUs the node shows.")
    work_queue: str | None = Field(None, description=(
        "The work queue of the `dflash` pool whose worker runs on this node: every stage of the run is sent there. "
        "None: provision started no worker (start_worker off), so the stages go to the default queue."))
    actions: list[str] = Field(default_factory=list, description="What provision changed (empty: nothing).")
    record_uri: str | None = Field(None, description="The node record in S3.")


class NodeShare(BaseModel):
    """What one node answered of a generation across nodes (generate's `nodes`)."""

    node: str
    shards: list[str] = Field(default_factory=list, description="URIs of the completion shards it wrote.")
    outcomes: dict[str, int] = Field(default_factory=dict, description=(
        "Its prompts by outcome (completed, failed, generated_now, completion_tokens_now), over its runs."))
    flow_runs: list[str] = Field(default_factory=list, description="Its generate runs, one per share it was given.")
    completions_by_run: dict[str, int] = Field(default_factory=dict, description=(
        "Completions of each of its runs (flow run id: count); a run that never reported (its node dropped out) is "
        "counted from the shards it stored."))
    lost: str | None = Field(None, description="Why the node dropped out (its shards went to the others), if it did.")


class CompletionsDataset(StageResult):
    """generate's result: completion shards (training and held-out splits) and the generation counts."""

    kind: Literal["completions"] = "completions"
    dataset: str
    run: str
    shards: list[StoredShard] = Field(description="Every completion shard, training and held-out.")
    heldout_prompt_ids: list[str] = Field(default_factory=list,
                                          description="Prompts held out at import: never trained on.")
    outcomes: dict[str, int] = Field(default_factory=dict, description="Prompts by outcome (completed, failed, ...).")
    report: str | None = Field(None, description="URI of the generation report.")
    by_node: list[NodeShare] = Field(default_factory=list, description=(
        "Generated across nodes: what each node answered (empty: one run answered every shard)."))


class TokenizedDataset(StageResult):
    """tokenize's result: training shards and the held-out shards, each by sha256, and the gate verdict."""

    kind: Literal["tokenized"] = "tokenized"
    dataset: str
    run: str
    train_shards: list[StoredShard]
    heldout_shards: list[StoredShard] = Field(default_factory=list)
    heldout_prompt_ids: list[str] = Field(default_factory=list)
    dataset_manifest: str = Field(description="URI of dataset.json (the gate's verdict by shard sha256).")
    quality_gate: str
    gate: list[str] = Field(default_factory=list, description="The gate's failed checks, if any.")
    stats: str | None = Field(None, description="URI of the stats report.")
    histogram: str | None = Field(None, description="URI of the loss-token histogram PNG.")
    overall: dict[str, Any] = Field(default_factory=dict)
    completions: str | None = Field(None, description="result_uri of the completions it was made from.")

    def split(self, name: Split) -> list[StoredShard]:
        return self.train_shards if name == "train" else self.heldout_shards


class Checkpoint(StageResult):
    """train's result: the last checkpoint in S3 (or a local dir) and what it was trained on."""

    kind: Literal["checkpoint"] = "checkpoint"
    uri: str = Field(description="The step dir: s3://.../checkpoints/(run)/step-NNNNNN or a local dir.")
    run_name: str
    step: int
    target: str
    target_seed: int = 0
    data: list[StoredShard] = Field(default_factory=list, description="The shards trained on, by sha256.")
    dataset: TokenizedDataset | None = Field(None, description="The dataset those shards came from.")
    metrics: str | None = Field(None, description="URI of metrics.jsonl.")
    run_yaml: str | None = None
    provenance: str | None = None
    final_metrics: dict[str, Any] = Field(default_factory=dict)


class EvaluationReport(StageResult):
    """evaluate's result: acceptance per decoding mode, and which prompts it was measured on."""

    kind: Literal["evaluation"] = "evaluation"
    report: str
    split: MeasuredOn = Field(
        description="heldout: prompts never trained on; train: in-sample (asked for); file: a prompt file given.")
    prompts: list[str] = Field(description="URIs of the prompt shards or file read.")
    checkpoint: str
    summaries: list[dict[str, Any]] = Field(default_factory=list)
    generalization: dict[str, Any] | None = Field(
        None, description="Held-out tau against the training tau (dflash_core.evaluate.generalization); "
        "measured on held-out prompts only.")


class ExportResult(StageResult):
    """export's result: one prefix per format."""

    kind: Literal["export"] = "export"
    checkpoint: str
    exports: dict[str, str] = Field(description="format -> s3://.../exports/(run)/(format)/")


class ServedReport(StageResult):
    """served's result: the export as a serving engine ran it, beside a target-only server and our evaluator."""

    kind: Literal["served"] = "served"
    report: str = Field(description="URI of report.json (every row, the engine's counters, the outputs' equality).")
    export: str = Field(description="The export served (its S3 prefix).")
    engine: str = Field(description="Engine and version, e.g. vllm 0.26.0.")
    prompts: list[str] = Field(description="URIs of the prompt shards read (the evaluation's, when it ran).")
    rows: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Per request concurrency: tokens/s with and without the drafter, speedup, the engine's tau, outputs equal."))
    tau: float | None = Field(None, description="The engine's acceptance length over every pass (accepted + 1).")
    evaluator_tau: float | None = Field(None, description="Our evaluator's block-mode tau on the same prompts.")
    all_outputs_equal: bool = False


class PipelineResult(BaseModel):
    """What the pipeline made: the plan report, then each stage's own result. (Here, not in flows/: a flow
    run's result is unpickled by whoever reads it, so its class must import by a stable module name.)"""

    report: str
    sha256: str
    fits: list[str]
    provision: ProvisionedNode | dict[str, Any] | None = None
    generation: CompletionsDataset | None = None
    tokenization: TokenizedDataset | None = None
    training: Checkpoint | dict[str, Any] | None = None
    evaluation: EvaluationReport | None = None
    export: ExportResult | None = None
    served: ServedReport | None = None
    preserve: dict[str, Any] | None = None
    audit: dict[str, Any] | None = None
    artifacts: list[dict[str, Any]] = Field(default_factory=list)


R = TypeVar("R", bound=StageResult)


def parse_result(data: bytes, model: type[R], *, name: str) -> R:
    """A stored record read back; a ValueError naming `name` and the kind expected when it is not one."""
    try:
        raw = json.loads(data)
    except ValueError as error:
        raise ValueError(f"{name}: not a JSON stage result ({error})") from None
    expected = model.model_fields["kind"].default
    if not isinstance(raw, dict) or raw.get("kind") != expected:
        found = raw.get("kind") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{name}: a {found!r} result, not {expected!r}: pass the {RESULT_FILE} of the right stage")
    return model.model_validate(raw)
