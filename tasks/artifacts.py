"""What a flow made, for the UI and for the next flow: the record of a stored artifact (URI, kind,
sha256, manifest URI) that every flow returns as its result, Prefect artifact keys scoped to a
dataset/run (so one run's table never replaces another's), manifests shown as markdown, and the
lineage page of every node a stage made (a dataset run, a checkpoint step, an export, an evaluation
report): who made it (flow run and task run, linked), its inputs with hashes (the target model and
tokenizer included), its parents and the graph up to its sources as a table of edges, and what was
later made from it (each later stage adds its row to its parents' pages).

Links point at the Prefect UI (`/runs/flow-run/<id>`, `/runs/task-run/<id>`, `/artifacts/artifact/<id>`);
no presigned S3 link is ever written here (it is a bearer token).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from dflash_core.layout import ArtifactKind, is_manifest_key, manifest_key
from dflash_core.lineage import InputRef, Manifest, read_manifest, write_artifact
from dflash_core.lineage_refs import DigestCache, target_refs, tokenizer_refs
from dflash_core.lineage_views import (
    LineageView, artifact_url, bucket_kind_of, edges_markdown, flow_run_url, node_label, node_of, task_run_url, view_lineage,
)
from dflash_core.provenance import Producer
from dflash_core.settings import Settings
from dflash_core.stage_results import EvaluationReport, StageResult
from dflash_core.storage import ObjectStore
from dflash_core.units import binary_bytes
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage

_NOT_KEY = re.compile(r"[^a-z0-9-]+")
LINEAGE_KEY_PREFIX = "lineage"
MAX_FILES_SHOWN = 40  # files of one node read and listed on its page (a dataset of 1,000 shards lists these)
MAX_INPUTS_SHOWN = 60
NOTHING_FED = "_Nothing yet: each stage that uses it adds a row here._"
FED_HEADER = "| made from it | kind | made by | lineage |\n|---|---|---|---|"


def artifact_record(manifest: Manifest) -> dict[str, str]:
    """The record of one stored artifact: a downstream deployment can take a list of these as a parameter."""
    return stored_record(manifest.uri, kind=manifest.kind, sha256=manifest.sha256)


def stored_record(uri: str, *, kind: ArtifactKind | str, sha256: str) -> dict[str, str]:
    """The same record from what a task returned (its manifest sits beside the object)."""
    return {"uri": uri, "kind": str(getattr(kind, "value", kind)), "sha256": sha256, "manifest": manifest_key(uri)}


def ui_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from parts such as (name, dataset, run)."""
    return _NOT_KEY.sub("-", "-".join(parts).lower()).strip("-")[:200]


def lineage_key(node: str) -> str:
    """The key of a node's lineage page: its last path segments, readable, and a hash of the whole node (unique)."""
    readable = ui_key(*node.split("://", 1)[-1].rstrip("/").split("/")[1:][-4:])[:120]
    return ui_key(LINEAGE_KEY_PREFIX, readable, hashlib.sha256(node.encode()).hexdigest()[:10])


# ---- inputs that live outside the bucket ------------------------------------------------------


def _digests(settings: Settings) -> DigestCache:
    return DigestCache(settings.work_path("cache", "sha256.json"))


def target_inputs(settings: Settings, target: str, *, seed: int) -> list[InputRef]:
    """The target model (config, weights, tokenizer files by sha256) as inputs of what a stage makes with it."""
    return target_refs(target, seed=seed, models_dir=settings.work_path("models"), digests=_digests(settings))


def tokenizer_inputs(settings: Settings, directory: Path) -> list[InputRef]:
    """The tokenizer files of `directory` as inputs."""
    return tokenizer_refs(directory, digests=_digests(settings))


# ---- manifests as markdown ----------------------------------------------------------------------


def producer_markdown(producer: Producer, *, ui: str | None) -> str:
    """Flow run and task run (linked to their pages), git SHA, host, version."""
    return (f"flow run {_run_link(ui, producer.flow_run_id, flow=True)}, task run "
            f"{_run_link(ui, producer.task_run_id, flow=False)}, git `{producer.git_sha or '?'}`, host "
            f"`{producer.host or '?'}`, dflash-pipeline {producer.package_version or '?'}")


def manifest_markdown(manifest: Manifest, *, title: str, ui: str | None = None) -> str:
    inputs = "\n".join(f"| `{i.uri}` | {i.role or ''} | `{i.sha256 or '?'}` |" for i in manifest.inputs) \
        or "| (none) | | |"
    return (f"### {title}\n\n`{manifest.uri}` ({manifest.bytes:,} bytes)\n\nsha256 `{manifest.sha256}`; "
            f"manifest `{manifest_key(manifest.uri)}`\n\n"
            f"Producer: {producer_markdown(manifest.producer, ui=ui)}\n\n"
            f"| input | role | sha256 |\n|---|---|---|\n{inputs}\n\n"
            f"Read it with the project's S3 credentials (`aws s3 cp {manifest.uri} .`); no presigned link is "
            f"stored here, since it is a bearer token.")


def manifest_artifact(manifest: Manifest, *, key: str, title: str) -> None:
    """The stored artifact's manifest (producer, git SHA, inputs with hashes) as a markdown artifact."""
    create_markdown_artifact(manifest_markdown(manifest, title=title), key=key, description=title)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def publish_stored(settings: Settings, *, prefix: str, key: str, title: str) -> list[dict[str, str]]:
    """One markdown artifact with the manifest of every stored object under `prefix` (a checkpoint
    step, an export), and their records."""
    store = ObjectStore.from_settings(settings)
    prefix = prefix.removeprefix(f"s3://{store.bucket}/").rstrip("/") + "/"
    manifests = [read_manifest(store, info.key) for info in sorted(store.list(prefix), key=lambda i: i.key)
                 if not is_manifest_key(info.key)]
    if not manifests:
        raise ValueError(f"nothing stored under {store.uri(prefix)}")
    create_markdown_artifact(f"## {title}\n\n" + "\n\n".join(
        manifest_markdown(m, title=m.key.rsplit("/", 1)[-1], ui=settings.prefect_api_url) for m in manifests),
        key=key, description=title)
    return [artifact_record(m) for m in manifests]


class NewArtifact(BaseModel):
    """One object for `store_artifacts` to write with its manifest."""

    key: str
    data: bytes
    kind: ArtifactKind
    inputs: list[InputRef] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def store_artifacts(settings: Settings, artifacts: list[NewArtifact]) -> list[Manifest]:
    """Write what a flow made itself (reports, a dataset's verdict), each with its manifest: in a task, so the
    manifests name a task run as their producer."""
    store = ObjectStore.from_settings(settings)
    producer = run_producer()
    return [write_artifact(store, a.key, a.data, kind=a.kind, inputs=a.inputs, config=a.config, producer=producer)
            for a in artifacts]


# ---- lineage pages ------------------------------------------------------------------------------


def made_nodes(result: StageResult) -> dict[str, list[dict[str, Any]]]:
    """The nodes a stage made (its dataset run, checkpoint step, exports, evaluation report), each with the
    records of its files."""
    if isinstance(result, EvaluationReport):
        records = [r for r in result.artifacts if r["uri"] == result.report]
    else:  # a completions, tokenized, checkpoint or export result made files of its own kind
        records = [r for r in result.artifacts if r.get("kind") == getattr(result, "kind", None)]
    nodes: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        nodes.setdefault(node_of(record["uri"], record["kind"]), []).append(record)
    return nodes


def publish_lineage(settings: Settings, store: ObjectStore, result: StageResult, *,
                    inputs: Iterable[InputRef] = ()) -> dict[str, str]:
    """A lineage page for each node `result` made (inputs: what the stage recorded besides its files' own
    inputs, e.g. the target model), and a row for it on each parent's page; node -> artifact id."""
    from prefect.client.orchestration import get_client

    ui = settings.prefect_api_url
    kind_of = bucket_kind_of(store.uri(""), settings.s3_prefixes)
    views = []
    for node, records in made_nodes(result).items():
        files = [read_manifest(store, store.key_of(r["uri"])) for r in records[:MAX_FILES_SHOWN]]
        kind = "evaluation report" if isinstance(result, EvaluationReport) else str(records[0]["kind"])
        views.append(view_lineage(store, node, files, kind=kind, num_files=len(records), extra_inputs=inputs,
                                  kind_of=kind_of))
    if not views:
        return {}
    published: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        pages = _latest_pages(client, {p for view in views for p in view.parents()})
        names = _run_names(client, [m.producer for view in views for m in [*view.files, *view.manifests.values()]])
        for view in views:
            links = {node: artifact_url(ui, str(page.id)) for node, page in pages.items()}
            artifact_id = create_markdown_artifact(lineage_markdown(view, ui=ui, links=links, names=names),
                                                   key=lineage_key(view.node),
                                                   description=f"lineage of {view.kind} {node_label(view.node)}")
            published[view.node] = str(artifact_id)
            row = _fed_row(view, ui=ui, url=artifact_url(ui, str(artifact_id)), names=names)
            for parent in dict.fromkeys(view.parents()):
                if parent in pages:
                    pages[parent] = _add_fed_row(client, pages[parent], row)
    return published


def lineage_markdown(view: LineageView, *, ui: str | None, links: dict[str, str | None],
                     names: dict[str, str] | None = None) -> str:
    """A node's lineage page: made by, its files, its inputs with hashes, its parents, the graph up to its
    sources as a table of edges, and a "fed" table that later stages extend. `links`: node -> its page;
    `names`: run id -> the run's name (a run not named there shows its id)."""
    names = names or {}
    producers = list({_producer_line(m.producer, ui=ui, names=names): None for m in view.files})
    size = sum(m.bytes for m in view.files)
    shown = "" if view.num_files == len(view.files) else f" ({len(view.files)} of them read and listed here)"
    lines = [f"## Lineage of {view.kind} `{node_label(view.node)}`", "",
             f"`{view.node}`: {view.num_files:,} file(s){shown}, {binary_bytes(size)}.", "",
             *(f"**Made by** {line}" for line in producers), "",
             "| file | bytes | sha256 | task run |", "|---|---:|---|---|",
             *(f"| `{m.uri.rsplit('/', 1)[-1]}` | {m.bytes:,} | `{m.sha256[:16]}…` | "
               f"{_run_link(ui, m.producer.task_run_id, flow=False, names=names)} |" for m in view.files),
             "", "### Inputs (what made it)", ""]
    if view.inputs:
        lines += ["| input | what | from | sha256 recorded |", "|---|---|---|---|"]
        for ref in view.inputs[:MAX_INPUTS_SHOWN]:
            parent = view.input_nodes[ref.uri]
            lines.append(f"| `{ref.uri.removeprefix(parent) or ref.uri}` | {ref.role or view.kinds.get(parent, '?')} | "
                         f"{_node_link(view, parent, links)} | `{ref.sha256 or 'not recorded'}` |")
        if len(view.inputs) > MAX_INPUTS_SHOWN:
            lines.append(f"| ... {len(view.inputs) - MAX_INPUTS_SHOWN:,} more (every manifest lists them all) | | | |")
    else:
        lines.append("_None recorded._")
    lines += ["", "### Parents", ""]
    parents = list(dict.fromkeys(view.parents()))
    if parents:
        lines += ["| parent | kind | made by | lineage |", "|---|---|---|---|"]
        for parent in parents:
            made_by = {_run_link(ui, m.producer.flow_run_id, flow=True, names=names) for m in view.manifests.values()
                       if node_of(m.uri, m.kind) == parent}
            page = links.get(parent)
            lines.append(f"| `{node_label(parent)}` | {view.kinds.get(parent, '?')} | "
                         f"{', '.join(sorted(made_by)) or 'no manifest: unknown'} | "
                         f"{f'[lineage of {node_label(parent)}]({page})' if page else '-'} |")
    else:
        lines.append("_None: made from nothing recorded._")
    lines += ["", "### Lineage graph (edges up to its sources, nearest first)", "",
              edges_markdown(view.edges, links=links)]
    if not view.complete:
        lines += ["", "_The walk read a sample of each parent's files (or stopped at its depth limit): "
                      "`dflash lineage show` walks it all._"]
    lines += ["", "### Fed (what was made from it)", "", NOTHING_FED]
    return "\n".join(lines) + "\n"


def _latest_pages(client, nodes: set[str]) -> dict[str, Any]:
    """node -> the newest lineage artifact of that node (nodes without one are left out)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    keys = {lineage_key(node): node for node in nodes}
    if not keys:
        return {}
    found: dict[str, Any] = {}
    for artifact in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys))),
                                          sort=ArtifactSort.CREATED_DESC, limit=200):
        found.setdefault(keys[artifact.key], artifact)
    return found


def _run_names(client, producers: list[Producer]) -> dict[str, str]:
    """run id -> name, for the flow runs and task runs among `producers` that this server knows."""
    from uuid import UUID

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterId

    def ids(values: Iterable[str | None]) -> list[UUID]:
        found = set()
        for value in filter(None, values):
            try:
                found.add(UUID(value))
            except ValueError:  # not a Prefect run id (a manifest written by hand, a test's)
                continue
        return sorted(found)

    names: dict[str, str] = {}
    if flow_ids := ids(p.flow_run_id for p in producers):
        names.update((str(run.id), run.name) for run in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_ids)), limit=len(flow_ids)))
    if task_ids := ids(p.task_run_id for p in producers):
        names.update((str(run.id), run.name) for run in client.read_task_runs(
            task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=task_ids)), limit=len(task_ids)))
    return names


def _fed_row(view: LineageView, *, ui: str | None, url: str | None, names: dict[str, str]) -> str:
    runs = ", ".join(dict.fromkeys(_run_link(ui, m.producer.flow_run_id, flow=True, names=names) for m in view.files))
    label = node_label(view.node)
    return f"| `{label}` | {view.kind} | flow run {runs} | [lineage of {label}]({url}) |"


def _add_fed_row(client, page, row: str):
    """The parent's page with `row` added to its "fed" table (the table is the page's last part)."""
    import httpx
    from prefect.client.schemas.actions import ArtifactUpdate

    data = page.data if isinstance(page.data, str) else ""
    if row in data:
        return page
    data = data.replace(NOTHING_FED, FED_HEADER).rstrip("\n") + f"\n{row}\n"
    try:
        client.update_artifact(page.id, ArtifactUpdate(data=data))
    except httpx.HTTPError as error:  # the row is a convenience: the manifests hold the edge
        get_run_logger().warning("could not add %s to the lineage page %s: %s", row, page.key, error)
        return page
    return page.model_copy(update={"data": data})


def _producer_line(producer: Producer, *, ui: str | None, names: dict[str, str]) -> str:
    return (f"flow run {_run_link(ui, producer.flow_run_id, flow=True, names=names)}, git "
            f"`{producer.git_sha or '?'}`, host `{producer.host or '?'}`, dflash-pipeline "
            f"{producer.package_version or '?'}")


def _run_link(ui: str | None, run_id: str | None, *, flow: bool, names: dict[str, str] | None = None) -> str:
    """A run's name (its id when unnamed) linked to its page."""
    if not run_id:
        return "none (written outside a Prefect run)" if flow else "none (written by the flow itself)"
    url = flow_run_url(ui, run_id) if flow else task_run_url(ui, run_id)
    label = (names or {}).get(run_id, run_id).replace("|", "/")
    return f"[{label}]({url})" if url else f"`{label}`"


def _node_link(view: LineageView, node: str, links: dict[str, str | None]) -> str:
    page = links.get(node)
    kind = view.kinds.get(node, "?")
    return f"{kind} [{node_label(node)}]({page})" if page else f"{kind} `{node_label(node)}`"
