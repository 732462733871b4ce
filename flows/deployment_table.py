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
class ScheduleSpec:
    slug: str  # the name the UI shows: it says the time zone
    cron_utc: str
    parameters: Callable[[], dict[str, Any]] | None = None  # the schedule's own parameters
    active: bool = True


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    entrypoint: str  # relative to the repo root, as a worker's pull step sets it
    description: str
    parameters: Callable[[], dict[str, Any]] | None = None  # called at registration (may import flows)
    schedule: ScheduleSpec | None = None
    concurrency_limit: int | None = None

    @property
    def module(self) -> str:
        """`train` for flows/train.py:train."""
        return self.entrypoint.split(":")[0].removeprefix("flows/").removesuffix(".py")


# The demo's forms come from flows/demo.py, which imports the stage flows' parameters only (never this table
# or the pipeline that runs it): imported when called, so reading the table stays light.
def _demo_pipeline() -> dict:
    from flows.demo import demo_form

    return {"params": demo_form()}


def _demo_training() -> dict:
    from flows.demo import demo_training

    return {"params": demo_training().model_dump(mode="json", exclude_defaults=True)}


def _demo_completions() -> dict:
    """The nightly schedule's parameters: the demo's completion run, until a user points it at theirs."""
    from dflash_core.settings import load_settings
    from flows.demo import demo_completions_prefix

    return {"params": {"completions": demo_completions_prefix(load_settings())}}


# The UI offers Retry on a Completed run too, but every run here persists its result, so the server refuses it
# (while the UI shows a success toast): each deployment says so, and how to run it again.
_RETRY = (" Retry in the UI reruns a Failed run in place; on a Completed run the server refuses it (\"Run is already "
          "COMPLETED\") although the UI shows a success toast, and nothing runs.")
_RERUN_GENERATE = _RETRY + (" To rerun a finished run, start a new run with refresh=true: every shard is checked "
                            "again (shards already answered with the same prompts, model and sampling are kept; "
                            "change run to answer anew).")
_RERUN_TOKENIZE = _RETRY + (" To rerun a finished run, start a new run with refresh=true: every shard is tokenized "
                            "again, ignoring cached results.")
_RERUN_TRAIN = _RETRY + (" To rerun a finished run, start a new run: it resumes from the run's latest checkpoint, so "
                         "raise max_steps to train on, or change run_name to start over.")
_RERUN_FRESH = _RETRY + " To rerun a finished run, start a new run: nothing is cached across runs."
_RERUN_PIPELINE = _RETRY + (" To rerun a finished run, start a new one: what is already made (tokenized shards, "
                            "checkpoints) is reused; set a stage's refresh=true (generation, tokenization) to redo it.")

DEPLOYMENTS: tuple[DeploymentSpec, ...] = (
    DeploymentSpec("embedded-demo", "flows/pipeline.py:pipeline",
                   "The main job on the embedded default (what `dflash demo` runs): plan, on-policy generation with "
                   "SmolLM2 (a held-out split of the prompts kept apart), tokenization with the quality gate, a short "
                   "training run, evaluation on the held-out split and export; each stage its own run, each taking "
                   "the one before's result." + _RERUN_PIPELINE,
                   parameters=_demo_pipeline),
    DeploymentSpec("pipeline", "flows/pipeline.py:pipeline",
                   "A whole real run from one form: (provision a node) -> generate -> tokenize -> train -> evaluate on "
                   "the held-out split -> export -> (preserve the node) -> S3 audit. Each stage takes the previous "
                   "stage's result; fill the stages you want (infra/examples/ has a parameter file for Qwen3.6-27B "
                   "on 4 GPUs: `dflash run pipeline --params infra/examples/qwen3.6-27b-4gpu.json`)." + _RERUN_PIPELINE),
    DeploymentSpec("generate", "flows/generate.py:generate",
                   "On-policy generation with data-parallel inference servers (vLLM, SGLang or transformers serve); "
                   "holds out a share of the prompts for evaluation." + _RERUN_GENERATE, concurrency_limit=1),
    DeploymentSpec("generate-node", "flows/generate.py:generate",
                   "One node's share of a generation across nodes: the generate run whose form lists nodes starts one "
                   "of these per node, on the node's own work queue, with that node's engine, instances, devices and "
                   "prompt shards (prompt_shards). Press Retry here to retry one node's share; the generate run that "
                   "started it merges the shares." + _RERUN_GENERATE + " To rerun a generation across nodes, rerun "
                   "the generate run that lists them: it deals only the shards still unanswered."),
    DeploymentSpec("tokenize", "flows/tokenize.py:tokenize",
                   "Tokenize a completion run (the generate stage's result, or its result.json or prefix URI) into "
                   "training and held-out shards with the quality gate; only shards whose input, tokenizer or config "
                   "changed are redone. Its form starts pointed at the demo's completions. Its schedule "
                   "nightly-03-00-utc (inactive until you point its completions at yours and turn it on) reruns it "
                   "every night at 03:00 UTC." + _RERUN_TOKENIZE,
                   parameters=_demo_completions,
                   schedule=ScheduleSpec("nightly-03-00-utc", "0 3 * * *", parameters=_demo_completions,
                                         active=False)),
    DeploymentSpec("train", "flows/train.py:train",
                   "Train a drafter on a tokenize result's training shards (1,000 steps by default); a Retry resumes "
                   "from the latest checkpoint. For the small demo run use train-demo." + _RERUN_TRAIN,
                   concurrency_limit=1),
    DeploymentSpec("train-demo", "flows/train.py:train",
                   "The demo's training (20 CPU steps of a 2-layer drafter against SmolLM2, about 2 minutes): what "
                   "embedded-demo's training stage runs; give it a tokenize result as dataset." + _RERUN_TRAIN,
                   parameters=_demo_training, concurrency_limit=1),
    DeploymentSpec("evaluate", "flows/evaluate.py:evaluate",
                   "Measure a drafter checkpoint (the train stage's result) by real draft/verify rounds against the "
                   "target, on the held-out split of the dataset it was trained on unless told otherwise; report with "
                   "lineage." + _RERUN_FRESH),
    DeploymentSpec("export", "flows/export.py:export",
                   "Export a drafter checkpoint (the train stage's result, or a step dir) in the formats vLLM and "
                   "SGLang load (native, speculators), each file to S3 with a manifest." + _RERUN_FRESH),
    DeploymentSpec("served", "flows/served.py:served",
                   "Serve the target with vLLM with and without the exported drafter (the export stage's result) on "
                   "the prompts the evaluate stage measured, at temperature 0 and 1, 8 and 32 requests in flight: the "
                   "engine's acceptance and tokens/s beside our evaluator's tau, every drafted output compared with "
                   "the target-only one. A DFlash 2 export is refused by name on vLLM 0.26 (it serves DFlash only)."
                   + _RERUN_FRESH),
    DeploymentSpec("provision", "flows/nodes.py:provision",
                   "Provision a node idempotently (venv on local disk, packages, GPU/disk checks, model on a RAM disk "
                   "when its home is slow); its node record goes to S3." + _RETRY + " To rerun a finished run, start a new "
                   "run: provisioning is idempotent, so what is already in place is checked and kept."),
    DeploymentSpec("preserve", "flows/nodes.py:preserve_flow",
                   "Before a node is shut down - stop our servers, upload scripts, logs, configs and a system "
                   "inventory with manifests, write a note of what is where." + _RETRY + " To rerun a finished run, start a "
                   "new run: each run makes a backup of its own."),
    DeploymentSpec("s3-audit", "flows/s3.py:s3_audit",
                   "Inventory of the bucket by kind and prefix, dead data, broken manifests, lineage graph; publishes "
                   "a cleanup plan (plan.json) to review. Its schedule weekly-mon-04-00-utc runs it every Monday at "
                   "04:00 UTC." + _RERUN_FRESH,
                   schedule=ScheduleSpec("weekly-mon-04-00-utc", "0 4 * * 1")),
    DeploymentSpec("s3-cleanup", "flows/s3.py:s3_cleanup",
                   "Dry run unless confirm=true. Give plan_uri (the plan.json of an s3-audit run) to delete exactly "
                   "what was reviewed; everything is re-checked against live manifests first." + _RETRY + " To rerun a "
                   "finished run, start a new run with the same plan_uri: objects already deleted are skipped as "
                   "already gone, the rest are re-checked and deleted.",
                   parameters=lambda: {"params": {"confirm": False}}, concurrency_limit=1),
)

# Flow modules whose deployments a pipeline runs as stages.
STAGE_MODULES = ("generate", "tokenize", "train", "evaluate", "export", "served", "nodes", "s3")


def spec_named(name: str) -> DeploymentSpec:
    """The deployment called `name`."""
    for spec in DEPLOYMENTS:
        if spec.name == name:
            return spec
    raise ValueError(f"no deployment named {name!r}; deployments: {[s.name for s in DEPLOYMENTS]}")


def spec_for(module_or_name: str) -> DeploymentSpec:
    """The deployment called `module_or_name`, else the first whose entrypoint is flows/<module_or_name>.py."""
    if any(spec.name == module_or_name for spec in DEPLOYMENTS):
        return spec_named(module_or_name)
    for spec in DEPLOYMENTS:
        if spec.module == module_or_name:
            return spec
    raise ValueError(f"no deployment named {module_or_name!r} and none runs flows/{module_or_name}.py; deployments: "
                     f"{[s.name for s in DEPLOYMENTS]}")
