"""Artifact manifests and the lineage graph rebuilt from them.

Every artifact written through `write_artifact` gets `<key>.manifest.json` beside it: kind, URI,
sha256, bytes, producer, inputs (URIs + hashes; the target model's and tokenizer's files too, from
dflash_core.lineage_refs), config and creation time. The manifests are the system of record:
lineage is rebuilt from them alone, so an audit needs no Prefect database. The views of it (the CLI's
tree, the UI's pages, edge tables) are in dflash_core.lineage_views. Pure functions over an
`ObjectStore`; no orchestrator import.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
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
