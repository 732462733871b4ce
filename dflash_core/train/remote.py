"""Checkpoints to and from S3, each file with a manifest (inputs: the tokenized shards trained on). A resume
takes the newest checkpoint none of whose files was written after its writer lost the run name
(dflash_core.train.run_lease.postdates_takeover); the newer ones are skipped and reported."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dflash_core.layout import is_manifest_key
from dflash_core.lineage import InputRef, Manifest, write_artifact
from dflash_core.layout import ArtifactKind
from dflash_core.provenance import Producer
from dflash_core.storage import ObjectInfo, ObjectNotFound, ObjectStore
from dflash_core.train.checkpoint import META_FILE, _FILES, step_dir_name
from dflash_core.train.run_lease import WRITER_METADATA_KEY, Claim, postdates_takeover


@dataclass(frozen=True)
class TrustedCheckpoint:
    step: int
    sha256: dict[str, str | None]  # file name -> the hash of the version judged (None: the object has none)


def upload_checkpoint(store: ObjectStore, path: Path, *, key_prefix: str, inputs: list[InputRef],
                      config: dict, producer: Producer | None = None,
                      unchanged: Callable[[str], bool] | None = None) -> list[Manifest]:
    """Upload one checkpoint dir to `<key_prefix>/<step dir>/`, each file with its manifest; meta.json
    goes last so a reader that sees it sees a complete checkpoint. Files for which `unchanged(name)`
    holds (already in S3, verified) are skipped; returns the manifests written."""
    manifests = []
    for name in sorted(_FILES, key=lambda n: n == META_FILE):
        if unchanged is not None and unchanged(name):
            continue
        manifests.append(write_artifact(store, f"{key_prefix}/{path.name}/{name}", path / name,
                                        kind=ArtifactKind.CHECKPOINT, inputs=inputs, config=config,
                                        producer=producer))
    return manifests


def remote_steps(store: ObjectStore, key_prefix: str) -> list[int]:
    """Steps with a complete checkpoint (meta.json present) under `key_prefix`."""
    steps = set()
    for info in store.list(key_prefix.rstrip("/") + "/"):
        parts = info.key.rsplit("/", 2)
        if len(parts) == 3 and parts[2] == META_FILE and parts[1].startswith("step-") \
                and not is_manifest_key(info.key):
            steps.add(int(parts[1].split("-")[1]))
    return sorted(steps)


def latest_trusted_checkpoint(store: ObjectStore, key_prefix: str, claims: Sequence[Claim], *,
                              log: Callable[[str], None]) -> TrustedCheckpoint | None:
    """The newest complete checkpoint under `key_prefix` whose every file the run name's `claims` trust;
    each newer one is skipped with a `log` line naming its files written after their writer lost the name."""
    for step in reversed(remote_steps(store, key_prefix)):
        base = f"{key_prefix.rstrip('/')}/{step_dir_name(step)}"
        try:
            files = {name: store.head(f"{base}/{name}") for name in _FILES}
        except ObjectNotFound as error:
            log(f"skipped {store.uri(base)}/: {error}")
            continue
        late = [_late_line(store, info, claims) for info in files.values()]
        if not any(late):
            return TrustedCheckpoint(step, {name: info.sha256 for name, info in files.items()})
        late_files = "; ".join(line for line in late if line)
        log(f"skipped {store.uri(base)}/, written after the run name was taken over: {late_files}")
    return None


def _late_line(store: ObjectStore, info: ObjectInfo, claims: Sequence[Claim]) -> str | None:
    """Why `info` is not trusted, or None when it is."""
    writer = info.metadata.get(WRITER_METADATA_KEY)
    taker = postdates_takeover(claims, writer=writer, written_at=info.last_modified)
    if taker is None:
        return None
    by = f"claim {writer}" if writer else "a writer with no claim stamped"
    when = "at an unknown time" if taker.at is None else f"at {_iso(taker.at)}"
    return (f"{store.uri(info.key)} written {info.last_modified.isoformat()} by {by}, after claim {taker.owner} "
            f"took the name {when}")


def download_checkpoint(store: ObjectStore, *, key_prefix: str, step: int, root: Path,
                        sha256: dict[str, str | None] | None = None) -> Path:
    """Step `step`'s files into `root`; `sha256`: per file, the version to accept (ChecksumMismatch for
    another, e.g. one written since it was judged)."""
    name = step_dir_name(step)
    target = root / name
    for file in _FILES:
        store.get_file(f"{key_prefix.rstrip('/')}/{name}/{file}", target / file, sha256=(sha256 or {}).get(file))
    return target


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")
