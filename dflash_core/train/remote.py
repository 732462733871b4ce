"""Checkpoints to and from S3, each file with a manifest (inputs: the tokenized shards trained on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_core.layout import is_manifest_key
from dflash_core.lineage import InputRef, Manifest, write_artifact
from dflash_core.layout import ArtifactKind
from dflash_core.provenance import Producer
from dflash_core.storage import ObjectStore
from dflash_core.train.checkpoint import META_FILE, _FILES


def upload_checkpoint(store: ObjectStore, path: Path, *, key_prefix: str, inputs: list[InputRef],
                      config: dict, producer: Producer | None = None,
                      unchanged: Callable[[str], bool] | None = None) -> list[Manifest]:
    """Upload one checkpoint dir to `<key_prefix>/<step dir>/`, each file with its manifest; meta.json
    goes last so a reader that sees it sees a complete checkpoint. Files for which `unchanged(name)`
    holds (already in S3, verified) are skipped; returns the manifests written."""
    manifests = []
    for name in sorted(_FILES, key=lambda n: n == META_FILE):
        if unchanged is not None and unchanged(name):
            continue
        manifests.append(write_artifact(store, f"{key_prefix}/{path.name}/{name}", path / name,
                                        kind=ArtifactKind.CHECKPOINT, inputs=inputs, config=config,
                                        producer=producer))
    return manifests


def remote_steps(store: ObjectStore, key_prefix: str) -> list[int]:
    """Steps with a complete checkpoint (meta.json present) under `key_prefix`."""
    steps = set()
    for info in store.list(key_prefix.rstrip("/") + "/"):
        parts = info.key.rsplit("/", 2)
        if len(parts) == 3 and parts[2] == META_FILE and parts[1].startswith("step-") \
                and not is_manifest_key(info.key):
            steps.add(int(parts[1].split("-")[1]))
    return sorted(steps)


def download_checkpoint(store: ObjectStore, *, key_prefix: str, step: int, root: Path) -> Path:
    name = f"step-{step:06d}"
    target = root / name
    for file in _FILES:
        store.get_file(f"{key_prefix.rstrip('/')}/{name}/{file}", target / file)
    return target
