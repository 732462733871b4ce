"""Prefect tasks over dflash_core.s3audit: audit the bucket, publish the report, clean up, record deletions.

The cleanup task never retries on its own: a rerun re-plans and re-checks from scratch, and that is
a decision for a person (or a new flow run), not a retry loop.
"""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import InputRef, LineageGraph, Manifest, write_artifact
from dflash_core.lineage_views import mermaid
from dflash_core.s3audit import (
    AuditReport, CleanupPlan, CleanupResult, Retention, audit, audit_markdown, bytes_by_kind_png, execute_cleanup,
    write_deletion_record,
)
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.artifacts import artifact_record
from tasks.retry import retry_unreachable
from tasks.provenance import run_producer

_RETRY = {"retries": 3, "retry_delay_seconds": [5, 15, 30], "retry_condition_fn": retry_unreachable}


class AuditOutput(BaseModel):
    report: AuditReport
    plan: CleanupPlan
    markdown: str
    mermaid: str


class PublishedAudit(BaseModel):
    report_uri: str
    plan_uri: str
    markdown_uri: str
    png_key: str
    records: list[dict[str, str]] = []  # of the four files (tasks.artifacts.artifact_record)


@task(**_RETRY)
def audit_bucket(settings: Settings, *, prefix: str, retention: Retention, verify_hashes: bool,
                 max_graph_nodes: int) -> AuditOutput:
    """Inventory the whole bucket, report on `prefix`, plan a cleanup (dry run), draw the lineage graph."""
    store = ObjectStore.from_settings(settings)
    inventory, report, plan = audit(store, settings.s3_prefixes, prefix=prefix, retention=retention,
                                    verify_hashes=verify_hashes)
    graph = LineageGraph(inventory.manifests.values())
    return AuditOutput(report=report, plan=plan, markdown=audit_markdown(report, plan),
                       mermaid=mermaid(graph, prefix_uri=store.uri(prefix), max_nodes=max_graph_nodes))


@task(**_RETRY)
def publish_audit(settings: Settings, output: AuditOutput, *, stamp: str) -> PublishedAudit:
    """reports/s3-audit/<stamp>/: report.json, plan.json (a cleanup can run exactly this plan), summary.md,
    bytes-by-kind.png, each with its manifest."""
    store = ObjectStore.from_settings(settings)
    base = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "s3-audit", stamp)
    producer = run_producer()
    config = {"retention": output.plan.retention.model_dump(), "prefix": output.plan.prefix}
    written: dict[str, Manifest] = {}
    for name, payload in (("report.json", output.report.model_dump_json(indent=2).encode()),
                          ("plan.json", output.plan.model_dump_json(indent=2).encode()),
                          ("summary.md", (output.markdown + "\n## Lineage\n\n" + output.mermaid).encode()),
                          ("bytes-by-kind.png", bytes_by_kind_png(output.report))):
        written[name] = write_artifact(store, f"{base}/{name}", payload, kind=ArtifactKind.REPORT, config=config,
                                       producer=producer)
    return PublishedAudit(report_uri=written["report.json"].uri, plan_uri=written["plan.json"].uri,
                          markdown_uri=written["summary.md"].uri, png_key=written["bytes-by-kind.png"].key,
                          records=[artifact_record(m) for m in written.values()])


@task(**_RETRY)
def load_plan(settings: Settings, plan_uri: str) -> CleanupPlan:
    """A plan an earlier s3-audit run published (its plan.json)."""
    store = ObjectStore.from_settings(settings)
    if not plan_uri.startswith(store.uri("")):
        raise ValueError(f"plan_uri {plan_uri} is not in the configured bucket {store.uri('')}")
    return CleanupPlan.model_validate_json(store.get_bytes(plan_uri.removeprefix(store.uri(""))))


@task
def cleanup_bucket(settings: Settings, plan: CleanupPlan, *, confirm: bool, who: str) -> CleanupResult:
    """Re-check `plan` against the bucket now and delete what is still dead (needs confirm=True)."""
    return execute_cleanup(ObjectStore.from_settings(settings), settings.s3_prefixes, plan, confirm=confirm, who=who)


@task(**_RETRY)
def record_deletions(settings: Settings, result: CleanupResult, *, plan_uri: str | None) -> Manifest:
    """The deletion record (what, bytes, why, who, when, failures) as a report artifact."""
    store = ObjectStore.from_settings(settings)
    # The reviewed plan is the record's input, so lineage ties what was deleted to what was approved.
    return write_deletion_record(store, settings.s3_prefixes, result, producer=run_producer(),
                                 inputs=[InputRef(uri=plan_uri)] if plan_uri else ())
