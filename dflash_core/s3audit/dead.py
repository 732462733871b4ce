"""What is dead in the bucket, and the one safety rule no cleanup breaks.

Rules that nominate objects (each candidate says why):
- checkpoints beyond the newest `keep_checkpoints` complete steps of their run (a step without its
  meta.json may be an upload in flight: never nominated);
- superseded tokenizations: a tokenized file whose inputs were re-tokenized later into a file of the
  same name elsewhere; with it, what only describes superseded files (the run's dataset.json, the
  tokenize reports), unless what they describe is kept;
- abandoned prefixes: a prefix group where no object has a manifest and nothing changed for
  `abandoned_after_days` (the 645 GB of dead hidden states looked like this);
- manifests whose object is gone;
- Prefect's persisted results (`prefect-results/`, its task cache) older than
  `prefect_results_days`, only when that is set: by default they are kept forever, and the
  abandoned-prefix rule never applies to them (they never have manifests). Deleting one costs only a
  recomputation: the next run with that cache key finds no result and runs the task again.

The safety rule: nothing that a kept manifest references, directly or through its lineage (its
inputs' inputs, ...), is ever a candidate, whatever rule nominated it; nor anything under
`keep_prefixes`. A candidate's manifest goes with it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import UTC, datetime

import polars as pl
from pydantic import BaseModel, Field

from dflash_core.layout import MANIFEST_SUFFIX, ArtifactKind
from dflash_core.lineage import InputRef, Manifest
from dflash_core.s3audit.inventory import PREFECT_RESULTS_KIND, Inventory
from dflash_core.strict import StrictModel

_STEP = re.compile(r"^step-(\d+)$")
CHECKPOINT_COMPLETE_FILE = "meta.json"  # written last (dflash_core.train.checkpoint): its presence marks a step complete


class Retention(StrictModel):
    keep_checkpoints: int = Field(3, ge=1, description="Newest checkpoint steps kept per training run.")
    abandoned_after_days: float = Field(30.0, ge=0, description="A prefix with no manifests, untouched this long, "
                                                                "is abandoned.")
    keep_prefixes: list[str] = Field(default_factory=list, description="Key prefixes never nominated.")
    prefect_results_days: float | None = Field(
        None, ge=0, description="Prefect's persisted results (prefect-results/, its task cache) older than this "
        "many days are cleanup candidates. None (the default): kept forever, never nominated.")


class Candidate(BaseModel):
    key: str
    bytes: int
    etag: str
    kind: str
    group: str
    rule: str = Field(description="old-checkpoint | superseded-tokenization | abandoned-prefix | orphan-manifest | "
                                  "old-prefect-result")
    reason: str


class Protected(BaseModel):
    key: str
    bytes: int = 0
    nominated_because: str
    kept_because: str


class DeadReport(BaseModel):
    candidates: list[Candidate]
    protected: list[Protected]

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.candidates)


def find_dead(inventory: Inventory, retention: Retention, *, now: datetime | None = None) -> DeadReport:
    now = now or datetime.now(UTC)
    objects = inventory.objects
    rows = {row["key"]: row for row in objects.iter_rows(named=True)}
    nominated: dict[str, tuple[str, str]] = {}  # artifact key (or orphan manifest key) -> (rule, reason)

    checkpoint_prefix = inventory.prefixes[ArtifactKind.CHECKPOINT].strip("/") + "/"
    rules = [
        ("old-checkpoint", _old_checkpoints(inventory.artifacts, checkpoint_prefix, retention.keep_checkpoints)),
        ("superseded-tokenization", _superseded_tokenizations(inventory)),
        ("abandoned-prefix", _abandoned(inventory.artifacts, retention.abandoned_after_days, now)),
        ("orphan-manifest", {key: "manifest of an object that is gone"
                             for key in objects.filter(pl.col("is_manifest") & ~pl.col("object_exists"))["key"]}),
        ("old-prefect-result", _old_prefect_results(inventory.artifacts, retention.prefect_results_days, now)),
    ]
    for rule, found in rules:
        for key, reason in found.items():
            nominated.setdefault(key, (rule, reason))
    nominated.update({key: ("superseded-tokenization", reason)
                      for key, reason in _describing_only(inventory, nominated).items() if key not in nominated})

    protected: list[Protected] = []
    for key in [k for k in nominated if any(k.startswith(p) for p in retention.keep_prefixes)]:
        protected.append(Protected(key=key, bytes=rows[key]["bytes"], nominated_because=nominated.pop(key)[1],
                                   kept_because="under keep_prefixes"))
    protected += _protect_lineage(inventory, nominated, rows)
    while companions := _companions_of_kept(inventory, nominated):
        for key, subject in companions.items():
            protected.append(Protected(key=key, bytes=rows[key]["bytes"], nominated_because=nominated.pop(key)[1],
                                       kept_because=f"describes {subject}, which is kept"))
        protected += _protect_lineage(inventory, nominated, rows)

    candidates = []
    for key, (rule, reason) in sorted(nominated.items()):
        row = rows[key]
        candidates.append(Candidate(key=key, bytes=row["bytes"], etag=row["etag"], kind=row["kind"],
                                    group=row["group"], rule=rule, reason=reason))
        manifest = key + MANIFEST_SUFFIX
        if manifest in rows:
            m = rows[manifest]
            candidates.append(Candidate(key=manifest, bytes=m["bytes"], etag=m["etag"], kind=m["kind"], group=m["group"],
                                        rule=rule, reason=f"manifest of {key}, which goes"))
    return DeadReport(candidates=candidates, protected=protected)


def _protect_lineage(inventory: Inventory, nominated: dict[str, tuple[str, str]],
                     rows: dict[str, dict]) -> list[Protected]:
    """Drop from `nominated` every artifact a kept manifest reaches through its inputs; repeat until stable
    (an artifact kept for this reason keeps its own inputs too)."""
    graph = inventory.graph()
    uri = inventory.uri
    protected: list[Protected] = []
    while True:
        kept = {uri(k) for k in inventory.manifests if k not in nominated}
        reached = graph.ancestors_of_all(kept)
        newly = [k for k in nominated if uri(k.removesuffix(MANIFEST_SUFFIX)) in reached]
        if not newly:
            return protected
        for key in newly:
            artifact_uri = uri(key.removesuffix(MANIFEST_SUFFIX))
            users = sorted(graph.descendants(artifact_uri) & kept)
            protected.append(Protected(key=key, bytes=rows[key]["bytes"], nominated_because=nominated.pop(key)[1],
                                       kept_because=f"referenced by kept {users[0] if users else '?'}"
                                                    f"{f' and {len(users) - 1} more' if len(users) > 1 else ''}"))


def _old_checkpoints(artifacts: pl.DataFrame, prefix: str, keep: int) -> dict[str, str]:
    """<prefix><run>/step-NNNNNN/<file>: complete steps (meta.json present) older than the newest `keep`."""
    complete: dict[str, set[int]] = defaultdict(set)
    located: list[tuple[str, str, int]] = []
    for key in artifacts.filter(pl.col("kind") == str(ArtifactKind.CHECKPOINT))["key"]:
        parts = key.removeprefix(prefix).split("/")
        if len(parts) >= 3 and (match := _STEP.match(parts[1])):
            run, step = prefix + parts[0], int(match.group(1))
            located.append((key, run, step))
            if parts[-1] == CHECKPOINT_COMPLETE_FILE and len(parts) == 3:
                complete[run].add(step)
    newest = {run: sorted(found, reverse=True)[:keep] for run, found in complete.items()}
    return {key: f"checkpoint step {step} of {run}/: older than the newest {keep} "
                 f"(kept: {', '.join(map(str, newest[run]))})"
            for key, run, step in located if step in complete[run] and step not in newest[run]}


def _superseded_tokenizations(inventory: Inventory) -> dict[str, str]:
    tokenized = {k: m for k, m in inventory.manifests.items() if m.kind == ArtifactKind.TOKENIZED}
    by_inputs: dict[tuple[frozenset[str], str], list[tuple[datetime, str]]] = defaultdict(list)
    for key, manifest in tokenized.items():
        if manifest.inputs:
            by_inputs[(frozenset(r.uri for r in manifest.inputs), key.rsplit("/", 1)[-1])].append((manifest.created_at, key))
    found: dict[str, str] = {}
    for versions in by_inputs.values():
        versions.sort()
        newest_key = versions[-1][1]
        for _, key in versions[:-1]:
            found[key] = f"superseded by {inventory.manifests[newest_key].uri} (same inputs, made later)"
    return found


def _describing_only(inventory: Inventory, nominated: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Tokenized companions and reports whose every input is a superseded tokenization (a run's
    dataset.json, its stats): they describe nothing that stays. Repeated until nothing new is found."""
    superseded = {inventory.uri(k) for k, (rule, _) in nominated.items() if rule == "superseded-tokenization"}
    found: dict[str, str] = {}
    while True:
        new = {key: f"describes only superseded tokenizations ({len(data)} inputs, e.g. {data[0].uri})"
               for key, m in inventory.manifests.items()
               if key not in found and key not in nominated and (data := _data_inputs(m))
               and m.kind in (ArtifactKind.TOKENIZED, ArtifactKind.REPORT)
               and all(ref.uri in superseded for ref in data)}
        if not new:
            return found
        found.update(new)
        superseded |= {inventory.uri(k) for k in new}


def _companions_of_kept(inventory: Inventory, nominated: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Nominated describers whose subject is no longer nominated (lineage kept it): they stay with it
    (a kept shard needs its dataset.json: the trainer reads the quality verdict there)."""
    found = {}
    for key, (_, reason) in nominated.items():
        manifest = inventory.manifests.get(key)
        if manifest is None or not reason.startswith("describes only"):
            continue
        kept = [ref.uri for ref in _data_inputs(manifest)
                if ref.uri.removeprefix(inventory.bucket_uri) not in nominated]
        if kept:
            found[key] = kept[0]
    return found


def _data_inputs(manifest: Manifest) -> list[InputRef]:
    """The inputs that are data (not the tokenizer's or the target model's files: those describe nothing)."""
    return [ref for ref in manifest.inputs if ref.role is None]


def _abandoned(artifacts: pl.DataFrame, days: float, now: datetime) -> dict[str, str]:
    """Prefix groups of objects that should have manifests (not Prefect's results), none has one, untouched `days`."""
    groups = artifacts.filter(pl.col("needs_manifest")).group_by("group").agg(
        manifested=pl.col("has_manifest").sum(), newest=pl.col("last_modified").max(), keys=pl.col("key"),
        bytes=pl.col("bytes").sum(),
    ).filter((pl.col("manifested") == 0) & (pl.col("newest") < pl.lit(now) - pl.duration(seconds=days * 86400)))
    found = {}
    for row in groups.iter_rows(named=True):
        idle = (now - row["newest"]).total_seconds() / 86400
        reason = (f"abandoned prefix {row['group']}/: {len(row['keys'])} objects, {row['bytes']:,} bytes, no manifests, "
                  f"untouched for {idle:.1f} days")
        found.update({key: reason for key in row["keys"]})
    return found


def _old_prefect_results(artifacts: pl.DataFrame, days: float | None, now: datetime) -> dict[str, str]:
    """Prefect's persisted results last written more than `days` ago; none when `days` is None (kept forever)."""
    if days is None:
        return {}
    old = artifacts.filter((pl.col("kind") == PREFECT_RESULTS_KIND)
                           & (pl.col("last_modified") < pl.lit(now) - pl.duration(seconds=days * 86400)))
    return {key: f"Prefect result written {(now - modified).total_seconds() / 86400:.1f} days ago, older than "
                 f"prefect_results_days={days:g} (a run with its cache key recomputes it)"
            for key, modified in old.select("key", "last_modified").rows()}
