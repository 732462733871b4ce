"""Checkpoints to S3 in the background, so an S3 outage never stops training.

The trainer writes each checkpoint locally (atomic) and hands it to `CheckpointUploader.submit`; a
thread uploads it (every file with its manifest, meta.json last), retrying with exponential backoff
while the store is unavailable and warning while it is behind. Training goes on with local
checkpoints; the run fails only when the store stays unavailable longer than `outage_limit_s`, or
at once on a configuration error (wrong credentials, missing bucket, not an S3 server).

The pending set is bounded by `keep_last`: a checkpoint the local prune has already deleted is no
longer worth uploading. At start and at the end the uploader reconciles local with S3: every kept
local checkpoint is complete in S3 with manifests and matching sha256 (what is missing, incomplete or
different is uploaded again), S3 keeps the same last N steps (older and incomplete step dirs are
deleted) and leftover multipart uploads are aborted. `finish` raises unless the final checkpoint is
complete in S3.

The run's record (`run_files`: run.yaml, provenance.json, metrics.jsonl) rides the same queue, with the
same retries and outage limit: uploaded with manifests at start, after each checkpoint
(`submit_run_files`) and at the end, each file only when S3's copy differs, metrics.jsonl up to its
last complete record (the trainer may be appending one).

Given the run's `lease` (dflash_core.train.run_lease), every write and delete goes through a store fenced
by it: while the claim is pending or has expired on our side (S3 unreachable for longer than the lease
allows) nothing is written and the job is retried as in an outage; once another run owns the name the
uploads fail at once, so a cut-off owner never writes into the new owner's checkpoints.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_core.layout import ArtifactKind, manifest_key
from dflash_core.lineage import InputRef, read_manifest, write_artifact
from dflash_core.provenance import Producer
from dflash_core.storage import (
    ChecksumMismatch, ObjectNotFound, ObjectStore, StoreConfigError, StoreError, StoreUnavailable, sha256_bytes,
    sha256_file,
)
from dflash_core.train.checkpoint import _FILES, complete_checkpoints
from dflash_core.train.remote import upload_checkpoint
from dflash_core.train.run_lease import RunLease, RunLeaseHeld, RunLeaseLost

DEFAULT_OUTAGE_LIMIT_S = 300.0  # below entry's process-group timeout: other ranks wait while rank 0 finishes
_RECONCILE = "reconcile"
_RUN_FILES = "run-files"


class CheckpointUploadFailed(StoreError):
    """The run cannot be trusted to have its checkpoints in S3; the message says why and what to do."""


@dataclass
class RemoteStep:
    step: int
    files: set[str]  # names present: checkpoint files and their manifests

    def complete(self) -> bool:
        return all(name in self.files and manifest_key(name) in self.files for name in _FILES)


def step_of(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def remote_checkpoints(store: ObjectStore, key_prefix: str) -> dict[int, RemoteStep]:
    """Every step dir under `key_prefix` in S3 with the files it holds (complete or not)."""
    found: dict[int, RemoteStep] = {}
    base = key_prefix.rstrip("/") + "/"
    for info in store.list(base):
        parts = info.key[len(base):].split("/")
        step = step_of(parts[0]) if len(parts) == 2 else None
        if step is not None:
            found.setdefault(step, RemoteStep(step, set())).files.add(parts[1])
    return found


class CheckpointUploader:
    def __init__(self, store: ObjectStore, *, root: Path, key_prefix: str, keep_last: int,
                 inputs: list[InputRef] = (), config: dict | None = None, producer: Producer | None = None,
                 run_files: dict[str, Path] | None = None, outage_limit_s: float = DEFAULT_OUTAGE_LIMIT_S,
                 backoff_s: tuple[float, float] = (1.0, 30.0), lease: RunLease | None = None,
                 log: Callable[[str], None] | None = None):
        """`run_files`: S3 key -> local file of the run's record, uploaded at start, on `submit_run_files` and
        at `finish` (a file not written yet is skipped). `lease`: the run's claim on its name, which every
        write to S3 must hold (None: writes are not fenced, for callers that claim no name)."""
        self.store = store.fenced(lease.require_held) if lease is not None else store
        self.root = Path(root)
        self.key_prefix = key_prefix.rstrip("/")
        self.keep_last = keep_last
        self.inputs = list(inputs)
        self.config = config or {}
        self.producer = producer
        self.run_files = dict(run_files or {})
        self.outage_limit_s = outage_limit_s
        self.backoff_s = backoff_s
        self.log = log or (lambda message: print(f"[checkpoint upload] {message}", file=sys.stderr, flush=True))
        self.uploaded: list[int] = []  # steps uploaded by this uploader, in order (tests, reports)
        self.uploaded_run_files: list[str] = []  # keys of the run's record as uploaded, in order (tests, reports)
        self._jobs: deque[str | Path] = deque([_RECONCILE, _RUN_FILES] if self.run_files else [_RECONCILE])
        self._cond = threading.Condition()
        self._closing = False
        self._error: StoreError | None = None
        self._down_since: float | None = None
        self._hashes: dict[tuple[str, int, int], str] = {}
        self._thread = threading.Thread(target=self._work, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    # ---- the trainer's side ------------------------------------------------------------------------

    def submit(self, path: Path) -> None:
        """Queue a freshly written local checkpoint; returns at once."""
        with self._cond:
            self._jobs.append(Path(path))
            pending = [job for job in self._jobs if isinstance(job, Path)]
            while len(pending) > self.keep_last:  # already pruned locally: no longer worth uploading
                self._jobs.remove(pending.pop(0))
            if len(pending) > 1:
                self.log(f"behind: {len(pending)} checkpoints wait for upload ({', '.join(p.name for p in pending)})")
            self._cond.notify_all()

    def submit_run_files(self) -> None:
        """Queue an upload of the run's record as it will be when the job runs; returns at once."""
        if not self.run_files:
            return
        with self._cond:
            if _RUN_FILES not in list(self._jobs)[1:]:  # one waiting behind the running job reads the latest files
                self._jobs.append(_RUN_FILES)
                self._cond.notify_all()

    def raise_if_failed(self) -> None:
        """Raise the uploader's fatal error (configuration error, or an outage past the limit) if any."""
        if self._error is not None:
            raise self._error

    def finish(self, *, final: Path | None) -> None:
        """Upload what is pending and the run's record as it ends, reconcile, and raise unless `final` (the
        run's last checkpoint) is complete in S3. Waits at most as long as the outage limit allows."""
        self.submit_run_files()
        with self._cond:
            self._jobs.append(_RECONCILE)
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.raise_if_failed()
        if final is not None:
            try:
                remote = remote_checkpoints(self.store, self.key_prefix).get(step_of(final.name))
            except StoreError as error:
                raise CheckpointUploadFailed(f"could not verify the final checkpoint {final.name} in S3 ({error}); "
                                             "rerun with --resume to check and upload it") from error
            if remote is None or not remote.complete():
                raise CheckpointUploadFailed(
                    f"the final checkpoint {final.name} is not complete in {self.store.uri(self.key_prefix)}/ "
                    f"(present: {sorted(remote.files) if remote else 'nothing'}); rerun with --resume to upload it")

    def close(self) -> None:
        """Stop without waiting for pending uploads (the next run's reconcile uploads them)."""
        with self._cond:
            self._jobs.clear()
            self._closing = True
            self._cond.notify_all()

    # ---- the thread -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            if not self._attempt(job):
                return
            with self._cond:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.popleft()

    def _attempt(self, job: str | Path) -> bool:
        """Run one job until it succeeds (True) or fails for good (False, `_error` set)."""
        delay = self.backoff_s[0]
        while True:
            try:
                if job == _RECONCILE:
                    self.reconcile()
                elif job == _RUN_FILES:
                    self._upload_run_files()
                else:
                    self._upload(job)
                if self._down_since is not None:
                    self.log(f"S3 is back after {time.monotonic() - self._down_since:.0f} s")
                self._down_since = None
                return True
            except (StoreConfigError, ChecksumMismatch, RunLeaseHeld, RunLeaseLost) as error:
                self._error = CheckpointUploadFailed(f"checkpoint upload failed and cannot succeed by retrying: "
                                                     f"{error}")
                self.log(str(self._error))
                return False
            except (StoreError, OSError) as error:
                if isinstance(error, FileNotFoundError) and job != _RECONCILE:
                    return True  # pruned locally meanwhile; the reconcile covers what is kept
                now = time.monotonic()
                self._down_since = self._down_since or now
                down = now - self._down_since
                if down > self.outage_limit_s:
                    self._error = CheckpointUploadFailed(
                        f"S3 at {self.store.endpoint_url} has been failing for {down:.0f} s, past the outage limit "
                        f"of {self.outage_limit_s:.0f} s (--s3-outage-limit-s / DFLASH_S3_OUTAGE_LIMIT_S): {error}. "
                        f"Local checkpoints are intact under {self.root}; rerun with --resume when S3 is back")
                    self.log(str(self._error))
                    return False
                what = ("reconcile with S3" if job == _RECONCILE else "upload of the run's record"
                        if job == _RUN_FILES else f"upload of {job.name}")
                kind = "S3 unavailable" if isinstance(error, StoreUnavailable) else type(error).__name__
                self.log(f"{what} failed ({kind}: {error}); retrying in {delay:.0f} s, down {down:.0f} s of the "
                         f"{self.outage_limit_s:.0f} s limit; training goes on with local checkpoints")
                with self._cond:
                    self._cond.wait(timeout=delay)
                delay = min(delay * 2, self.backoff_s[1])

    # ---- work ----------------------------------------------------------------------------------

    def _upload(self, path: Path) -> None:
        self._sync(path, remote_checkpoints(self.store, self.key_prefix).get(step_of(path.name)))
        self._prune_remote()

    def _sync(self, path: Path, remote: RemoteStep | None) -> bool:
        """Make S3's copy of local checkpoint `path` complete and identical (meta.json last); True when
        anything had to be uploaded."""
        prefix = f"{self.key_prefix}/{path.name}"

        def unchanged(name: str) -> bool:
            return (remote is not None and name in remote.files and manifest_key(name) in remote.files
                    and self._matches(f"{prefix}/{name}", self._sha256(path / name)))

        written = upload_checkpoint(self.store, path, key_prefix=self.key_prefix, inputs=self.inputs,
                                    config=self.config, producer=self.producer, unchanged=unchanged)
        if written:
            self.uploaded.append(step_of(path.name))
        return bool(written)

    def _upload_run_files(self) -> None:
        """Each file of the run's record whose S3 copy (or manifest) differs from the local file, with its
        manifest; a .jsonl up to its last complete line."""
        for key, path in self.run_files.items():
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue  # not written yet: metrics.jsonl before the first logged step
            if path.suffix == ".jsonl":
                data = data[:data.rfind(b"\n") + 1]
            if not data or self._matches(key, sha256_bytes(data)):
                continue
            write_artifact(self.store, key, data, kind=ArtifactKind.REPORT, inputs=self.inputs, config=self.config,
                           producer=self.producer)
            self.uploaded_run_files.append(key)

    def _matches(self, key: str, sha256: str) -> bool:
        try:
            return self.store.head(key).sha256 == sha256 and read_manifest(self.store, key).sha256 == sha256
        except (ObjectNotFound, ValueError):
            return False

    def _sha256(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = sha256_file(path)
        return self._hashes[key]

    def reconcile(self) -> dict:
        """Local kept checkpoints complete and verified in S3, S3 pruned to the same last N, leftover
        multipart uploads aborted. What it did, for logs and tests."""
        aborted = self.store.abort_incomplete_uploads(self.key_prefix + "/")
        remote = remote_checkpoints(self.store, self.key_prefix)
        repaired = [path.name for path in complete_checkpoints(self.root)[-self.keep_last:]
                    if self._sync(path, remote.get(step_of(path.name)))]
        pruned = self._prune_remote()
        if repaired or pruned or aborted:
            self.log(f"reconciled {self.store.uri(self.key_prefix)}/: uploaded {repaired or 'nothing'}, pruned "
                     f"{pruned or 'nothing'}, aborted {aborted} incomplete multipart upload(s)")
        return {"uploaded": repaired, "pruned": pruned, "aborted_multipart": aborted}

    def _prune_remote(self) -> list[str]:
        """Keep the newest `keep_last` complete steps in S3; delete older and incomplete step dirs
        (an incomplete one newer than every kept step is an upload in flight: left alone)."""
        remote = remote_checkpoints(self.store, self.key_prefix)
        complete = sorted(step for step, r in remote.items() if r.complete())
        keep = set(complete[-self.keep_last:])
        newest = max(keep, default=-1)
        doomed = sorted(step for step in remote if step not in keep and step < newest)
        keys = [info.key for step in doomed for info in self.store.list(f"{self.key_prefix}/step-{step:06d}/")]
        self.store.delete_many(keys)
        return [f"step-{step:06d}" for step in doomed]
