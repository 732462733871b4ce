"""S3 audit: inventory by kind and prefix, dead-artifact detection under the lineage safety rule, a
cleanup that is a dry run unless confirmed, and one run's usage of the bucket. No Prefect import."""

from dflash_core.s3audit.cleanup import (
    CleanupNotConfirmed, CleanupPlan, CleanupResult, execute_cleanup, plan_cleanup, write_deletion_record,
)
from dflash_core.s3audit.dead import Candidate, Protected, Retention, find_dead
from dflash_core.s3audit.inventory import Inventory, take_inventory
from dflash_core.s3audit.report import (
    AuditReport, audit, audit_markdown, bytes_by_kind_png, kind_table_rows, lineage_markdown,
)
from dflash_core.s3audit.usage import RunUsage, run_usage, usage_markdown, usage_png

__all__ = [
    "AuditReport", "Candidate", "CleanupNotConfirmed", "CleanupPlan", "CleanupResult", "Inventory", "Protected",
    "Retention", "audit", "audit_markdown", "bytes_by_kind_png", "execute_cleanup", "find_dead", "kind_table_rows",
    "lineage_markdown", "plan_cleanup", "RunUsage", "run_usage", "take_inventory", "usage_markdown", "usage_png",
    "write_deletion_record",
]
