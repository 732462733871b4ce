"""The one table of deployments: names, entrypoints, descriptions, default parameters, schedules.

Both ways of registering read it, with the same work pool, entrypoints and pull step, so they
register identical deployments: the stage server (`python -m flows.serve`, what `dflash services up`
and `dflash demo` start) and `dflash deploy` (flows.deployments.register_deployments). A worker of the
pool on any host runs them; the stage server is one such worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dflash_core.services.stages import WORK_POOL


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    entrypoint: str  # relative to the repo root, as a worker's pull step sets it
    description: str
    parameters: Callable[[], dict[str, Any]] | None = None  # called at registration (may import flows)
    cron_utc: str | None = None
    concurrency_limit: int | None = None

    @property
    def module(self) -> str:
        """`train` for flows/train.py:train."""
        return self.entrypoint.split(":")[0].removeprefix("flows/").removesuffix(".py")


def _nightly_tokenize() -> dict:
    return {"params": {"dataset": "demo", "run": "smollm2"}}


def _full_training() -> dict:
    from flows.pipeline import demo_training

    config = demo_training().config
    return {"params": {"config": {"run_name": config.run_name, "target": config.target, "data": config.data}}}


def _demo_training() -> dict:
    from flows.pipeline import demo_training

    return {"params": demo_training().model_dump(mode="json", exclude_defaults=True)}


DEPLOYMENTS: tuple[DeploymentSpec, ...] = (
    DeploymentSpec("embedded-demo", "flows/pipeline.py:pipeline",
                   "The main job on the embedded default: plan, on-policy generation with SmolLM2, tokenization with "
                   "the quality gate, a short training run, evaluation and export, each stage its own run."),
    DeploymentSpec("generate", "flows/generate.py:generate",
                   "On-policy generation with data-parallel inference servers (vLLM, SGLang or transformers serve).",
                   concurrency_limit=1),
    DeploymentSpec("tokenize-nightly", "flows/tokenize.py:tokenize",
                   "Re-tokenize a completion run every night at 03:00 UTC; only shards whose input, tokenizer or "
                   "config changed are redone.", parameters=_nightly_tokenize, cron_utc="0 3 * * *"),
    DeploymentSpec("train", "flows/train.py:train",
                   "The full training job (1,000 steps by default); a Retry resumes from the latest checkpoint. "
                   "For the small demo run use train-demo.", parameters=_full_training, concurrency_limit=1),
    DeploymentSpec("train-demo", "flows/train.py:train",
                   "The small demo run (20 CPU steps of a 2-layer drafter against SmolLM2, about 2 minutes); the "
                   "train deployment's defaults are the full 1,000-step job.", parameters=_demo_training,
                   concurrency_limit=1),
    DeploymentSpec("evaluate", "flows/evaluate.py:evaluate",
                   "Measure a drafter checkpoint (S3 key or local dir) by real draft/verify rounds against the "
                   "target; report with lineage."),
    DeploymentSpec("export", "flows/export.py:export",
                   "Export a drafter checkpoint (S3 key or local dir) in the formats vLLM and SGLang load (native, "
                   "speculators), each file to S3 with a manifest."),
    DeploymentSpec("provision", "flows/nodes.py:provision",
                   "Provision a node idempotently (venv on local disk, packages, GPU/disk checks, model on a RAM disk "
                   "when its home is slow); its node record goes to S3."),
    DeploymentSpec("preserve", "flows/nodes.py:preserve_flow",
                   "Before a node is shut down - stop our servers, upload scripts, logs, configs and a system "
                   "inventory with manifests, write a note of what is where."),
    DeploymentSpec("s3-audit-weekly", "flows/s3.py:s3_audit",
                   "Every Monday at 04:00 UTC - inventory of the bucket by kind and prefix, dead data, broken "
                   "manifests, lineage graph; publishes a cleanup plan (plan.json) to review.",
                   cron_utc="0 4 * * 1"),
    DeploymentSpec("s3-cleanup", "flows/s3.py:s3_cleanup",
                   "Dry run unless confirm=true. Give plan_uri (the plan.json of an s3-audit run) to delete exactly "
                   "what was reviewed; everything is re-checked against live manifests first.",
                   parameters=lambda: {"params": {"confirm": False}}, concurrency_limit=1),
)

# The pipeline's stages: each runs as the first deployment of its flow module.
STAGE_MODULES = ("generate", "tokenize", "train", "evaluate", "export")


def spec_for(module: str) -> DeploymentSpec:
    """The first deployment whose entrypoint is flows/<module>.py."""
    for spec in DEPLOYMENTS:
        if spec.module == module:
            return spec
    raise ValueError(f"no deployment runs flows/{module}.py; deployments: {[s.name for s in DEPLOYMENTS]}")
