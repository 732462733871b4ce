"""What one pipeline run did to the bucket, beside what the bucket holds: the bytes the run wrote by kind
(the objects whose manifests name one of its flow runs as their producer), the bucket's totals by kind
and by prefix group, unmanifested and dead objects, and what a cleanup with the given retention would
reclaim. Both sides count artifacts the same way: objects and bytes without their manifests. Computed
from one audit; no S3 call here.
"""

from __future__ import annotations

import io
from datetime import datetime
from typing import Any

import polars as pl
from pydantic import BaseModel

from dflash_core.s3audit.cleanup import CleanupPlan
from dflash_core.s3audit.dead import Retention
from dflash_core.s3audit.inventory import Inventory
from dflash_core.s3audit.report import AuditReport
from dflash_core.units import binary_bytes

USAGE_PREFIXES = 25  # prefix groups listed, largest first


class RunUsage(BaseModel):
    store_uri: str
    listed_at: datetime
    run_ids: list[str]
    written_objects: int
    written_bytes: int
    written_by_kind: list[dict[str, Any]]  # kind, objects, bytes
    bucket_objects: int
    bucket_bytes: int
    by_kind: list[dict[str, Any]]  # kind, objects, bytes, unmanifested, oldest, newest
    by_prefix: list[dict[str, Any]]  # group, kind, objects, bytes, unmanifested: the largest USAGE_PREFIXES
    num_prefixes: int
    unmanifested: int
    unmanifested_bytes: int
    dead_objects: int
    dead_bytes: int
    dead_by_rule: list[dict[str, Any]]
    protected: int
    retention: Retention
    generated_by_node: list[dict[str, Any]] = []  # node, shards, bytes, completion_tokens: a generation across nodes


def run_usage(inventory: Inventory, report: AuditReport, plan: CleanupPlan, *, run_ids: list[str],
              by_node: list[dict[str, Any]] | None = None) -> RunUsage:
    """The usage of the runs `run_ids` (a pipeline's flow run and its stages') in the audited bucket; with `by_node`
    (a generation across nodes: each node's `shards` as URIs and its `outcomes`), the shards and bytes each node
    generated."""
    ids = set(run_ids)
    written = {key for key, m in inventory.manifests.items() if m.producer.flow_run_id in ids}
    mine = inventory.artifacts.filter(pl.col("key").is_in(list(written)))  # as report.by_kind: no manifests
    by_kind = mine.group_by("kind").agg(objects=pl.len(), bytes=pl.col("bytes").sum()).sort("bytes", descending=True)
    return RunUsage(
        store_uri=report.store_uri, listed_at=report.listed_at, run_ids=sorted(ids),
        written_objects=mine.height, written_bytes=int(mine["bytes"].sum()), written_by_kind=by_kind.to_dicts(),
        bucket_objects=sum(r["objects"] for r in report.by_kind), bucket_bytes=sum(r["bytes"] for r in report.by_kind),
        by_kind=report.by_kind,
        by_prefix=[{k: row[k] for k in ("group", "kind", "objects", "bytes", "unmanifested")}
                   for row in report.by_group[:USAGE_PREFIXES]],
        num_prefixes=len(report.by_group), unmanifested=report.unmanifested,
        unmanifested_bytes=report.unmanifested_bytes, dead_objects=report.dead_objects, dead_bytes=report.dead_bytes,
        dead_by_rule=report.dead_by_rule, protected=report.protected, retention=plan.retention,
        generated_by_node=_generated_by_node(inventory, by_node or []))


def _generated_by_node(inventory: Inventory, by_node: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sizes = dict(zip(inventory.artifacts["key"].to_list(), inventory.artifacts["bytes"].to_list()))
    rows = []
    for share in by_node:
        keys = [uri.split("/", 3)[3] for uri in share.get("shards", []) if uri.count("/") >= 3]
        rows.append({"node": share["node"], "shards": len(keys), "bytes": sum(sizes.get(key, 0) for key in keys),
                     "completion_tokens": (share.get("outcomes") or {}).get("completion_tokens_now", 0),
                     "lost": share.get("lost")})
    return rows


def usage_markdown(usage: RunUsage) -> str:
    lines = [
        f"# S3 usage of this run in `{usage.store_uri}`",
        "",
        f"**This run wrote {usage.written_objects:,} objects, {binary_bytes(usage.written_bytes)}** (what its "
        f"{len(usage.run_ids)} flow runs are named producer of). The bucket holds {usage.bucket_objects:,} objects, "
        f"{binary_bytes(usage.bucket_bytes)}, listed {usage.listed_at:%Y-%m-%d %H:%M} UTC. Both count artifacts "
        f"without their .manifest.json files.",
        "",
        f"**A cleanup would reclaim {binary_bytes(usage.dead_bytes)}** ({usage.dead_objects:,} dead objects under "
        f"the retention keep_checkpoints={usage.retention.keep_checkpoints}, abandoned_after_days="
        f"{usage.retention.abandoned_after_days:g}; {usage.protected:,} more were nominated but are referenced by "
        f"live data and stay). **Unmanifested: {usage.unmanifested:,} objects, "
        f"{binary_bytes(usage.unmanifested_bytes)}** (no manifest: unknown provenance).",
        "",
        "## Written by this run, by kind",
        "",
        "| kind | objects | size |",
        "|---|---:|---:|",
        *[f"| {r['kind']} | {r['objects']:,} | {binary_bytes(r['bytes'])} |" for r in usage.written_by_kind],
        *(["| (nothing new: every stage reused earlier work) | 0 | 0 B |"] if not usage.written_by_kind else []),
        "",
        *(["## Generated, by node", "", "| node | completion shards | size | tokens generated now | dropped out |",
            "|---|---:|---:|---:|---|",
            *[f"| {r['node']} | {r['shards']:,} | {binary_bytes(r['bytes'])} | {r['completion_tokens']:,} | "
              f"{(r['lost'] or '-').replace('|', '/')[:160]} |" for r in usage.generated_by_node], ""]
          if usage.generated_by_node else []),
        "## The bucket, by kind",
        "",
        "| kind | objects | size | unmanifested | oldest | newest |",
        "|---|---:|---:|---:|---|---|",
        *[f"| {r['kind']} | {r['objects']:,} | {binary_bytes(r['bytes'])} | {r['unmanifested']:,} | "
          f"{str(r['oldest'])[:10]} | {str(r['newest'])[:10]} |" for r in usage.by_kind],
        "",
        f"## The bucket, by run prefix (the largest {len(usage.by_prefix)} of {usage.num_prefixes:,})",
        "",
        "| prefix | kind | objects | size | unmanifested |",
        "|---|---|---:|---:|---:|",
        *[f"| `{r['group']}/` | {r['kind']} | {r['objects']:,} | {binary_bytes(r['bytes'])} | {r['unmanifested']:,} |"
          for r in usage.by_prefix],
        "",
        "## Dead, by rule (what a cleanup would delete)",
        "",
        "| rule | objects | size |",
        "|---|---:|---:|",
        *[f"| {r['rule']} | {r['objects']:,} | {binary_bytes(r['bytes'])} |" for r in usage.dead_by_rule],
        *(["| (none) | 0 | 0 B |"] if not usage.dead_by_rule else []),
        "",
        "`dflash s3 audit` lists every dead and unmanifested key; `dflash s3 cleanup --confirm` deletes the dead ones.",
    ]
    return "\n".join(lines) + "\n"


def usage_png(usage: RunUsage) -> bytes:
    """Bytes per kind: the bucket's, and what this run wrote."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = {r["kind"]: r["bytes"] for r in usage.written_by_kind}
    kinds = [r["kind"] for r in usage.by_kind][::-1]
    total = [r["bytes"] / 2**20 for r in usage.by_kind][::-1]
    mine = [written.get(kind, 0) / 2**20 for kind in kinds]
    figure, axis = plt.subplots(figsize=(7, 0.5 * max(len(kinds), 2) + 1.4))
    positions = range(len(kinds))
    axis.barh([p + 0.2 for p in positions], total, height=0.4, color="#4c72b0", label="bucket")
    axis.barh([p - 0.2 for p in positions], mine, height=0.4, color="#dd8452", label="written by this run")
    for y, kind in enumerate(kinds):  # the sizes, which a linear axis hides for the small kinds
        axis.text(total[y], y + 0.2, f" {binary_bytes(int(total[y] * 2**20))}", va="center", fontsize=8)
        if written.get(kind):
            axis.text(mine[y], y - 0.2, f" {binary_bytes(written[kind])}", va="center", fontsize=8)
    axis.set_yticks(list(positions), kinds)
    axis.set_xlabel("MiB")
    axis.set_title(f"{usage.store_uri}: bytes per kind (reclaimable: {binary_bytes(usage.dead_bytes)})")
    axis.legend(loc="lower right")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
