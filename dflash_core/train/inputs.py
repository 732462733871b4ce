"""Where a run's target and tokenized shards come from: local paths, S3 keys or prefixes,
`embedded` or `tiny:<family>`. Downloads go to a local cache; S3 inputs are recorded for lineage.
Every shard's quality-gate verdict is checked before anything trains on it (`data.verdict`)."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_core.data.verdict import (
    DATASET_MANIFEST_NAME, DatasetManifest, check_usable, read_dataset_manifest, shard_verdict,
)
from dflash_core.layout import is_heldout_key
from dflash_core.storage.local_paths import path_inside

if TYPE_CHECKING:  # storage needs boto3, which a bare GPU image may lack; torch only the target needs
    import torch
    from torch import nn

    from dflash_core.lineage import InputRef
    from dflash_core.storage import ObjectStore


def fetch_shards(items: list[str], *, store: ObjectStore | None, cache_dir: Path,
                 allow_failed_quality_gate: bool = False) -> list[tuple[Path, InputRef | None]]:
    """Local Arrow paths for every data item (an existing local file, an S3 key, or an S3 prefix
    ending in '/'), each with its S3 input reference when it came from S3.

    Refuses (`UnusableData`) shards whose quality gate failed or is unknown, naming each one and its
    failed checks, unless `allow_failed_quality_gate` (then each is a warning)."""
    if not items:
        raise ValueError("no training data: config.data is empty (the train flow fills it from its dataset input; "
                         "`dflash train` needs data: in run.yaml)")
    shards: list[tuple[Path, InputRef | None]] = []
    verdicts = []
    manifests: dict[str, DatasetManifest | None] = {}
    for item in items:
        if is_heldout_key(item):
            raise ValueError(f"data item {item!r} is a held-out shard: the evaluation split is never trained on")
        local = Path(item)
        if local.is_file():
            shards.append((local, None))
            manifest = _local_manifest(local.parent, manifests)
            sha256 = _sha256_file(local) if manifest is not None else None
            verdicts.append((str(local), *shard_verdict(sha256=sha256, metadata=_arrow_metadata(local),
                                                        manifest=manifest, name=str(local))))
            continue
        if store is None:
            raise ValueError(f"data item {item!r} is not a local file and no object store is configured")
        from dflash_core.lineage import InputRef  # boto3 only where S3 is used (bare GPU images lack it)

        key = store.key_of(item)
        keys = [key] if not key.endswith("/") else sorted(
            i.key for i in store.list(key) if i.key.endswith(".arrow") and not is_heldout_key(i.key))
        if not keys:
            raise ValueError(f"data item {item!r}: no .arrow shards under {store.uri(key)}")
        for shard_key in keys:
            path = path_inside(cache_dir, shard_key)
            info = store.head(shard_key)
            cached = path.is_file() and path.stat().st_size == info.size and \
                (info.sha256 is None or _sha256_file(path) == info.sha256)
            if not cached:  # a re-tokenized shard can keep its size: the hash decides
                store.get_file(shard_key, path)
            shards.append((path, InputRef(uri=store.uri(shard_key), sha256=info.sha256)))
            manifest = _s3_manifest(store, shard_key.rsplit("/", 1)[0] if "/" in shard_key else "", manifests)
            verdicts.append((store.uri(shard_key), *shard_verdict(
                sha256=info.sha256 or _sha256_file(path), metadata=_arrow_metadata(path), manifest=manifest,
                name=store.uri(shard_key))))
    for warning in check_usable(verdicts, allow_failed=allow_failed_quality_gate):
        warnings.warn(warning, stacklevel=2)
    return shards


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _arrow_metadata(path: Path) -> dict[bytes, bytes] | None:
    """The schema metadata of an Arrow IPC file (only its footer is read); None if it is not one."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).schema.metadata
    except (pa.ArrowInvalid, OSError):
        return None  # read_shard_table reports what is wrong with it


def _local_manifest(directory: Path, cache: dict[str, DatasetManifest | None]) -> DatasetManifest | None:
    key = f"file:{directory}"
    if key not in cache:
        path = directory / DATASET_MANIFEST_NAME
        cache[key] = read_dataset_manifest(path.read_bytes(), name=str(path)) if path.is_file() else None
    return cache[key]


def _s3_manifest(store: ObjectStore, prefix: str, cache: dict[str, DatasetManifest | None]) -> DatasetManifest | None:
    key = f"{prefix}/{DATASET_MANIFEST_NAME}" if prefix else DATASET_MANIFEST_NAME
    if key not in cache:
        cache[key] = read_dataset_manifest(store.get_bytes(key), name=store.uri(key)) if store.exists(key) else None
    return cache[key]


def load_target_model(spec: str, *, device: torch.device, models_dir: Path, seed: int) -> nn.Module:
    """The frozen target: `embedded` (SmolLM2, converted once), `tiny:<family>` (random, seeded),
    `random:<shape>` (random weights at a real shape, e.g. random:qwen3-8b, for benchmarks) or a path."""
    import torch

    from dflash_core.target import build_target, build_target_on_device, load_target, real_shape_config
    from dflash_core.target import tiny_target_config

    if spec == "embedded":
        from dflash_core.embedded import embedded_model_dir

        return load_target(str(embedded_model_dir(models_dir)), device=device)
    if spec.startswith("tiny:"):
        torch.manual_seed(seed)
        # A wide init gives the tiny frozen LM head logits confident enough to learn against.
        return build_target(tiny_target_config(spec.split(":", 1)[1], initializer_range=0.5), device=device)
    if spec.startswith("random:"):
        torch.manual_seed(seed)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return build_target_on_device(real_shape_config(spec.split(":", 1)[1]), device=device, dtype=dtype)
    if not Path(spec).is_dir():
        raise ValueError(f"target {spec!r} is neither `embedded`, `tiny:<family>`, `random:<shape>` nor a model directory")
    return load_target(spec, device=device)
