"""Prefect tasks over the object store: health check and report publishing with manifests, and the
artifact helpers that show stored images and reports in the UI without key material (a presigned
URL carries the access key id and is a bearer token: none is ever written to the Prefect database)."""

from __future__ import annotations

import base64
import json
from typing import Any

from prefect import task
from prefect.artifacts import create_image_artifact, create_markdown_artifact

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import Manifest, read_manifest, verify_artifact, write_artifact
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage


def png_artifact(png: bytes, *, key: str, description: str) -> None:
    """An image artifact that embeds the PNG itself (a data: URI): no link to S3, no key material."""
    create_image_artifact(image_url="data:image/png;base64," + base64.b64encode(png).decode(), key=key,
                          description=description)


def object_artifact(uri: str, *, key: str, title: str, sha256: str) -> None:
    """A markdown artifact naming a stored object (URI and hash) instead of a presigned link."""
    create_markdown_artifact(
        f"### {title}\n\n`{uri}`\n\nsha256 `{sha256}`. Read it with the project's S3 credentials (e.g. "
        f"`aws s3 cp {uri} .`); no link is stored here, since a presigned link is a bearer token.",
        key=key, description=title)


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_store_outage)
def check_store(settings: Settings) -> str:
    """Fail within seconds, naming the setting to fix, when the S3 endpoint is unreachable or not S3,
    or the credentials or bucket are wrong; only a transient fault is retried (once)."""
    store = ObjectStore.from_settings(settings)
    store.check()
    return store.uri("")


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def publish_report(settings: Settings, *, name: str, run_id: str, report: dict[str, Any],
                   config: dict[str, Any] | None = None) -> Manifest:
    """Write a JSON report with its manifest, read both back and verify the round trip."""
    store = ObjectStore.from_settings(settings)
    key = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, name, run_id, f"{name}.json")
    payload = json.dumps(report, indent=2, sort_keys=True, default=str).encode()
    manifest = write_artifact(store, key, payload, kind=ArtifactKind.REPORT, config=config,
                              producer=run_producer())
    if store.get_bytes(key) != payload or read_manifest(store, key) != manifest:
        raise RuntimeError(f"{manifest.uri}: the report read back differs from what was written")
    problems = verify_artifact(store, manifest)
    if problems:
        raise RuntimeError("; ".join(problems))
    object_artifact(manifest.uri, key=f"{name}-report", title=f"{name} report", sha256=manifest.sha256)
    return manifest
