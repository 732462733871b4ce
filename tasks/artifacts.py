"""What a flow made, for the UI and for the next flow: the record of a stored artifact (URI, kind,
sha256, manifest URI) that every flow returns as its result, Prefect artifact keys scoped to a
dataset/run (so one run's table never replaces another's), and a manifest shown as markdown."""

from __future__ import annotations

import re

from prefect import task
from prefect.artifacts import create_markdown_artifact

from dflash_core.layout import ArtifactKind, is_manifest_key, manifest_key
from dflash_core.lineage import Manifest, read_manifest
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.store import retry_transient

_NOT_KEY = re.compile(r"[^a-z0-9-]+")


def artifact_record(manifest: Manifest) -> dict[str, str]:
    """The record of one stored artifact: a downstream deployment can take a list of these as a parameter."""
    return stored_record(manifest.uri, kind=manifest.kind, sha256=manifest.sha256)


def stored_record(uri: str, *, kind: ArtifactKind | str, sha256: str) -> dict[str, str]:
    """The same record from what a task returned (its manifest sits beside the object)."""
    return {"uri": uri, "kind": str(getattr(kind, "value", kind)), "sha256": sha256, "manifest": manifest_key(uri)}


def ui_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from parts such as (name, dataset, run)."""
    return _NOT_KEY.sub("-", "-".join(parts).lower()).strip("-")[:200]


def manifest_markdown(manifest: Manifest, *, title: str) -> str:
    producer = manifest.producer
    inputs = "\n".join(f"| `{i.uri}` | `{i.sha256 or '?'}` |" for i in manifest.inputs) or "| (none) | |"
    return (f"### {title}\n\n`{manifest.uri}` ({manifest.bytes:,} bytes)\n\nsha256 `{manifest.sha256}`; "
            f"manifest `{manifest_key(manifest.uri)}`\n\n"
            f"Producer: git `{producer.git_sha}`, flow run `{producer.flow_run_id}`, task run `{producer.task_run_id}`, "
            f"host `{producer.host}`, dflash {producer.package_version}\n\n"
            f"| input | sha256 |\n|---|---|\n{inputs}\n\n"
            f"Read it with the project's S3 credentials (`aws s3 cp {manifest.uri} .`); no presigned link is "
            f"stored here, since it is a bearer token.")


def manifest_artifact(manifest: Manifest, *, key: str, title: str) -> None:
    """The stored artifact's manifest (producer, git SHA, inputs with hashes) as a markdown artifact."""
    create_markdown_artifact(manifest_markdown(manifest, title=title), key=key, description=title)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_transient)
def publish_stored(settings: Settings, *, prefix: str, key: str, title: str) -> list[dict[str, str]]:
    """One markdown artifact with the manifest of every stored object under `prefix` (a checkpoint
    step, an export), and their records."""
    store = ObjectStore.from_settings(settings)
    prefix = prefix.removeprefix(f"s3://{store.bucket}/").rstrip("/") + "/"
    manifests = [read_manifest(store, info.key) for info in sorted(store.list(prefix), key=lambda i: i.key)
                 if not is_manifest_key(info.key)]
    if not manifests:
        raise ValueError(f"nothing stored under {store.uri(prefix)}")
    create_markdown_artifact(f"## {title}\n\n" + "\n\n".join(
        manifest_markdown(m, title=m.key.rsplit("/", 1)[-1]) for m in manifests), key=key, description=title)
    return [artifact_record(m) for m in manifests]
