"""S3 flows: the weekly audit (inventory, dead data, lineage as a table of edges, as Prefect artifacts and S3
reports) and the cleanup (a dry run unless `confirm`; run the plan an audit published with `plan_uri` to
delete exactly what was reviewed, re-checked first).

Run: `python -m flows.s3 audit --params '{"prefix": ""}'`
     `python -m flows.s3 cleanup --params '{"plan_uri": "s3://dflash/reports/s3-audit/.../plan.json", "confirm": true}'`
"""

from __future__ import annotations

import getpass
import platform
from datetime import UTC, datetime

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from pydantic import Field

from dflash_core.s3audit import Retention, bytes_by_kind_png, kind_table_rows, lineage_markdown
from dflash_core.settings import load_settings
from dflash_core.strict import StrictModel
from dflash_core.units import binary_bytes
from flows.command_line import run_chosen_from_command_line
from tasks.s3 import audit_bucket, cleanup_bucket, load_plan, publish_audit, record_deletions
from tasks.store import check_store, png_artifact


class S3AuditParams(StrictModel):
    prefix: str = Field("", description="Report on and nominate only keys under this prefix ('' = whole bucket).")
    retention: Retention = Field(default_factory=Retention, description="The cleanup rules the dry run applies. "
                                 "Prefect's results (prefect-results/) are kept unless prefect_results_days is set.")
    verify_hashes: bool = Field(True, description="HEAD every manifested object to compare its sha256.")
    max_graph_nodes: int = Field(80, ge=1, description="Edges of the lineage table (newest first).")


class S3CleanupParams(StrictModel):
    plan_uri: str | None = Field(None, description="plan.json of an s3-audit run to execute (reviewed); None: plan now.")
    prefix: str = Field("", description="Without plan_uri: nominate only under this prefix.")
    retention: Retention = Field(default_factory=Retention, description="Without plan_uri: the rules.")
    confirm: bool = Field(False, description="Delete. False: a dry run that only reports what would go.")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


@flow(name="dflash-s3-audit", log_prints=True)
def s3_audit(params: S3AuditParams = S3AuditParams()) -> dict:
    settings = load_settings()
    check_store(settings)
    output = audit_bucket(settings, prefix=params.prefix, retention=params.retention,
                          verify_hashes=params.verify_hashes, max_graph_nodes=params.max_graph_nodes)
    published = publish_audit(settings, output, stamp=_stamp())
    report = output.report
    create_table_artifact(kind_table_rows(report), key="s3-audit-by-kind",
                          description=f"{report.store_uri}: objects and bytes per artifact kind")
    create_markdown_artifact(output.markdown + f"\n\nPlan for `dflash-s3-cleanup` (plan_uri): `{published.plan_uri}`\n",
                             key="s3-audit-summary", description="inventory, dead data, problems")
    # Embedded, not a presigned link: no key material in the Prefect database.
    png_artifact(bytes_by_kind_png(report), key="s3-audit-bytes-by-kind", description="bytes per artifact kind")
    create_markdown_artifact(f"# Lineage of `{report.store_uri}`\n\n"
                             + lineage_markdown(report, max_edges=params.max_graph_nodes), key="s3-audit-lineage",
                             description="artifact groups and what they were made from (edges, from manifests)")
    print(f"{report.objects:,} objects, {binary_bytes(report.bytes)}; dead {report.dead_objects:,} "
          f"({binary_bytes(report.dead_bytes)}); unmanifested {report.unmanifested:,}; plan {published.plan_uri}")
    return {"report": published.report_uri, "plan": published.plan_uri, "objects": report.objects,
            "bytes": report.bytes, "dead_objects": report.dead_objects, "dead_bytes": report.dead_bytes,
            "unmanifested": report.unmanifested, "orphan_manifests": len(report.orphan_manifests),
            "hash_problems": len(report.hash_problems), "artifacts": published.records}


@flow(name="dflash-s3-cleanup", log_prints=True)
def s3_cleanup(params: S3CleanupParams = S3CleanupParams()) -> dict:
    settings = load_settings()
    check_store(settings)
    if params.plan_uri:
        plan = load_plan(settings, params.plan_uri)
    else:
        plan = audit_bucket(settings, prefix=params.prefix, retention=params.retention, verify_hashes=False,
                            max_graph_nodes=1).plan
    if not params.confirm:
        create_table_artifact([{"key": c.key, "bytes": c.bytes, "rule": c.rule, "why": c.reason}
                               for c in plan.candidates[:1000]], key="s3-cleanup-dry-run",
                              description=f"would delete {len(plan.candidates):,} objects, "
                                          f"{binary_bytes(plan.total_bytes)}")
        print(f"dry run: {len(plan.candidates):,} objects ({binary_bytes(plan.total_bytes)}) would be deleted; "
              "nothing was; rerun with confirm=true to delete")
        return {"dry_run": True, "candidates": len(plan.candidates), "bytes": plan.total_bytes}
    who = f"{getpass.getuser()}@{platform.node()} via flow run {flow_run.id} ({flow_run.name})"
    result = cleanup_bucket(settings, plan, confirm=True, who=who)
    record = record_deletions(settings, result, plan_uri=params.plan_uri)
    lines = [f"# S3 cleanup of `{plan.store_uri}`", "",
             f"Deleted **{len(result.deleted):,}** objects ({binary_bytes(result.bytes_reclaimed)}), skipped "
             f"{len(result.skipped):,}, **failed {len(result.failed):,}**. Record: `{record.uri}`.", ""]
    lines += [f"- failed `{o.key}`: {o.detail}" for o in result.failed]
    lines += [f"- skipped `{o.key}`: {o.detail}" for o in result.skipped[:200]]
    create_markdown_artifact("\n".join(lines) + "\n", key="s3-cleanup-record", description="what was deleted")
    create_table_artifact([{"key": o.key, "bytes": o.bytes, "why": o.reason} for o in result.deleted[:1000]],
                          key="s3-cleanup-deleted")
    if result.failed:
        raise RuntimeError(f"{len(result.failed)} of {len(result.failed) + len(result.deleted)} deletes failed "
                           f"(first: {result.failed[0].key}: {result.failed[0].detail}); {len(result.deleted)} "
                           f"succeeded; the record {record.uri} lists both")
    return {"dry_run": False, "deleted": len(result.deleted), "bytes_reclaimed": result.bytes_reclaimed,
            "skipped": len(result.skipped), "failed": 0, "record": record.uri}


if __name__ == "__main__":
    run_chosen_from_command_line({"audit": (s3_audit, S3AuditParams), "cleanup": (s3_cleanup, S3CleanupParams)})
