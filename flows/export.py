"""Export a drafter checkpoint in the formats vLLM and SGLang load: checkpoint (S3 or local) ->
exports/<run>/<format>/ (every file with a manifest whose inputs are the checkpoint's files) + a
markdown artifact per format with those manifests. Its own deployment, so a failed export has a Retry.

Run: `dflash run export --params '{"checkpoint": "checkpoints/demo-drafter/step-000020", "run_name": "demo-drafter"}'`
"""

from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import BaseModel, Field

from dflash_core.settings import load_settings
from flows.command_line import run_from_command_line
from tasks.artifacts import publish_stored, ui_key
from tasks.evaluate import fetch_checkpoint
from tasks.export import export_checkpoint
from tasks.provenance import flow_version


class ExportParams(BaseModel):
    checkpoint: str = Field(description="Drafter checkpoint: an S3 key or URI of a step dir (model.safetensors + "
                                        "meta.json), or a local dir.")
    run_name: str = Field(description="Export name: exports/(run_name)/(format)/.")
    target: str = Field("embedded", description="The target the drafter was trained for: `embedded`, "
                                                "`tiny:<family>` or a local model dir.")
    target_seed: int = Field(0, description="Seed of a `tiny:<family>` random target (must match training).")
    formats: list[Literal["native", "speculators"]] = Field(
        default_factory=lambda: ["native", "speculators"], min_length=1,
        description="native: z-lab's DFlashDraftModel; speculators: what vLLM reads. A format the drafter cannot "
                    "be expressed in is skipped with a warning.")


@flow(name="dflash-export", log_prints=True, version=flow_version())
def export(params: ExportParams) -> dict:
    """checkpoint -> exported formats in S3; the records of every stored file."""
    settings = load_settings()
    checkpoint_dir, inputs = fetch_checkpoint(settings, checkpoint=params.checkpoint,
                                              cache_dir=settings.work_path("cache", "checkpoints"))
    exports = export_checkpoint(settings, checkpoint_dir=checkpoint_dir, inputs=inputs, run_name=params.run_name,
                                target=params.target, target_seed=params.target_seed, formats=list(params.formats))
    records = []
    for name, prefix in exports.items():
        records += publish_stored(settings, prefix=prefix, key=ui_key("export", params.run_name, name),
                                  title=f"{name} export of {params.run_name}")
    return {"exports": exports, "artifacts": records}


if __name__ == "__main__":
    run_from_command_line(export, ExportParams)
