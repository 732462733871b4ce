"""Store a stage's typed result in S3 (its `result.json`, with a manifest, then the lineage pages of what the
stage made: a task) and resolve what a stage was given as input: the upstream record itself, the URI of its
result.json, or for a checkpoint a bare step dir whose meta.json names its run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from prefect import task

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import InputRef, write_artifact
from dflash_core.settings import Settings
from dflash_core.stage_results import Checkpoint, StageResult, parse_result
from dflash_core.storage import ObjectStore
from tasks.artifacts import artifact_record, publish_lineage
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage

R = TypeVar("R", bound=StageResult)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def store_result(settings: Settings, result: R, *, key: str, inputs: tuple[InputRef, ...] | list[InputRef] = ()) -> R:
    """`result` with its `result_uri` set and its own record added to `artifacts`, written to `key`; then the
    lineage page of each node the stage made (tasks.artifacts.publish_lineage), `inputs` among its inputs."""
    store = ObjectStore.from_settings(settings)
    stored = result.model_copy(update={"result_uri": store.uri(key)})
    manifest = write_artifact(store, key, stored.to_json_bytes(), kind=ArtifactKind.REPORT, inputs=list(inputs),
                              config={"result": stored.kind}, producer=run_producer())
    stored = stored.model_copy(update={"artifacts": [*stored.artifacts, artifact_record(manifest)]})
    publish_lineage(settings, store, stored, inputs=inputs)
    return stored


def resolve_result(settings: Settings, value: R | str, model: type[R]) -> R:
    """`value` when it is already the record, else the record stored at that URI (S3 URI or key, or a
    local file); a ValueError saying what was expected otherwise."""
    if isinstance(value, model):
        return value
    local = Path(value)
    if local.is_file():
        return parse_result(local.read_bytes(), model, name=value)
    store = ObjectStore.from_settings(settings)
    key = store.key_of(value)
    if not store.exists(key):
        raise ValueError(f"{value!r} is neither a local file nor an object in {store.uri('')}: pass the "
                         f"result.json URI that the upstream stage's run printed (or its result inline)")
    return parse_result(store.get_bytes(key), model, name=store.uri(key))


def resolve_checkpoint(settings: Settings, value: Checkpoint | str | None, *, target: str | None = None) -> Checkpoint:
    """The checkpoint record: as given, from a train result.json, or a bare step dir (local or S3) whose
    meta.json names its run and target (`target` when it names none)."""
    if value is None:
        raise ValueError("no checkpoint given: pass the train stage's result, its result.json URI, or a step dir "
                         "(checkpoints/RUN/step-NNNNNN, local or in S3)")
    if isinstance(value, str) and not value.endswith(".json"):  # a bare step dir: its meta.json names the run
        meta = _checkpoint_meta(settings, value)
        config = meta.get("config") or {}
        target = config.get("target") or target
        if not target:
            raise ValueError(f"checkpoint {value!r}: its meta.json names no target; pass the train stage's "
                             f"result.json instead, or set target")
        return Checkpoint(uri=value, run_name=config.get("run_name", "drafter"), step=int(meta.get("step", 0)),
                          target=target, target_seed=int(config.get("seed", 0)))
    return resolve_result(settings, value, Checkpoint)


def _checkpoint_meta(settings: Settings, checkpoint: str) -> dict:
    """meta.json of a step dir, local or in S3 (its presence marks a complete checkpoint)."""
    from dflash_core.layout import CHECKPOINT_META_FILE

    local = Path(checkpoint) / CHECKPOINT_META_FILE
    if local.is_file():
        return json.loads(local.read_text())
    store = ObjectStore.from_settings(settings)
    key = f"{store.key_of(checkpoint).rstrip('/')}/{CHECKPOINT_META_FILE}"
    if not store.exists(key):
        raise ValueError(f"checkpoint {checkpoint!r} is neither a local dir nor an S3 checkpoint with "
                         f"{CHECKPOINT_META_FILE}")
    return json.loads(store.get_bytes(key))
