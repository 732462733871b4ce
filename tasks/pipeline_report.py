"""What a pipeline run ends with on its own page in the UI: its S3 usage (what it wrote, the bucket by kind
and prefix, unmanifested and dead objects, what a cleanup would reclaim; also stored as usage.json) and
its summary (stages, tau and speedup, artifacts, each artifact group linked to its lineage page)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_markdown_artifact

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import Manifest, write_artifact
from dflash_core.lineage_views import artifact_url, node_of
from dflash_core.run_summary import StageRun, read_stage_runs, summary_markdown
from dflash_core.s3audit import Retention, audit, run_usage, usage_markdown, usage_png
from dflash_core.settings import Settings
from dflash_core.stage_results import PipelineResult
from dflash_core.storage import ObjectStore
from tasks.artifacts import lineage_key
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage
from tasks.store import png_artifact

USAGE_KEY, USAGE_CHART_KEY, SUMMARY_KEY = "s3-usage", "s3-usage-by-kind", "pipeline-summary"


# Never cached: a Retry of the pipeline asks again with the same inputs, and the stages have moved on since.
@task(retries=2, retry_delay_seconds=[2, 5], cache_policy=NO_CACHE)
def stage_runs(settings: Settings, *, flow_run_id: str) -> list[StageRun]:
    """The pipeline's flow run and every flow run it started, in start order."""
    return read_stage_runs(settings.prefect_api_url, flow_run_id)


@task(retries=3, retry_delay_seconds=[5, 15, 30], retry_condition_fn=retry_store_outage)
def publish_usage(settings: Settings, *, run_ids: list[str], retention: Retention, key: str,
                  by_node: list[dict] | None = None) -> Manifest:
    """Audit the bucket (no hash checks), then the usage of the runs `run_ids` (and, for a generation across
    nodes, what each node generated) as usage.json at `key` and as a markdown and a chart artifact."""
    store = ObjectStore.from_settings(settings)
    inventory, report, plan = audit(store, settings.s3_prefixes, retention=retention, verify_hashes=False)
    usage = run_usage(inventory, report, plan, run_ids=run_ids, by_node=by_node)
    manifest = write_artifact(store, key, usage.model_dump_json(indent=2).encode(), kind=ArtifactKind.REPORT,
                              config={"retention": retention.model_dump()}, producer=run_producer())
    create_markdown_artifact(usage_markdown(usage) + f"\nStored as `{manifest.uri}`.\n", key=USAGE_KEY,
                             description="S3 usage: what this run wrote, the bucket by kind and prefix, dead data")
    png_artifact(usage_png(usage), key=USAGE_CHART_KEY, description="bytes per kind: the bucket, and this run's")
    return manifest


@task(retries=2, retry_delay_seconds=[2, 5])
def publish_run_summary(settings: Settings, result: PipelineResult, *, stages: list[StageRun],
                        failure: str | None = None) -> str:
    """The run summary as a markdown artifact, each artifact group linked to the lineage page its stage
    published, `failure` saying what ended a failed run; the artifact's id."""
    summary = summary_markdown(result.model_dump(mode="json"), stages, lineage=_lineage_pages(settings, result, stages),
                               failure=failure)
    return str(create_markdown_artifact(summary, key=SUMMARY_KEY, description="stages, tau, speedup, artifacts"))


def _lineage_pages(settings: Settings, result: PipelineResult, stages: list[StageRun]) -> dict[str, str]:
    """node -> the lineage page a stage of this run published for it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    nodes = {node_of(r["uri"], r.get("kind")) for r in result.artifacts}
    keys = {lineage_key(node): node for node in nodes}
    if not keys or not stages:
        return {}
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys)),
                                           flow_run_id=ArtifactFilterFlowRunId(any_=[s.id for s in stages])),
            sort=ArtifactSort.CREATED_DESC, limit=200)
    pages: dict[str, str] = {}
    for artifact in found:
        pages.setdefault(keys[artifact.key], artifact_url(settings.prefect_api_url, str(artifact.id)))
    return pages
