"""The embedded demo's parameters: a seeded ShareGPT sample plus the bundled tool-use prompts answered by SmolLM2
on one CPU server (4 of the 38 held out), a few CPU steps of a 2-layer drafter, evaluation on the held-out
prompts. The pipeline (`flows.pipeline.demo_pipeline`) and the deployment table (the `embedded-demo` and
`train-demo` forms, the tokenize schedule) both read them here; this module imports the stage flows' parameter
classes and nothing that registers or runs deployments.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from dflash_core.embedded import demo_prompt_params
from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from dflash_core.train.config import TrainConfig
from flows.evaluate import EvaluateParams
from flows.export import ExportParams
from flows.generate_params import GenerateParams
from flows.tokenize import TokenizeParams
from flows.train import TrainFlowParams

DEMO_DATASET, DEMO_RUN = "demo", "smollm2"
DEMO_TRAIN_DEPLOYMENT = "train-demo"


def demo_training() -> TrainFlowParams:
    """20 CPU steps of a 2-layer drafter against SmolLM2 (what the train-demo deployment runs)."""
    return TrainFlowParams(config=TrainConfig(
        run_name="demo-drafter", target="embedded", token_budget=512, max_steps=20, checkpoint_every=10, log_every=2,
        validate_capture_batches=1, drafter={"num_layers": 2, "block_size": 8, "num_anchors": 64},
        optim={"lr": 1e-3, "warmup_steps": 2}))


def demo_stages() -> dict[str, Any]:
    """The demo pipeline's form: flows.pipeline.PipelineParams fields (stage parameters, the train deployment)."""
    generation = GenerateParams(
        dataset=DEMO_DATASET, prompts_version="sharegpt-seed0-conversations", run=DEMO_RUN, **demo_prompt_params(), shard_size=6,
        holdout={"fraction": 0.1},
        sampling={"max_tokens": 40, "temperature": 0.0, "enable_thinking": False},  # SmolLM2 has no thinking mode
        client={"concurrency": 6}, canary_prompts=2, canary={"max_length_fraction": 1.0})
    return {"generation": generation, "tokenization": TokenizeParams(), "training": demo_training(),
            "train_deployment": DEMO_TRAIN_DEPLOYMENT, "evaluation": EvaluateParams(num_prompts=4, max_new_tokens=24),
            "export": ExportParams()}


def demo_form() -> dict[str, Any]:
    """`demo_stages` as the JSON a deployment's form holds (defaults left out)."""
    return {name: value.model_dump(mode="json", exclude_defaults=True) if isinstance(value, BaseModel) else value
            for name, value in demo_stages().items()}


def demo_completions_prefix(settings: Settings) -> str:
    """Where the demo's completions live: what the tokenize deployment's nightly schedule starts pointed at."""
    key = artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, DEMO_DATASET, DEMO_RUN)
    return ObjectStore.from_settings(settings).uri(key) + "/"
