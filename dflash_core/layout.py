"""The one key layout of the bucket: every artifact kind has a prefix and a key shape.

    prompts/<dataset>/<version>/prompts-00000.jsonl
    completions/<dataset>/<run>/shard-00000.jsonl
    tokenized/<dataset>/<run>/shard-00000.arrow
    checkpoints/<run>/step-000100/...
    exports/<run>/<format>/...
    node-backups/<node>/<timestamp>/...
    reports/<kind>/<run>/...                    (plan, training metrics)
    reports/tokenize/<dataset>/<run>/<flow run>/attempt-<n>/stats.json, loss-histogram.png
    reports/generate/<dataset>/<run>/<flow run>/attempt-<n>/summary.json
    reports/evaluate/<run>/<flow run>/attempt-<n>/report.json, acceptance.png
    manifests live beside their artifact: <key>.manifest.json
"""

from __future__ import annotations

import re
from enum import StrEnum

MANIFEST_SUFFIX = ".manifest.json"
QUARANTINE_SUFFIX = ".quarantine.jsonl"


class ArtifactKind(StrEnum):
    PROMPTS = "prompts"
    COMPLETIONS = "completions"
    TOKENIZED = "tokenized"
    CHECKPOINT = "checkpoint"
    EXPORT = "export"
    NODE_BACKUP = "node-backup"
    REPORT = "report"
    SCRATCH = "scratch"


DEFAULT_PREFIXES: dict[ArtifactKind, str] = {
    ArtifactKind.PROMPTS: "prompts",
    ArtifactKind.COMPLETIONS: "completions",
    ArtifactKind.TOKENIZED: "tokenized",
    ArtifactKind.CHECKPOINT: "checkpoints",
    ArtifactKind.EXPORT: "exports",
    ArtifactKind.NODE_BACKUP: "node-backups",
    ArtifactKind.REPORT: "reports",
    ArtifactKind.SCRATCH: "scratch",
}

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def _check_segment(segment: str) -> str:
    if not _SEGMENT.match(segment) or segment.endswith(MANIFEST_SUFFIX):
        raise ValueError(
            f"key segment {segment!r} is not allowed: use letters, digits and . _ = + - "
            "(no slashes, no leading dot)"
        )
    return segment


def artifact_key(prefixes: dict[ArtifactKind, str], kind: ArtifactKind, *segments: str) -> str:
    """`<prefix of kind>/<segment>/...`, each segment checked so keys stay predictable."""
    return "/".join([prefixes[kind], *(_check_segment(s) for s in segments)])


def shard_name(index: int, *, stem: str = "shard", suffix: str) -> str:
    return f"{stem}-{index:05d}.{suffix.lstrip('.')}"


def manifest_key(key: str) -> str:
    return key + MANIFEST_SUFFIX


def is_manifest_key(key: str) -> bool:
    return key.endswith(MANIFEST_SUFFIX)


def kind_of_key(prefixes: dict[ArtifactKind, str], key: str) -> ArtifactKind | None:
    """Which artifact kind a key belongs to, by its first path segment."""
    first = key.split("/", 1)[0]
    for kind, prefix in prefixes.items():
        if prefix.split("/", 1)[0] == first:
            return kind
    return None
