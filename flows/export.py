"""Export a drafter checkpoint in the formats vLLM and SGLang load: checkpoint (S3 or local) ->
exports/<run>/<format>/ (every file with a manifest whose inputs are the checkpoint's files) + a
markdown artifact per format with those manifests. Its own deployment, so a failed export has a Retry.

Its input is the train stage's `Checkpoint` (or its result.json URI, or a bare step dir); its result an
`ExportResult`, stored as result.json under reports/export/.

Run: `dflash run export --params '{"checkpoint": "s3://dflash/checkpoints/demo-drafter/step-000020"}'`
"""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.settings import load_settings
from dflash_core.stage_results import RESULT_FILE, Checkpoint, ExportResult
from dflash_core.strict import StrictModel
from flows.command_line import run_from_command_line
from tasks.artifacts import publish_stored, target_inputs, ui_key
from tasks.evaluate import fetch_checkpoint
from tasks.export import export_checkpoint
from tasks.provenance import attempt_segments, flow_version
from tasks.results import resolve_checkpoint, store_result


class ExportParams(StrictModel):
    checkpoint: Checkpoint | str | None = Field(None, description=(
        "The drafter: the train stage's result (the pipeline passes it), its result.json URI, or a step dir "
        "(model.safetensors + meta.json) as an S3 key/URI or a local dir."))
    run_name: str | None = Field(None, description="Export name: exports/(run_name)/(format)/; None: the run name.")
    target: str | None = Field(None, description="The target the drafter was trained for: `embedded`, "
                                                "`tiny:<family>` or a local model dir; None: the checkpoint record's.")
    target_seed: int | None = Field(None, description="Seed of a `tiny:<family>` random target (None: the "
                                                      "checkpoint record's).")
    formats: list[Literal["native", "speculators"]] = Field(
        default_factory=lambda: ["native", "speculators"], min_length=1,
        description="native: z-lab's DFlashDraftModel; speculators: what vLLM reads. A format the drafter cannot "
                    "be expressed in is skipped with a warning.")


@flow(name="dflash-export", log_prints=True, version=flow_version())
def export(params: ExportParams) -> ExportResult:
    """checkpoint -> exported formats in S3; the records of every stored file."""
    settings = load_settings()
    checkpoint = resolve_checkpoint(settings, params.checkpoint, target=params.target)
    run_name = params.run_name or checkpoint.run_name
    checkpoint_dir, checkpoint_refs = fetch_checkpoint(settings, checkpoint=checkpoint.uri,
                                                       cache_dir=settings.work_path("cache", "checkpoints"))
    target = params.target or checkpoint.target
    target_seed = params.target_seed if params.target_seed is not None else checkpoint.target_seed
    # An export's config is the drafter's and the target's: both are its inputs (the target's files by sha256).
    inputs = [*checkpoint_refs, *target_inputs(settings, target, seed=target_seed)]
    exports = export_checkpoint(settings, checkpoint_dir=checkpoint_dir, inputs=inputs, run_name=run_name,
                                target=target, target_seed=target_seed, formats=list(params.formats))
    records = []
    for name, prefix in exports.items():
        records += publish_stored(settings, prefix=prefix, key=ui_key("export", run_name, name),
                                  title=f"{name} export of {run_name}")
    result = ExportResult(checkpoint=checkpoint.uri, exports=exports, flow_run=str(flow_run.id or ""),
                          artifacts=records)
    key = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "export", run_name, *attempt_segments(), RESULT_FILE)
    return store_result(settings, result, key=key, inputs=inputs)


if __name__ == "__main__":
    run_from_command_line(export, ExportParams)
