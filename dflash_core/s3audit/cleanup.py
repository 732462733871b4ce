"""Cleanup: a dry run by default; deleting needs `confirm=True`, re-checks everything right before the
delete, deletes in batches with retries, and reports exactly what was and was not deleted.

The re-check lists the whole bucket and reads every changed manifest again: a candidate that a new
manifest now references (directly or through lineage), that changed since the dry run, or that is
no longer dead by the rules, is skipped and says why. An artifact's manifest is deleted only after
the artifact itself was, so a failure never leaves an object without its manifest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, Field

from dflash_core.layout import MANIFEST_SUFFIX, ArtifactKind, artifact_key
from dflash_core.lineage import InputRef, Manifest, write_artifact
from dflash_core.provenance import Producer
from dflash_core.s3audit.dead import Candidate, Protected, Retention, find_dead
from dflash_core.s3audit.inventory import DEFAULT_WORKERS, Inventory, manifest_cache, take_inventory
from dflash_core.storage import ObjectStore

DELETE_BATCH = 1000
# Per-key error codes worth another attempt; anything else (AccessDenied, ...) is reported at once.
TRANSIENT_CODES = frozenset({"InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout", "Throttling",
                             "RequestTimeTooSkewed", "OperationAborted", "transport"})


class CleanupNotConfirmed(ValueError):
    pass


class CleanupPlan(BaseModel):
    """What a cleanup would delete (a dry run), and what the safety rule kept."""

    store_uri: str
    prefix: str
    retention: Retention
    planned_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    rules_now: datetime = Field(description="The clock the age rules used (abandoned after N days).")
    candidates: list[Candidate]
    protected: list[Protected]

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.candidates)


class Outcome(BaseModel):
    key: str
    bytes: int
    reason: str
    detail: str = ""


class CleanupResult(BaseModel):
    store_uri: str
    planned_at: datetime
    executed_at: datetime
    who: str
    retention: Retention
    deleted: list[Outcome]
    failed: list[Outcome]
    skipped: list[Outcome]
    deleted_manifests: dict[str, Manifest] = Field(default_factory=dict, description="The manifests of deleted "
                                                                                     "artifacts, as they were.")

    @property
    def bytes_reclaimed(self) -> int:
        return sum(o.bytes for o in self.deleted)

    @property
    def complete(self) -> bool:
        return not self.failed


def plan_cleanup(inventory: Inventory, retention: Retention, *, prefix: str = "", now: datetime | None = None) -> CleanupPlan:
    """The dry run. `inventory` must cover the whole bucket (a reference from outside `prefix` protects
    an object inside it); `prefix` only limits what is nominated."""
    if inventory.store_uri != inventory.bucket_uri:
        raise ValueError(f"plan_cleanup needs an inventory of the whole bucket, not of {inventory.store_uri}: "
                         "references from elsewhere in the bucket protect objects")
    now = now or datetime.now(UTC)
    report = find_dead(inventory, retention, now=now)
    return CleanupPlan(store_uri=inventory.bucket_uri + prefix, prefix=prefix, retention=retention, rules_now=now,
                       candidates=[c for c in report.candidates if c.key.startswith(prefix)],
                       protected=[p for p in report.protected if p.key.startswith(prefix)])


DeleteBatch = Callable[[list[str]], tuple[set[str], dict[str, tuple[str, str]]]]


def delete_batch_s3(store: ObjectStore) -> DeleteBatch:
    """One DeleteObjects call: (keys the server confirmed deleted, key -> (code, message) for the rest)."""
    def delete(keys: list[str]) -> tuple[set[str], dict[str, tuple[str, str]]]:
        try:
            response = store.client.delete_objects(
                Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": False})
        except ClientError as error:  # the whole request refused: its code says whether a retry can help
            code = str(error.response.get("Error", {}).get("Code") or "transport")
            return set(), {k: (code if code not in {"500", "502", "503", "504"} else "transport", str(error))
                           for k in keys}
        except BotoCoreError as error:  # connection dropped, timed out
            return set(), {k: ("transport", str(error)) for k in keys}
        deleted = {item["Key"] for item in response.get("Deleted", [])}
        errors = {item["Key"]: (item.get("Code", "?"), item.get("Message", "")) for item in response.get("Errors", [])}
        for key in keys:
            if key not in deleted and key not in errors:
                errors[key] = ("NoAnswer", "the server neither confirmed nor refused this delete")
        return deleted, errors
    return delete


def execute_cleanup(store: ObjectStore, prefixes: dict[ArtifactKind, str], plan: CleanupPlan, *, confirm: bool,
                    who: str, attempts: int = 3, backoff_s: float = 1.0, workers: int = DEFAULT_WORKERS,
                    delete_batch: DeleteBatch | None = None, known: Inventory | None = None) -> CleanupResult:
    """Delete what `plan` nominated and is still dead now. Without `confirm`, raise and delete nothing."""
    if not confirm:
        raise CleanupNotConfirmed(
            f"dry run: {len(plan.candidates)} objects ({plan.total_bytes:,} bytes) would be deleted; pass "
            "confirm=True (CLI: --confirm) to delete them")
    delete_batch = delete_batch or delete_batch_s3(store)
    fresh = take_inventory(store, prefixes, verify_hashes=False, workers=workers,
                           known=manifest_cache(known) if known else None)
    recheck = find_dead(fresh, plan.retention, now=max(plan.rules_now, datetime.now(UTC)))
    still_dead = {c.key for c in recheck.candidates}
    kept_now = {p.key: p.kept_because for p in recheck.protected}
    current = {row[0]: row[1] for row in fresh.objects.select("key", "etag").rows()}
    to_delete: list[Candidate] = []
    skipped: list[Outcome] = []
    for c in plan.candidates:
        artifact = c.key.removesuffix(MANIFEST_SUFFIX)
        why = ("already gone" if c.key not in current else
               "changed since the dry run" if current[c.key] != c.etag else
               f"now kept: {kept_now[c.key]}" if c.key in kept_now else
               f"now kept: manifest of {artifact}, kept ({kept_now[artifact]})" if artifact in kept_now else
               "no longer dead by the rules" if c.key not in still_dead else "")
        if why:
            skipped.append(Outcome(key=c.key, bytes=c.bytes, reason=c.reason, detail=why))
        else:
            to_delete.append(c)

    # Artifacts (and orphan manifests) first; an artifact's manifest only once the artifact is gone.
    first = [c for c in to_delete if not c.key.endswith(MANIFEST_SUFFIX) or c.key.removesuffix(MANIFEST_SUFFIX)
             not in {d.key for d in to_delete}]
    first_keys = {c.key for c in first}
    second = [c for c in to_delete if c.key not in first_keys]
    deleted_keys, errors = _delete_with_retries([c.key for c in first], delete_batch, attempts, backoff_s)
    ready = [c for c in second if c.key.removesuffix(MANIFEST_SUFFIX) in deleted_keys]
    for c in second:
        if c not in ready:
            skipped.append(Outcome(key=c.key, bytes=c.bytes, reason=c.reason,
                                   detail="kept: its artifact was not deleted"))
    more_deleted, more_errors = _delete_with_retries([c.key for c in ready], delete_batch, attempts, backoff_s)
    deleted_keys |= more_deleted
    errors.update(more_errors)
    by_key = {c.key: c for c in to_delete}
    return CleanupResult(
        store_uri=plan.store_uri, planned_at=plan.planned_at, executed_at=datetime.now(UTC), who=who,
        retention=plan.retention,
        deleted=[Outcome(key=k, bytes=by_key[k].bytes, reason=by_key[k].reason) for k in sorted(deleted_keys)],
        failed=[Outcome(key=k, bytes=by_key[k].bytes, reason=by_key[k].reason, detail=f"{code}: {message}")
                for k, (code, message) in sorted(errors.items())],
        skipped=skipped,
        deleted_manifests={k: fresh.manifests[k] for k in sorted(deleted_keys) if k in fresh.manifests},
    )


def _delete_with_retries(keys: list[str], delete_batch: DeleteBatch, attempts: int,
                         backoff_s: float) -> tuple[set[str], dict[str, tuple[str, str]]]:
    deleted: set[str] = set()
    errors: dict[str, tuple[str, str]] = {}
    pending = list(keys)
    for attempt in range(attempts):
        retry: list[str] = []
        for start in range(0, len(pending), DELETE_BATCH):
            done, failed = delete_batch(pending[start:start + DELETE_BATCH])
            deleted |= done
            for key in done:
                errors.pop(key, None)
            errors.update(failed)
            retry += [k for k, (code, _) in failed.items() if code in TRANSIENT_CODES]
        if not retry or attempt == attempts - 1:
            break
        time.sleep(backoff_s * 2**attempt)
        pending = retry
    return deleted, errors


def write_deletion_record(store: ObjectStore, prefixes: dict[ArtifactKind, str], result: CleanupResult, *,
                          producer: Producer | None = None, inputs: Iterable[InputRef] = ()) -> Manifest:
    """The record of a cleanup (what, bytes, why, who, when; failures and skips too) as a report artifact."""
    stamp = result.executed_at.strftime("%Y%m%dT%H%M%S%fZ")
    key = artifact_key(prefixes, ArtifactKind.REPORT, "s3-cleanup", stamp, "deletion-record.json")
    body = {**json.loads(result.model_dump_json()), "bytes_reclaimed": result.bytes_reclaimed,
            "complete": result.complete}
    return write_artifact(store, key, json.dumps(body, indent=2).encode(), kind=ArtifactKind.REPORT, inputs=inputs,
                          config={"retention": result.retention.model_dump(), "who": result.who}, producer=producer)
