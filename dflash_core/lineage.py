"""Artifact manifests and the lineage graph rebuilt from them.

Every artifact written through `write_artifact` gets `<key>.manifest.json` beside it: kind, URI,
sha256, bytes, producer, inputs (URIs + hashes; the target model's and tokenizer's files too, from
`target_refs` / `tokenizer_refs`), config and creation time. The manifests are the system of record:
lineage is rebuilt from them alone, so an audit needs no Prefect database.

Lineage is shown by node (`node_of`): the files of one dataset run, checkpoint step, export format or
model dir are one node; a report is its own. `view_lineage` walks up from one node, reading only the
manifests it needs. Pure functions over an `ObjectStore`; no orchestrator import.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dflash_core.layout import PREFECT_RESULTS_FOLDER, ArtifactKind, is_manifest_key, manifest_key
from dflash_core.provenance import Producer
from dflash_core.redaction import REDACTED, redact  # noqa: F401 (REDACTED re-exported)
from dflash_core.storage import ObjectInfo, ObjectNotFound, ObjectStore, sha256_bytes, sha256_file

MANIFEST_SCHEMA_VERSION = 1
TARGET_MODEL, TOKENIZER = "target-model", "tokenizer"  # InputRef roles
UNKNOWN_KIND = "unknown"  # an input neither a manifest nor the bucket's layout names a kind for


class InputRef(BaseModel):
    uri: str
    sha256: str | None = None
    role: str | None = Field(None, description=f"What the input was where its URI does not say: {TARGET_MODEL} or "
                                               f"{TOKENIZER} (a file of a local dir, or a target built in code); "
                                               f"None for data.")


class Manifest(BaseModel):
    schema_version: int = MANIFEST_SCHEMA_VERSION
    kind: ArtifactKind
    uri: str
    key: str
    sha256: str
    bytes: int
    producer: Producer = Field(default_factory=Producer)
    inputs: list[InputRef] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


def input_ref(store: ObjectStore, key: str) -> InputRef:
    """An input pointer for an object in `store`, carrying the hash it has now."""
    return InputRef(uri=store.uri(key), sha256=store.head(key).sha256)


# ---- inputs outside the bucket: the target model and its tokenizer, by file ----------------------

# The files that make a model dir what it is (its weights and config) and those that make its tokenizer.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
BUILT_IN_CODE = ("tiny:", "random:")  # targets built from a config in code and a seed: no files


class DigestCache:
    """sha256 of local files by (path, size, mtime), in one JSON file: a model's weights are hashed once per
    change, not by every stage that names them. A lost update (two writers) only costs a re-hash."""

    def __init__(self, path: Path | None):
        self.path = path

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        known = self._load()
        entry = known.get(str(file))
        if entry and entry.get("stamp") == stamp:
            return entry["sha256"]
        digest = sha256_file(file)
        if self.path is not None:
            known[str(file)] = {"stamp": stamp, "sha256": digest}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(self.path)
        return digest

    def _load(self) -> dict[str, dict[str, str]]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text())
        except ValueError:  # a torn write: start over
            return {}


def directory_refs(directory: Path, *, role: str, patterns: Iterable[str],
                   digests: DigestCache | None = None) -> list[InputRef]:
    """Each file of `directory` whose name matches one of `patterns`, as an input (file:// URI, sha256), by name."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory: a model or tokenizer dir is needed to name it as an input")
    digests = digests or DigestCache(None)
    names = sorted(path.name for path in directory.iterdir()
                   if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns))
    return [InputRef(uri=(directory / name).as_uri(), sha256=digests.sha256(directory / name), role=role)
            for name in names]


def tokenizer_refs(directory: Path, *, digests: DigestCache | None = None) -> list[InputRef]:
    """The tokenizer of `directory` (its tokenizer files and chat template) as inputs."""
    return directory_refs(directory, role=TOKENIZER, patterns=TOKENIZER_FILES, digests=digests)


def target_refs(target: str, *, seed: int, models_dir: Path, digests: DigestCache | None = None) -> list[InputRef]:
    """The target model as inputs: its config and weights, then its tokenizer files, by sha256 (a model dir, or
    `embedded`: the converted SmolLM2 under `models_dir`). A target built in code has no files: it is its spec
    and seed (`tiny:qwen3?seed=3`, hashed as that text), which with the producer's git SHA rebuild it."""
    if target.startswith(BUILT_IN_CODE):
        spec = f"{target}?seed={seed}"
        return [InputRef(uri=spec, sha256=sha256_bytes(spec.encode()), role=TARGET_MODEL)]
    if target == "embedded":
        from dflash_core.embedded import embedded_model_dir

        directory = embedded_model_dir(models_dir)
    else:
        directory = Path(target)
    return [*directory_refs(directory, role=TARGET_MODEL, patterns=MODEL_FILES, digests=digests),
            *tokenizer_refs(directory, digests=digests)]


def write_artifact(
    store: ObjectStore,
    key: str,
    source: bytes | Path,
    *,
    kind: ArtifactKind,
    inputs: Iterable[InputRef] = (),
    config: dict[str, Any] | BaseModel | None = None,
    producer: Producer | None = None,
) -> Manifest:
    """Upload `source` (bytes or a local file) to `key` and write its manifest beside it."""
    if isinstance(source, (bytes, bytearray)):
        digest = sha256_bytes(bytes(source))
        info = store.put_bytes(key, bytes(source))
    else:
        digest = sha256_file(Path(source))
        info = store.put_file(key, source, sha256=digest)
    return _write_manifest(store, info, digest, kind=kind, inputs=inputs, config=config, producer=producer)


def register_artifact(
    store: ObjectStore,
    key: str,
    *,
    kind: ArtifactKind,
    inputs: Iterable[InputRef] = (),
    config: dict[str, Any] | BaseModel | None = None,
    producer: Producer | None = None,
) -> Manifest:
    """Write a manifest for an object already in the store (its sha256 read from metadata or computed)."""
    info = store.head(key)
    digest = info.sha256 or sha256_bytes(store.get_bytes(key, verify=False))
    return _write_manifest(store, info, digest, kind=kind, inputs=inputs, config=config, producer=producer)


def _write_manifest(store: ObjectStore, info: ObjectInfo, digest: str, *, kind: ArtifactKind,
                    inputs: Iterable[InputRef], config: dict[str, Any] | BaseModel | None,
                    producer: Producer | None) -> Manifest:
    manifest = Manifest(
        kind=kind,
        uri=store.uri(info.key),
        key=info.key,
        sha256=digest,
        bytes=info.size,
        producer=producer or Producer(),
        inputs=list(inputs),
        config=redact(config) if config is not None else {},
    )
    store.put_bytes(manifest_key(info.key), manifest.model_dump_json(indent=2).encode(),
                    content_type="application/json")
    return manifest


def read_manifest(store: ObjectStore, key: str) -> Manifest:
    """The manifest of the artifact at `key` (pass the artifact's key, not the manifest's)."""
    try:
        raw = store.get_bytes(manifest_key(key))
    except ObjectNotFound as error:
        raise ObjectNotFound(f"{store.uri(manifest_key(key))} (no manifest for {store.uri(key)})") from error
    try:
        return Manifest.model_validate_json(raw)
    except ValueError as error:
        raise ValueError(f"{store.uri(manifest_key(key))} is not a valid manifest: {error}") from error


def iter_manifests(store: ObjectStore, prefix: str = "") -> Iterator[Manifest]:
    for info in store.list(prefix):
        if is_manifest_key(info.key):
            yield Manifest.model_validate_json(store.get_bytes(info.key))


def find_unmanifested(store: ObjectStore, prefix: str = "") -> list[ObjectInfo]:
    """Objects under `prefix` with no manifest beside them: unknown provenance, candidates for cleanup.
    Prefect's persisted results (`prefect-results/`) are not artifacts and never have manifests: not listed."""
    objects: dict[str, ObjectInfo] = {}
    manifests: set[str] = set()
    for info in store.list(prefix):
        if is_manifest_key(info.key):
            manifests.add(info.key)
        elif not info.key.startswith(PREFECT_RESULTS_FOLDER + "/"):
            objects[info.key] = info
    return [info for key, info in sorted(objects.items()) if manifest_key(key) not in manifests]


def verify_artifact(store: ObjectStore, manifest: Manifest) -> list[str]:
    """What is wrong between a manifest and its object now (empty when they agree)."""
    try:
        info = store.head(manifest.key)
    except ObjectNotFound:
        return [f"{manifest.uri} is gone but its manifest remains"]
    problems = []
    if info.size != manifest.bytes:
        problems.append(f"{manifest.uri} has {info.size} bytes, its manifest says {manifest.bytes}")
    if info.sha256 is not None and info.sha256 != manifest.sha256:
        problems.append(f"{manifest.uri} has sha256 {info.sha256}, its manifest says {manifest.sha256}")
    return problems


class LineageGraph:
    """Artifacts as nodes (by URI), an edge from each input to what was made from it."""

    def __init__(self, manifests: Iterable[Manifest]):
        self.manifests: dict[str, Manifest] = {m.uri: m for m in manifests}
        self._parents: dict[str, set[str]] = {}
        self._children: dict[str, set[str]] = {}
        for manifest in self.manifests.values():
            for ref in manifest.inputs:
                self._parents.setdefault(manifest.uri, set()).add(ref.uri)
                self._children.setdefault(ref.uri, set()).add(manifest.uri)

    def inputs_of(self, uri: str) -> set[str]:
        return set(self._parents.get(uri, ()))

    def ancestors(self, uri: str) -> set[str]:
        """Everything that went into `uri`, transitively (what made X)."""
        return _walk(uri, self._parents)

    def descendants(self, uri: str) -> set[str]:
        """Everything made from `uri`, transitively (what did X feed)."""
        return _walk(uri, self._children)

    def ancestors_of_all(self, uris: Iterable[str]) -> set[str]:
        """Everything that went into any of `uris`, transitively (one walk, however many start points)."""
        seen: set[str] = set()
        queue = deque(parent for uri in uris for parent in self._parents.get(uri, ()))
        while queue:
            node = queue.popleft()
            if node not in seen:
                seen.add(node)
                queue.extend(self._parents.get(node, ()))
        return seen

    def stale_inputs(self) -> list[tuple[str, str]]:
        """(artifact, input) pairs whose recorded input hash no longer matches that input's manifest."""
        stale = []
        for manifest in self.manifests.values():
            for ref in manifest.inputs:
                known = self.manifests.get(ref.uri)
                if known is not None and ref.sha256 is not None and known.sha256 != ref.sha256:
                    stale.append((manifest.uri, ref.uri))
        return stale

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [{"uri": m.uri, "kind": str(m.kind), "sha256": m.sha256, "bytes": m.bytes}
                      for m in self.manifests.values()],
            "edges": [{"from": parent, "to": child}
                      for child, parents in sorted(self._parents.items()) for parent in sorted(parents)],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def build_lineage(store: ObjectStore, prefix: str = "") -> LineageGraph:
    return LineageGraph(iter_manifests(store, prefix))


def _walk(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    queue = deque(edges.get(start, ()))
    while queue:
        node = queue.popleft()
        if node not in seen:
            seen.add(node)
            queue.extend(edges.get(node, ()))
    return seen


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
