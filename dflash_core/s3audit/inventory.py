"""The bucket as a table: every object from the paginated listing, classified by artifact kind and
prefix group, joined with what the manifests say, and summarized with polars.

One listing, one parallel read of the manifests, optional parallel HEADs to compare each object's
sha256 with its manifest. Everything after that is computation on the frames (no more S3 calls).

Prefect's own persisted results (`prefect-results/` at the bucket root, its task cache) are their own
kind, "prefect-results": not "unknown", and never counted as unmanifested (they are not artifacts and
never have manifests: `needs_manifest` is false for them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

import polars as pl

from dflash_core.layout import MANIFEST_SUFFIX, PREFECT_RESULTS_FOLDER, ArtifactKind
from dflash_core.lineage import UNKNOWN_KIND, LineageGraph, Manifest
from dflash_core.storage import ObjectNotFound, ObjectStore

PREFECT_RESULTS_KIND = "prefect-results"  # Prefect's persisted results under PREFECT_RESULTS_FOLDER/
# How many leading key segments name one unit of work (a dataset version, a run, a node).
GROUP_DEPTH: dict[str, int] = {
    ArtifactKind.PROMPTS: 3, ArtifactKind.COMPLETIONS: 3, ArtifactKind.TOKENIZED: 3, ArtifactKind.CHECKPOINT: 2,
    ArtifactKind.EXPORT: 2, ArtifactKind.NODE_BACKUP: 2, ArtifactKind.REPORT: 3, ArtifactKind.SCRATCH: 2,
    PREFECT_RESULTS_KIND: 2, UNKNOWN_KIND: 2,
}
# S3 connections per client are pooled (10 by default): more threads than that only queue.
DEFAULT_WORKERS = 8

OBJECT_SCHEMA = {"key": pl.String, "bytes": pl.Int64, "last_modified": pl.Datetime("us", "UTC"), "etag": pl.String}


@dataclass
class Inventory:
    """The listing (`objects`: one row per object, manifests included) and the parsed manifests."""

    store_uri: str  # s3://bucket/prefix that was listed
    bucket_uri: str  # s3://bucket/
    prefixes: dict[ArtifactKind, str]
    listed_at: datetime
    objects: pl.DataFrame
    manifests: dict[str, Manifest]  # by artifact key
    unreadable_manifests: dict[str, str] = field(default_factory=dict)  # manifest key -> why
    hash_problems: dict[str, str] = field(default_factory=dict)  # artifact key -> what differs

    @property
    def artifacts(self) -> pl.DataFrame:
        """Objects that are not manifests, with `has_manifest`."""
        return self.objects.filter(~pl.col("is_manifest"))

    def uri(self, key: str) -> str:
        return self.bucket_uri + key

    def graph(self) -> LineageGraph:
        return LineageGraph(self.manifests.values())


def list_objects(store: ObjectStore, prefix: str = "") -> pl.DataFrame:
    """One row per object under `prefix` (key, bytes, last_modified, etag), across every page."""
    keys: list[str] = []
    sizes: list[int] = []
    modified: list[datetime | None] = []
    etags: list[str] = []
    for info in store.list(prefix):
        keys.append(info.key)
        sizes.append(info.size)
        modified.append(info.last_modified)
        etags.append(info.etag)
    return pl.DataFrame({"key": keys, "bytes": sizes, "last_modified": modified, "etag": etags}, schema=OBJECT_SCHEMA)


def classify(objects: pl.DataFrame, prefixes: dict[ArtifactKind, str]) -> pl.DataFrame:
    """Add is_manifest, artifact_key (a manifest's artifact), kind (the longest kind prefix the key is under;
    "prefect-results" for Prefect's results, "unknown" for none), group (the kind prefix plus the segments that
    name one unit of work), needs_manifest (false for Prefect's results), has_manifest, object_exists."""
    kind = pl.lit(UNKNOWN_KIND)
    depth = pl.lit(GROUP_DEPTH[UNKNOWN_KIND])
    rules = [*sorted(((str(k), prefix) for k, prefix in prefixes.items()), key=lambda item: len(item[1])),
             (PREFECT_RESULTS_KIND, PREFECT_RESULTS_FOLDER)]  # longest match applied last; Prefect's folder wins
    for k, prefix in rules:
        under = pl.col("key").str.starts_with(prefix.rstrip("/") + "/")
        kind = pl.when(under).then(pl.lit(k)).otherwise(kind)
        depth = pl.when(under).then(pl.lit(len(prefix.strip("/").split("/")) + GROUP_DEPTH[k] - 1)).otherwise(depth)
    frame = objects.with_columns(
        is_manifest=pl.col("key").str.ends_with(MANIFEST_SUFFIX), parts=pl.col("key").str.split("/"),
        kind=kind, depth=depth,
    ).with_columns(needs_manifest=pl.col("kind") != PREFECT_RESULTS_KIND).with_columns(
        artifact_key=pl.when(pl.col("is_manifest")).then(pl.col("key").str.strip_suffix(MANIFEST_SUFFIX))
        .otherwise(pl.col("key")),
        group=pl.col("parts").list.head(pl.min_horizontal(pl.col("depth"), pl.col("parts").list.len() - 1))
        .list.join("/"),
    ).with_columns(group=pl.when(pl.col("group") == "").then(pl.lit("/")).otherwise(pl.col("group")))
    manifested = frame.filter(pl.col("is_manifest"))["artifact_key"].implode()
    present = frame.filter(~pl.col("is_manifest"))["key"].implode()
    return frame.with_columns(
        has_manifest=pl.col("key").is_in(manifested) & ~pl.col("is_manifest"),
        object_exists=pl.col("artifact_key").is_in(present),
    ).drop("parts", "depth")


def take_inventory(store: ObjectStore, prefixes: dict[ArtifactKind, str], prefix: str = "", *,
                   verify_hashes: bool = True, workers: int = DEFAULT_WORKERS,
                   known: dict[str, tuple[str, Manifest]] | None = None) -> Inventory:
    """List, classify, read every manifest (in parallel), and optionally HEAD every manifested object to
    compare its recorded sha256 with the manifest's. `known` (manifest key -> (etag, manifest)) skips
    re-reading manifests whose ETag has not changed since an earlier inventory."""
    listed_at = datetime.now(UTC)
    objects = classify(list_objects(store, prefix), prefixes)
    manifest_rows = objects.filter(pl.col("is_manifest")).select("key", "etag").rows()
    known = known or {}
    manifests: dict[str, Manifest] = {}
    unreadable: dict[str, str] = {}

    def read(row: tuple[str, str]) -> tuple[str, str, Manifest | str]:
        key, etag = row
        if key in known and known[key][0] == etag:
            return key, etag, known[key][1]
        try:
            return key, etag, Manifest.model_validate_json(store.get_bytes(key))
        except ObjectNotFound:
            return key, etag, "deleted while the audit ran"
        except ValueError as error:
            return key, etag, f"not a valid manifest: {str(error).splitlines()[0]}"

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for key, _, parsed in pool.map(read, manifest_rows):
            if isinstance(parsed, Manifest):
                manifests[key.removesuffix(MANIFEST_SUFFIX)] = parsed
            else:
                unreadable[key] = parsed
    inventory = Inventory(store_uri=store.uri(prefix), bucket_uri=store.uri(""), prefixes=dict(prefixes),
                          listed_at=listed_at, objects=objects, manifests=manifests,
                          unreadable_manifests=unreadable)
    present = set(objects.filter(~pl.col("is_manifest"))["key"].to_list())
    sizes = dict(objects.filter(~pl.col("is_manifest")).select("key", "bytes").rows())
    for key, manifest in manifests.items():
        if key in present and sizes[key] != manifest.bytes:
            inventory.hash_problems[key] = f"{sizes[key]:,} bytes, its manifest says {manifest.bytes:,}"
    if verify_hashes:
        def head(key: str) -> tuple[str, str | None]:
            try:
                return key, store.head(key).sha256
            except ObjectNotFound:
                return key, None

        to_check = [k for k in manifests if k in present and k not in inventory.hash_problems]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for key, sha in pool.map(head, to_check):
                if sha is not None and sha != manifests[key].sha256:
                    inventory.hash_problems[key] = f"sha256 {sha[:12]}..., its manifest says {manifests[key].sha256[:12]}..."
    return inventory


def manifest_cache(inventory: Inventory) -> dict[str, tuple[str, Manifest]]:
    """manifest key -> (etag, manifest), to pass as `known` to a later take_inventory."""
    etags = dict(inventory.objects.filter(pl.col("is_manifest")).select("key", "etag").rows())
    return {key + MANIFEST_SUFFIX: (etags[key + MANIFEST_SUFFIX], m) for key, m in inventory.manifests.items()
            if key + MANIFEST_SUFFIX in etags}


def summarize(artifacts: pl.DataFrame, by: str | list[str], *, now: datetime | None = None) -> pl.DataFrame:
    """Objects, bytes, oldest/newest and age in days per `by` (artifact rows; manifests excluded). `unmanifested`
    counts only objects that should have a manifest (not Prefect's results)."""
    now = now or datetime.now(UTC)
    return (artifacts.group_by(by).agg(
        objects=pl.len(), bytes=pl.col("bytes").sum(),
        unmanifested=(~pl.col("has_manifest") & pl.col("needs_manifest")).sum(),
        oldest=pl.col("last_modified").min(), newest=pl.col("last_modified").max(),
    ).with_columns(
        age_days=((pl.lit(now) - pl.col("oldest")).dt.total_seconds() / 86400).round(1),
        newest_days=((pl.lit(now) - pl.col("newest")).dt.total_seconds() / 86400).round(1),
    ).sort("bytes", descending=True))
