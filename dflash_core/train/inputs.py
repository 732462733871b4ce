"""Where a run's target and tokenized shards come from: local paths, S3 keys or prefixes,
`embedded` or `tiny:<family>`. Downloads go to a local cache; S3 inputs are recorded for lineage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # storage needs boto3, which a bare GPU image may lack: imported when used
    from dflash_core.lineage import InputRef
    from dflash_core.storage import ObjectStore


def fetch_shards(items: list[str], *, store: ObjectStore | None, cache_dir: Path) -> list[tuple[Path, InputRef | None]]:
    """Local Arrow paths for every data item (an existing local file, an S3 key, or an S3 prefix
    ending in '/'), each with its S3 input reference when it came from S3."""
    shards: list[tuple[Path, InputRef | None]] = []
    for item in items:
        local = Path(item)
        if local.is_file():
            shards.append((local, None))
            continue
        if store is None:
            raise ValueError(f"data item {item!r} is not a local file and no object store is configured")
        from dflash_core.lineage import InputRef  # boto3 only where S3 is used (bare GPU images lack it)
        from dflash_core.storage import sha256_file

        key = item.removeprefix(f"s3://{store.bucket}/")
        keys = [key] if not key.endswith("/") else sorted(
            i.key for i in store.list(key) if i.key.endswith(".arrow"))
        if not keys:
            raise ValueError(f"data item {item!r}: no .arrow shards under {store.uri(key)}")
        for shard_key in keys:
            info = store.head(shard_key)
            path = cache_dir / shard_key
            cached = path.is_file() and path.stat().st_size == info.size and \
                (info.sha256 is None or sha256_file(path) == info.sha256)
            if not cached:  # a re-tokenized shard can keep its size: the hash decides
                store.get_file(shard_key, path)
            shards.append((path, InputRef(uri=store.uri(shard_key), sha256=info.sha256)))
    return shards


def load_target_model(spec: str, *, device: torch.device, models_dir: Path, seed: int) -> nn.Module:
    """The frozen target: `embedded` (SmolLM2, converted once), `tiny:<family>` (random, seeded),
    `random:<shape>` (random weights at a real shape, e.g. random:qwen3-8b, for benchmarks) or a path."""
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
