"""The main job on the embedded default: store check -> capacity plan (a report written to S3 with
its manifest and verified) -> on-policy generation by the embedded SmolLM2 served with
`transformers serve` -> tokenization with the quality gate -> a short online training run of a
small drafter against SmolLM2, which evaluates and exports it. Every stage is a run of its
deployment (flows/deployments.py), so a failed stage can be retried alone from the UI.

Run: `dflash demo` (starts the local services and the stage server first) or `dflash run pipeline`.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.runtime import flow_run

from pydantic import BaseModel, Field

from dflash_core.embedded import demo_prompt_params
from dflash_core.planner import PRESETS, PlanInputs
from dflash_core.settings import load_settings
from dflash_core.train.config import TrainConfig
from flows.command_line import run_from_command_line
from flows.deployments import StageFailed, run_stage
from flows.failures import fail_run
from flows.generate import GenerateParams
from flows.tokenize import TokenizeParams
from flows.train import TrainFlowParams
from tasks.artifacts import artifact_record
from tasks.plan import plan_capacity
from tasks.provenance import flow_version
from tasks.store import check_store, publish_report

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


def demo_generation() -> GenerateParams:
    """Generation on the embedded default: a seeded ShareGPT sample plus the bundled tool-use prompts, one CPU
    server, short answers."""
    return GenerateParams(
        dataset="demo", prompts_version="sharegpt-seed0", run="smollm2", **demo_prompt_params(), shard_size=6,
        sampling={"max_tokens": 48, "temperature": 0.0, "enable_thinking": False},  # SmolLM2 has no thinking mode
        client={"concurrency": 6}, canary_prompts=2, canary={"max_length_fraction": 1.0},
    )


def demo_tokenization() -> TokenizeParams:
    return TokenizeParams(dataset="demo", run="smollm2")


def demo_training() -> TrainFlowParams:
    """A few CPU steps of a 2-layer drafter (block 8) against SmolLM2: shows the loop, not a useful drafter."""
    return TrainFlowParams(config=TrainConfig(
        run_name="demo-drafter", target="embedded", data=["tokenized/demo/smollm2/"], token_budget=512,
        max_steps=20, checkpoint_every=10, log_every=2, validate_capture_batches=1,
        drafter={"num_layers": 2, "block_size": 8, "num_anchors": 64}, optim={"lr": 1e-3, "warmup_steps": 2}))


class PipelineParams(BaseModel):
    target_preset: PresetName = Field("smollm2-135m", description="Target model shape.")
    samples: int = Field(2_000, gt=0, description="Prompts to generate completions for.")
    mean_tokens: int = Field(1_024, gt=0, description="Expected mean tokens per sample.")
    gpu_memory_gib: float = Field(139.0, gt=0, description="Usable memory of one training GPU.")
    num_gpus: int = Field(1, gt=0, description="Training GPUs.")
    generation_tokens_per_s: float = Field(20.0, gt=0, description="Per-instance generation speed.")
    generation: GenerateParams | None = Field(default_factory=demo_generation,
                                              description="Generation stage; None skips it.")
    tokenization: TokenizeParams | None = Field(default_factory=demo_tokenization,
                                                description="Tokenization stage; None skips it.")
    training: TrainFlowParams | None = Field(default_factory=demo_training, description="Training stage; None skips it.")

    def plan_inputs(self) -> PlanInputs:
        return PlanInputs(target=PRESETS[self.target_preset], samples=self.samples, mean_tokens=self.mean_tokens,
                          gpu_memory_gib=self.gpu_memory_gib, num_gpus=self.num_gpus,
                          generation_tokens_per_s=self.generation_tokens_per_s)


@flow(name="dflash-pipeline", log_prints=True, version=flow_version())
def pipeline(params: PipelineParams = PipelineParams()) -> dict:
    """Plan here; each stage runs as a run of its own deployment (a subflow with its own Retry)."""
    settings = load_settings()
    bucket_uri = check_store(settings)
    capacity = plan_capacity(params.plan_inputs(), name=params.target_preset)
    manifest = publish_report(settings, name="plan", run_id=str(flow_run.id or "local"),
                              report=capacity.model_dump(mode="json"), config=params.model_dump())
    print(f"bucket {bucket_uri} ok; plan report at {manifest.uri} (sha256 {manifest.sha256[:12]})")
    result = {"report": manifest.uri, "sha256": manifest.sha256,
              "fits": [v.layout for v in capacity.layouts if v.fits], "artifacts": [artifact_record(manifest)]}
    stages = (("generation", "generate", params.generation), ("tokenization", "tokenize", params.tokenization),
              ("training", "train", params.training))
    for field, stage, stage_params in stages:
        if stage_params is None:
            continue
        try:
            result[field] = run_stage(stage, stage_params)
        except StageFailed as failed:
            return fail_run(failed, already_logged=True)  # the stage's own run logged the cause
        result["artifacts"] += stored_records(result[field])
    return result


def stored_records(stage_result: dict) -> list[dict]:
    """The artifact records a stage's result lists, its own stages' included (train's evaluation, export),
    each once."""
    found = {record["uri"]: record for record in stage_result.get("artifacts", [])}
    for value in stage_result.values():
        if isinstance(value, dict):
            found.update({record["uri"]: record for record in stored_records(value)})
    return list(found.values())



if __name__ == "__main__":
    run_from_command_line(pipeline, PipelineParams)
