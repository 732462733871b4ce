"""The audit as a report: JSON-able summary, markdown, rows for a table, a PNG of bytes per kind, and the
lineage between artifact groups as a table of edges (what the Prefect UI renders)."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

import polars as pl
from pydantic import BaseModel, Field

from dflash_core.layout import ArtifactKind
from dflash_core.lineage_views import NodeEdge, bucket_kind_of, edges_markdown, node_edges
from dflash_core.s3audit.cleanup import CleanupPlan, plan_cleanup
from dflash_core.s3audit.dead import Retention
from dflash_core.s3audit.inventory import (
    DEFAULT_WORKERS, PREFECT_RESULTS_KIND, Inventory, summarize, take_inventory,
)
from dflash_core.storage import ObjectStore
from dflash_core.units import binary_bytes

LISTED = 100  # keys listed per problem in the report (counts are always complete)
LINEAGE_EDGES = 200  # edges between artifact groups kept in the report, newest first


class AuditReport(BaseModel):
    store_uri: str
    listed_at: datetime
    seconds: float
    objects: int
    bytes: int
    manifests: int
    by_kind: list[dict[str, Any]]
    by_group: list[dict[str, Any]]
    unmanifested: int
    unmanifested_bytes: int
    unmanifested_keys: list[str] = Field(description=f"The first {LISTED}.")
    orphan_manifests: list[str]
    hash_problems: dict[str, str]
    unreadable_manifests: dict[str, str]
    stale_inputs: list[tuple[str, str]]
    dead_objects: int
    dead_bytes: int
    dead_by_rule: list[dict[str, Any]]
    protected: int
    incomplete_uploads: list[dict[str, Any]] = Field(
        default_factory=list, description="Multipart uploads never completed nor aborted (their parts use space "
        "without being objects): key, upload_id, initiated.")
    lineage: list[NodeEdge] = Field(default_factory=list, description=(
        f"Edges between artifact groups (a dataset run, a checkpoint step, an export, a report) under the prefix and "
        f"their inputs, newest first, at most {LINEAGE_EDGES}."))


def audit(store: ObjectStore, prefixes: dict[ArtifactKind, str], *, prefix: str = "",
          retention: Retention | None = None, verify_hashes: bool = True, workers: int = DEFAULT_WORKERS,
          now: datetime | None = None) -> tuple[Inventory, AuditReport, CleanupPlan]:
    """Inventory the whole bucket (lineage needs all of it), report on `prefix`, and plan a cleanup (dry run)."""
    start = datetime.now(UTC)
    inventory = take_inventory(store, prefixes, verify_hashes=verify_hashes, workers=workers)
    plan = plan_cleanup(inventory, retention or Retention(), prefix=prefix, now=now)
    report = build_report(inventory, plan, prefix=prefix, now=now,
                          seconds=(datetime.now(UTC) - start).total_seconds())
    report.incomplete_uploads = [{**u, "initiated": u["initiated"].isoformat() if u.get("initiated") else None}
                                 for u in store.incomplete_uploads(prefix)]
    return inventory, report, plan


def build_report(inventory: Inventory, plan: CleanupPlan, *, prefix: str = "", now: datetime | None = None,
                 seconds: float = 0.0) -> AuditReport:
    objects = inventory.objects.filter(pl.col("key").str.starts_with(prefix))
    artifacts = objects.filter(~pl.col("is_manifest"))
    unmanifested = artifacts.filter(~pl.col("has_manifest") & pl.col("needs_manifest"))  # not Prefect's results
    graph = inventory.graph()
    dead = pl.DataFrame([c.model_dump() for c in plan.candidates],
                        schema={"key": pl.String, "bytes": pl.Int64, "etag": pl.String, "kind": pl.String,
                                "group": pl.String, "rule": pl.String, "reason": pl.String})
    dead_by_rule = dead.group_by("rule").agg(objects=pl.len(), bytes=pl.col("bytes").sum()).sort("bytes", descending=True)
    return AuditReport(
        store_uri=inventory.bucket_uri + prefix, listed_at=inventory.listed_at, seconds=round(seconds, 2),
        objects=objects.height, bytes=int(objects["bytes"].sum()), manifests=int(objects["is_manifest"].sum()),
        by_kind=_rows(summarize(artifacts, "kind", now=now)),
        by_group=_rows(summarize(artifacts, ["kind", "group"], now=now)),
        unmanifested=unmanifested.height, unmanifested_bytes=int(unmanifested["bytes"].sum()),
        unmanifested_keys=unmanifested.sort("key")["key"].head(LISTED).to_list(),
        orphan_manifests=sorted(objects.filter(pl.col("is_manifest") & ~pl.col("object_exists"))["key"].to_list()),
        hash_problems={k: v for k, v in sorted(inventory.hash_problems.items()) if k.startswith(prefix)},
        unreadable_manifests={k: v for k, v in sorted(inventory.unreadable_manifests.items()) if k.startswith(prefix)},
        stale_inputs=sorted(p for p in graph.stale_inputs() if p[0].startswith(inventory.bucket_uri + prefix)),
        dead_objects=dead.height, dead_bytes=int(dead["bytes"].sum()), dead_by_rule=_rows(dead_by_rule),
        protected=len(plan.protected),
        lineage=node_edges(graph, kind_of=bucket_kind_of(inventory.bucket_uri, inventory.prefixes),
                           prefix_uri=inventory.bucket_uri + prefix, max_edges=LINEAGE_EDGES),
    )


def _rows(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}
            for row in frame.iter_rows(named=True)]


def kind_table_rows(report: AuditReport) -> list[dict[str, Any]]:
    """Rows for a Prefect table artifact: one per kind, sizes readable."""
    return [{"kind": r["kind"], "objects": r["objects"], "bytes": r["bytes"], "size": binary_bytes(r["bytes"]),
             "unmanifested": r["unmanifested"], "oldest": r["oldest"], "newest": r["newest"],
             "age_days": r["age_days"]} for r in report.by_kind]


def audit_markdown(report: AuditReport, plan: CleanupPlan, *, max_rows: int = 25) -> str:
    lines = [
        f"# S3 audit of `{report.store_uri}`",
        "",
        f"{report.objects:,} objects, {binary_bytes(report.bytes)} ({report.manifests:,} manifests), listed "
        f"{report.listed_at:%Y-%m-%d %H:%M} UTC in {report.seconds:.1f} s.",
        "",
        f"**Dead: {report.dead_objects:,} objects, {binary_bytes(report.dead_bytes)}** (a cleanup would delete "
        f"these; {report.protected} more were nominated but are referenced by live data and stay).",
        "",
        "| kind | objects | size | unmanifested | oldest | newest |",
        "|---|---:|---:|---:|---|---|",
        *[f"| {r['kind']} | {r['objects']:,} | {binary_bytes(r['bytes'])} | {r['unmanifested']:,} | "
          f"{str(r['oldest'])[:10]} | {str(r['newest'])[:10]} |" for r in report.by_kind],
        "",
        _prefect_results_line(report, plan),
        "",
        "## Largest prefixes",
        "",
        "| prefix | kind | objects | size | unmanifested | idle days |",
        "|---|---|---:|---:|---:|---:|",
        *[f"| `{r['group']}/` | {r['kind']} | {r['objects']:,} | {binary_bytes(r['bytes'])} | {r['unmanifested']:,} | "
          f"{r['newest_days']} |" for r in report.by_group[:max_rows]],
        "",
        "## Dead, by rule",
        "",
        "| rule | objects | size |",
        "|---|---:|---:|",
        *[f"| {r['rule']} | {r['objects']:,} | {binary_bytes(r['bytes'])} |" for r in report.dead_by_rule],
        "",
        *[f"- `{c.key}` ({binary_bytes(c.bytes)}): {c.reason}" for c in plan.candidates[:max_rows]],
        *([f"- ... {len(plan.candidates) - max_rows:,} more in the plan"] if len(plan.candidates) > max_rows else []),
        "",
        "## Problems",
        "",
        f"- objects without a manifest: {report.unmanifested:,} ({binary_bytes(report.unmanifested_bytes)})",
        *[f"  - `{k}`" for k in report.unmanifested_keys[:max_rows]],
        f"- manifests whose object is gone: {len(report.orphan_manifests):,}",
        *[f"  - `{k}`" for k in report.orphan_manifests[:max_rows]],
        f"- objects that differ from their manifest: {len(report.hash_problems):,}",
        *[f"  - `{k}`: {v}" for k, v in list(report.hash_problems.items())[:max_rows]],
        f"- unreadable manifests: {len(report.unreadable_manifests):,}",
        *[f"  - `{k}`: {v}" for k, v in list(report.unreadable_manifests.items())[:max_rows]],
        f"- artifacts made from an input that has changed since: {len(report.stale_inputs):,}",
        *[f"  - `{a}` <- `{i}`" for a, i in report.stale_inputs[:max_rows]],
        f"- incomplete multipart uploads: {len(report.incomplete_uploads):,}",
        *[f"  - `{u['key']}` (started {u['initiated']})" for u in report.incomplete_uploads[:max_rows]],
    ]
    if plan.protected:
        lines += ["", "## Nominated but kept (referenced by live data)", "",
                  *[f"- `{p.key}`: {p.kept_because} (was: {p.nominated_because})" for p in plan.protected[:max_rows]]]
    lines += ["", "## Lineage (artifact groups and what they were made from, newest first)", "",
              lineage_markdown(report, max_edges=max_rows)]
    return "\n".join(lines) + "\n"


def lineage_markdown(report: AuditReport, *, max_edges: int) -> str:
    """The report's lineage as a table of edges, the newest `max_edges`."""
    shown = report.lineage[:max_edges]
    more = len(report.lineage) - len(shown)
    return edges_markdown(shown) + (f"\n\n{more:,} more edges in report.json." if more else "")


def _prefect_results_line(report: AuditReport, plan: CleanupPlan) -> str:
    row = next((r for r in report.by_kind if r["kind"] == PREFECT_RESULTS_KIND), None)
    days = plan.retention.prefect_results_days
    found = f"{row['objects']:,} objects, {binary_bytes(row['bytes'])}" if row else "none here"
    rule = ("kept forever (set the retention's prefect_results_days to clean up old ones)" if days is None else
            f"those older than {days:g} days are cleanup candidates (rule old-prefect-result)")
    return (f"Prefect's persisted results (`prefect-results/`, its task cache; no manifests by design, never counted "
            f"as unmanifested): {found}; {rule}.")


def bytes_by_kind_png(report: AuditReport) -> bytes:
    """A horizontal bar chart: bytes per kind, live and dead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dead = {r["rule"]: r["bytes"] for r in report.dead_by_rule}
    kinds = [r["kind"] for r in report.by_kind][::-1]
    sizes = [r["bytes"] / 2**30 for r in report.by_kind][::-1]
    figure, axis = plt.subplots(figsize=(7, 0.45 * max(len(kinds), 2) + 1.4))
    axis.barh(kinds, sizes, color="#4c72b0")
    axis.set_xlabel("GiB")
    axis.set_title(f"{report.store_uri}: bytes per kind (dead: {binary_bytes(sum(dead.values()))})")
    for y, size in enumerate(sizes):
        axis.text(size, y, f" {size:,.2f}", va="center", fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
