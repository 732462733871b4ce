"""The one key layout of the bucket: every artifact kind has a prefix and a key shape.

    prompts/<dataset>/<version>/prompts-00000.jsonl, heldout-00000.jsonl   (the held-out split: never trained on)
    completions/<dataset>/<run>/shard-00000.jsonl, heldout-00000.jsonl
    tokenized/<dataset>/<run>/shard-00000.arrow, heldout-00000.arrow
    checkpoints/<run>/step-000100/...
    checkpoints/<run>/lease.json                (the live run's claim on the name)
    exports/<run>/<format>/...
    node-backups/<node>/<timestamp>/...
    reports/<kind>/<run>/...                    (plan, training metrics)
    reports/train/<run>/run.yaml, provenance.json, metrics.jsonl   (the trainer, at start and each checkpoint;
                                                 the train flow's report again at the end, with curves.png)
    reports/tokenize/<dataset>/<run>/<flow run>/attempt-<n>/stats.json, loss-histogram.png
    reports/generate/<dataset>/<run>/<flow run>/attempt-<n>/summary.json
    reports/evaluate/<run>/<flow run>/attempt-<n>/report.json, acceptance.png
    reports/<stage>/.../<flow run>/attempt-<n>/result.json   (each stage's typed result, dflash_core.stage_results)
    manifests live beside their artifact: <key>.manifest.json
    prefect-results/<cache key>                 (Prefect's own persisted results, its task cache: not artifacts, no
                                                 manifests; written by the result block of flows/results.py)
"""

from __future__ import annotations

import re
from enum import StrEnum

MANIFEST_SUFFIX = ".manifest.json"
QUARANTINE_SUFFIX = ".quarantine.jsonl"
RUN_LEASE_FILE = "lease.json"
# Prefect's persisted results live at the bucket root under this folder, whatever the kind prefixes are. Not an
# ArtifactKind: nothing of ours writes there and nothing there has a manifest. The S3 audit counts it as its
# own kind (dflash_core.s3audit); flows/results.py points Prefect's result block at it.
PREFECT_RESULTS_FOLDER = "prefect-results"


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


def checkpoints_key(prefixes: dict[ArtifactKind, str], run_name: str, step_dir: str | None = None) -> str:
    """`checkpoints/<run>`, the S3 home of a training run's checkpoints, or `checkpoints/<run>/<step_dir>`
    (e.g. step-000200), one of them."""
    return artifact_key(prefixes, ArtifactKind.CHECKPOINT, run_name, *([step_dir] if step_dir else []))


def run_lease_key(prefixes: dict[ArtifactKind, str], run_name: str) -> str:
    """`checkpoints/<run>/lease.json`: which process trains `run_name` now (dflash_core.train.run_lease)."""
    return artifact_key(prefixes, ArtifactKind.CHECKPOINT, run_name, RUN_LEASE_FILE)


# A training run's record, written in its run dir: the resolved config, the code and versions that ran, the
# metrics log. Uploaded beside its checkpoints so a run stays auditable from the bucket after its node is gone.
TRAIN_RUN_FILES = ("run.yaml", "provenance.json", "metrics.jsonl")
CHECKPOINT_MODEL_FILE = "model.safetensors"  # a checkpoint step dir's weights; meta.json has drafter_config
CHECKPOINT_META_FILE = "meta.json"


def train_report_key(prefixes: dict[ArtifactKind, str], run_name: str, name: str) -> str:
    """`reports/train/<run>/<name>`: a file of a training run's record (TRAIN_RUN_FILES, which the trainer uploads
    at its start and at each checkpoint) or of the train flow's report (curves.png)."""
    return artifact_key(prefixes, ArtifactKind.REPORT, "train", run_name, name)


HELDOUT_STEM = "heldout"  # shards of the held-out split: prompts never trained on


def shard_name(index: int, *, stem: str = "shard", suffix: str) -> str:
    return f"{stem}-{index:05d}.{suffix.lstrip('.')}"


def is_heldout_key(key: str) -> bool:
    """A shard of the held-out split (prompts, completions or tokenized)."""
    return key.rsplit("/", 1)[-1].startswith(f"{HELDOUT_STEM}-")


def downstream_shard_name(upstream_key: str, *, suffix: str) -> str:
    """The name a stage gives the shard it makes from `upstream_key`: same split, same index
    (prompts-00003.jsonl -> shard-00003.<suffix>, heldout-00001.jsonl -> heldout-00001.<suffix>)."""
    name = upstream_key.rsplit("/", 1)[-1]
    stem, _, rest = name.partition("-")
    index = int(rest.split(".", 1)[0])
    return shard_name(index, stem=HELDOUT_STEM if stem == HELDOUT_STEM else "shard", suffix=suffix)


def manifest_key(key: str) -> str:
    return key + MANIFEST_SUFFIX


def is_manifest_key(key: str) -> bool:
    return key.endswith(MANIFEST_SUFFIX)


def completion_run_of(prefixes: dict[ArtifactKind, str], prefix: str) -> tuple[str, str]:
    """(dataset, run) of a completion run's prefix `completions/<dataset>/<run>/`; a ValueError otherwise."""
    segments = prefix.rstrip("/").split("/")
    if kind_of_key(prefixes, prefix) != ArtifactKind.COMPLETIONS or len(segments) != 3:
        example = artifact_key(prefixes, ArtifactKind.COMPLETIONS, "DATASET", "RUN")
        raise ValueError(f"{prefix!r} is not a completion run's prefix: expected {example}/")
    return segments[1], segments[2]


def is_completion_shard(key: str) -> bool:
    """A completion shard of either split (shard-NNNNN.jsonl, heldout-NNNNN.jsonl), not its manifest or quarantine."""
    name = key.rsplit("/", 1)[-1]
    return (name.endswith(".jsonl") and not is_manifest_key(key) and not name.endswith(QUARANTINE_SUFFIX)
            and name.startswith(("shard-", f"{HELDOUT_STEM}-")))


def kind_of_key(prefixes: dict[ArtifactKind, str], key: str) -> ArtifactKind | None:
    """Which artifact kind a key belongs to, by its first path segment."""
    first = key.split("/", 1)[0]
    for kind, prefix in prefixes.items():
        if prefix.split("/", 1)[0] == first:
            return kind
    return None
