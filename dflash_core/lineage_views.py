"""Views of the lineage graph: the CLI's tree (`describe`), the UI's lineage pages by node (`node_of`:
the files of one dataset run, checkpoint step, export format or model dir are one node; a report is its
own; `view_lineage` walks up from one node, reading only the manifests it needs), edge tables, and
the Prefect UI's addresses of runs and artifacts."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import UNKNOWN_KIND, InputRef, LineageGraph, Manifest, read_manifest
from dflash_core.storage import ObjectNotFound, ObjectStore


# ---- lineage queries: what made X, what X fed ------------------------------------------------


class LineageNode(BaseModel):
    """One artifact in a walk up (inputs) or down (what it fed) the graph."""

    uri: str
    kind: str | None = None
    recorded_sha256: str | None = Field(None, description="The hash the referencing manifest recorded (inputs).")
    sha256: str | None = Field(None, description="The hash its own manifest has now.")
    status: str = Field("ok", description="ok | changed since recorded | no manifest | cycle | depth limit")
    children: list[LineageNode] = Field(default_factory=list)


def flow_run_url(ui_base: str | None, flow_run_id: str | None) -> str | None:
    """The Prefect UI page of a flow run (`ui_base`: the UI's address, or the API URL with its `/api`)."""
    return _ui_page(ui_base, "runs/flow-run", flow_run_id)


def task_run_url(ui_base: str | None, task_run_id: str | None) -> str | None:
    """The Prefect UI page of a task run."""
    return _ui_page(ui_base, "runs/task-run", task_run_id)


def artifact_url(ui_base: str | None, artifact_id: str | None) -> str | None:
    """The Prefect UI page of one artifact (one version of its key)."""
    return _ui_page(ui_base, "artifacts/artifact", artifact_id)


def _ui_page(ui_base: str | None, route: str, object_id: str | None) -> str | None:
    if not ui_base or not object_id:
        return None
    return f"{ui_base.rstrip('/').removesuffix('/api')}/{route}/{object_id}"


def _walk_tree(graph: LineageGraph, uri: str, *, up: bool, depth: int, path: frozenset[str],
               recorded: str | None = None) -> LineageNode:
    manifest = graph.manifests.get(uri)
    node = LineageNode(uri=uri, kind=str(manifest.kind) if manifest else None, recorded_sha256=recorded,
                       sha256=manifest.sha256 if manifest else None)
    if manifest is None:
        node.status = "no manifest"
    elif recorded is not None and recorded != manifest.sha256:
        node.status = "changed since recorded"
    if uri in path:
        node.status = "cycle"
        return node
    if depth == 0:
        if (up and manifest and manifest.inputs) or (not up and graph._children.get(uri)):
            node.status = "depth limit"
        return node
    if up and manifest is not None:
        node.children = [_walk_tree(graph, ref.uri, up=True, depth=depth - 1, path=path | {uri}, recorded=ref.sha256)
                         for ref in manifest.inputs]
    elif not up:
        node.children = [_walk_tree(graph, child, up=False, depth=depth - 1, path=path | {uri})
                         for child in sorted(graph._children.get(uri, ()))]
    return node


def describe(graph: LineageGraph, uri: str, *, ui_base: str | None = None, depth: int = 10) -> dict[str, Any]:
    """What made `uri` (producer, code version, config, inputs with hashes, walked up) and what it fed
    (walked down), as plain JSON-able data."""
    manifest = graph.manifests.get(uri)
    if manifest is None and uri not in graph._children:
        raise KeyError(f"{uri} has no manifest and no manifest names it as an input")
    made_by = _walk_tree(graph, uri, up=True, depth=depth, path=frozenset())
    fed = _walk_tree(graph, uri, up=False, depth=depth, path=frozenset())
    producer = manifest.producer if manifest else None
    return {
        "uri": uri,
        "manifest": json.loads(manifest.model_dump_json()) if manifest else None,
        "flow_run_url": flow_run_url(ui_base, producer.flow_run_id if producer else None),
        "inputs": [json.loads(c.model_dump_json()) for c in made_by.children],
        "fed": [json.loads(c.model_dump_json()) for c in fed.children],
    }


def mermaid(graph: LineageGraph, *, prefix_uri: str = "", max_nodes: int = 80) -> str:
    """A mermaid flowchart (markdown) of the artifacts under `prefix_uri` and their direct inputs, newest
    first when there are more than `max_nodes`."""
    chosen = sorted((m for u, m in graph.manifests.items() if u.startswith(prefix_uri)),
                    key=lambda m: m.created_at, reverse=True)[:max_nodes]
    uris: list[str] = []
    for m in chosen:
        for uri in [m.uri, *(ref.uri for ref in m.inputs)]:
            if uri not in uris and len(uris) < max_nodes:
                uris.append(uri)
    ids = {uri: f"n{i}" for i, uri in enumerate(uris)}
    lines = ["```mermaid", "flowchart LR"]
    for uri, node_id in ids.items():
        manifest = graph.manifests.get(uri)
        label = "/".join(uri.split("/")[-3:]).replace('"', "'")
        kind = str(manifest.kind) if manifest else "no manifest"
        lines.append(f'  {node_id}["{label}<br/><i>{kind}</i>"]')
    for m in chosen:
        for ref in m.inputs:
            if ref.uri in ids and m.uri in ids:
                lines.append(f"  {ids[ref.uri]} --> {ids[m.uri]}")
    lines.append("```")
    total = sum(1 for u in graph.manifests if u.startswith(prefix_uri))
    note = f"\n{len(chosen)} of {total} artifacts shown (newest first).\n" if total > len(chosen) else ""
    return "\n".join(lines) + "\n" + note


# ---- lineage by node: what the UI shows ------------------------------------------------------

FILE_NODE_KINDS = frozenset({ArtifactKind.REPORT, ArtifactKind.SCRATCH})


def node_of(uri: str, kind: str | None) -> str:
    """The node `uri` belongs to in a lineage picture: the folder (ending in /) of a data shard, a checkpoint's or
    an export's file, a model's file; a report, or an input that is no file (a target built in code), is its own."""
    if kind in FILE_NODE_KINDS or "/" not in uri.split("://", 1)[-1]:
        return uri
    return uri.rsplit("/", 1)[0] + "/"


class NodeEdge(BaseModel):
    """`parent` went into `child` (each a node, `node_of`)."""

    parent: str
    parent_kind: str
    child: str
    child_kind: str


def bucket_kind_of(bucket_uri: str, prefixes: dict[ArtifactKind, str]) -> Callable[[str], str | None]:
    """The kind a URI's key says by the bucket's layout: the longest kind prefix it is under (None outside the
    bucket `s3://bucket/` or every kind prefix)."""
    under = sorted(((prefix.strip("/") + "/", str(kind)) for kind, prefix in prefixes.items()),
                   key=lambda item: len(item[0]), reverse=True)

    def kind_of(uri: str) -> str | None:
        key = uri.removeprefix(bucket_uri)
        if key == uri:
            return None
        return next((kind for prefix, kind in under if key.startswith(prefix)), None)

    return kind_of


@dataclass
class LineageView:
    """One node (the files of one dataset run, checkpoint step, export, or a report) and what made it."""

    node: str
    kind: str
    files: list[Manifest]  # the node's files that were read
    num_files: int  # all its files (more than `files` when the caller read only some)
    inputs: list[InputRef]  # every direct input of those files and of the stage that made them, each once
    manifests: dict[str, Manifest] = field(default_factory=dict)  # manifests read on the way up, by URI
    kinds: dict[str, str] = field(default_factory=dict)  # node -> kind
    edges: list[NodeEdge] = field(default_factory=list)  # nearest first
    complete: bool = True  # False when a limit (depth, reads per node) cut the walk short

    input_nodes: dict[str, str] = field(default_factory=dict)  # direct input URI -> its node

    def parents(self) -> list[str]:
        """The nodes with an edge into this one, in input order."""
        return [e.parent for e in self.edges if e.child == self.node]


def view_lineage(store: ObjectStore, node: str, files: list[Manifest], *, kind: str, num_files: int | None = None,
                 extra_inputs: Iterable[InputRef] = (), kind_of: Callable[[str], str | None] = lambda uri: None,
                 depth: int = 8, reads_per_node: int = 8) -> LineageView:
    """Walk up from `node` (its `files`' manifests, plus `extra_inputs` the stage recorded): each parent node, its
    kind, its manifests (at most `reads_per_node` of the files a child used), up to `depth` levels."""

    def ref_node(ref: InputRef) -> tuple[str, str]:
        guess = ref.role or kind_of(ref.uri)
        return node_of(ref.uri, guess), guess or UNKNOWN_KIND

    inputs = _unique([ref for m in files for ref in m.inputs] + list(extra_inputs))
    inputs = [ref for ref in inputs if ref_node(ref)[0] != node]  # a stage may name its own outputs
    view = LineageView(node=node, kind=kind, files=list(files), num_files=num_files or len(files), inputs=inputs,
                       kinds={node: kind}, input_nodes={ref.uri: ref_node(ref)[0] for ref in inputs})
    level: dict[str, list[InputRef]] = {node: inputs}
    seen = {node}
    edges: dict[tuple[str, str], NodeEdge] = {}
    for _ in range(depth):
        upper: dict[str, list[InputRef]] = {}
        for child, refs in level.items():
            by_parent: dict[str, list[InputRef]] = {}
            for ref in refs:
                parent, guess = ref_node(ref)
                by_parent.setdefault(parent, []).append(ref)
                view.kinds.setdefault(parent, guess)
            for parent, parent_refs in by_parent.items():
                if parent not in seen:
                    seen.add(parent)
                    read = [m for m in (_manifest_at(store, ref.uri) for ref in parent_refs[:reads_per_node]) if m]
                    view.complete &= len(parent_refs) <= reads_per_node
                    view.manifests.update((m.uri, m) for m in read)
                    if read:
                        view.kinds[parent] = str(read[0].kind)
                    upper[parent] = _unique([ref for m in read for ref in m.inputs])
                edges.setdefault((parent, child), NodeEdge(parent=parent, parent_kind="", child=child, child_kind=""))
        level = {parent: refs for parent, refs in upper.items() if refs}
        if not level:
            break
    else:
        view.complete &= not level
    view.edges = [e.model_copy(update={"parent_kind": view.kinds.get(e.parent, "?"),
                                       "child_kind": view.kinds.get(e.child, "?")}) for e in edges.values()]
    return view


def node_edges(graph: LineageGraph, *, kind_of: Callable[[str], str | None] = lambda uri: None,
               prefix_uri: str = "", max_edges: int = 80) -> list[NodeEdge]:
    """The edges between nodes of the artifacts under `prefix_uri` and their direct inputs, newest first."""

    def kind(uri: str, role: str | None = None) -> str:
        known = graph.manifests.get(uri)
        return str(known.kind) if known else (role or kind_of(uri) or UNKNOWN_KIND)

    edges: dict[tuple[str, str], NodeEdge] = {}
    for manifest in sorted((m for u, m in graph.manifests.items() if u.startswith(prefix_uri)),
                           key=lambda m: m.created_at, reverse=True):
        child = node_of(manifest.uri, manifest.kind)
        for ref in manifest.inputs:
            parent_kind = kind(ref.uri, ref.role)
            parent = node_of(ref.uri, parent_kind)
            if parent != child and (parent, child) not in edges:
                if len(edges) == max_edges:
                    return list(edges.values())
                edges[(parent, child)] = NodeEdge(parent=parent, parent_kind=parent_kind, child=child,
                                                  child_kind=str(manifest.kind))
    return list(edges.values())


def edges_markdown(edges: list[NodeEdge], *, links: dict[str, str | None] | None = None) -> str:
    """A graph as a markdown table of edges (what the Prefect UI renders: it prints Mermaid as code); `links`:
    node -> a page to link its cell to."""
    if not edges:
        return "_No edges._"
    links = links or {}

    def cell(node: str, kind: str) -> str:
        page = links.get(node)
        return f"{kind} [{node_label(node)}]({page})" if page else f"{kind} `{node_label(node)}`"

    return "\n".join(["| from | | to |", "|---|---|---|",
                      *(f"| {cell(e.parent, e.parent_kind)} | → | {cell(e.child, e.child_kind)} |" for e in edges)])


def node_label(node: str) -> str:
    """A node as a page shows it: its key inside the bucket (a local path or a spec as it is)."""
    return node.split("/", 3)[-1] if node.startswith("s3://") else node.removeprefix("file://")


def _manifest_at(store: ObjectStore, uri: str) -> Manifest | None:
    """The manifest of an object of this bucket (None outside it, or when it has none or an unreadable one)."""
    if not uri.startswith(store.uri("")):
        return None
    try:
        return read_manifest(store, store.key_of(uri))
    except (ObjectNotFound, ValueError):
        return None


def _unique(refs: Iterable[InputRef]) -> list[InputRef]:
    found: dict[str, InputRef] = {}
    for ref in refs:
        found.setdefault(ref.uri, ref)
    return list(found.values())
