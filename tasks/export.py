"""Export a trained drafter in the formats vLLM and SGLang load, each file to S3 with a manifest."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import InputRef, write_artifact
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.provenance import run_producer


@task(retries=2, retry_delay_seconds=[5, 15])
def export_checkpoint(settings: Settings, *, checkpoint_dir: Path, inputs: list[InputRef], run_name: str,
                      target: str, target_seed: int, formats: list[str]) -> dict[str, str]:
    """format -> S3 prefix of the export (exports/<run>/<format>/, whose manifests name `inputs`: the
    checkpoint's files); a format the drafter cannot be expressed in is skipped and logged."""
    import torch  # here: the pipeline's process imports this module for the export stage's form only

    from dflash_core.evaluate.inputs import load_drafter_checkpoint
    from dflash_core.export import export_drafter
    from dflash_core.train.inputs import load_target_model

    logger = get_run_logger()
    store = ObjectStore.from_settings(settings)
    drafter = load_drafter_checkpoint(checkpoint_dir)
    target_model = load_target_model(target, device=torch.device("cpu"), models_dir=settings.work_path("models"),
                                     seed=target_seed)
    exported: dict[str, str] = {}
    for name in formats:
        try:
            directories = export_drafter(drafter, target_config=target_model.config, out_dir=checkpoint_dir / "export",
                                         verifier_name_or_path=target, formats=(name,))
        except ValueError as error:
            logger.warning("no %s export: %s", name, error)
            continue
        prefix = artifact_key(settings.s3_prefixes, ArtifactKind.EXPORT, run_name, name)
        for path in sorted(directories[name].iterdir()):
            write_artifact(store, f"{prefix}/{path.name}", path, kind=ArtifactKind.EXPORT, inputs=inputs,
                           config={"format": name, "run": run_name}, producer=run_producer())
        exported[name] = store.uri(prefix + "/")
    if not exported:
        raise ValueError(f"the drafter of {run_name} could be exported in none of {formats}")
    return exported
