"""Prefect tasks over the object store: health check and report publishing with manifests."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import Manifest, read_manifest, verify_artifact, write_artifact
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.provenance import run_producer


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def check_store(settings: Settings) -> str:
    """Fail fast (naming the setting to fix) when the S3 endpoint, credentials or bucket are wrong."""
    store = ObjectStore.from_settings(settings)
    store.check()
    return store.uri("")


@task(retries=3, retry_delay_seconds=[2, 5, 15])
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
    create_link_artifact(link=store.presigned_url(key, expires_s=7 * 24 * 3600), link_text=manifest.uri,
                         key=f"{name}-report", description=f"{name} report (sha256 {manifest.sha256[:12]})")
    return manifest
