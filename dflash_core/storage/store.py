"""The one S3 client of the project: files, bytes and streams in and out of one bucket.

Every object written here carries its sha256 in user metadata (`x-amz-meta-sha256`); reads verify
it. The same hash goes into the artifact manifest (dflash_core.lineage), so a manifest and the
object it describes can be checked against each other without downloading twice.

Every failure is one of the errors of `dflash_core.storage.errors` (importable from here too), which
tell the caller what to do: `StoreUnavailable` (unreachable, timeouts, 5xx, throttling: retry later),
`StoreConfigError` (wrong credentials, missing bucket, an endpoint that is not an S3 server: retrying
cannot help, fix the named setting), `ObjectNotFound`, `ChecksumMismatch`, `PreconditionFailed` (a
conditional write or delete found the object changed). A download that cannot fit on the local disk raises
`DiskFull` (dflash_core.storage.disk): refused before it starts when the object is larger than what is
free, or after the partial file is removed when the disk fills during it.

`fenced(guard)` gives the same bucket with a guard called before every write and delete: a training run's
uploads are fenced by its run lease that way. The guard is told how long a request sent now may stay in flight
(`longest_request_s`, from the client's own timeouts and retries), and what it returns is stamped on every
object written, so a reader can tell which writer an object came from.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from dflash_core.storage.errors import (
    BOTO_ERRORS, ChecksumMismatch, ObjectNotFound, PreconditionFailed, StoreConfigError, StoreError,
    StoreUnavailable, not_s3, translate,
)
from dflash_core.storage.disk import discard_partial_write, require_free

if TYPE_CHECKING:
    from dflash_core.settings import Settings

__all__ = [  # the error kinds are part of this module's interface
    "MULTIPART_THRESHOLD", "PROGRESS_THRESHOLD", "SHA256_METADATA_KEY", "ChecksumMismatch", "ObjectInfo",
    "ObjectNotFound", "ObjectStore", "PreconditionFailed", "StoreConfigError", "StoreError",
    "StoreUnavailable", "WriteGuard", "longest_request_s", "sha256_bytes", "sha256_file",
]

SHA256_METADATA_KEY = "sha256"
MULTIPART_THRESHOLD = 16 * 1024**2
PROGRESS_THRESHOLD = 64 * 1024**2
_DELETE_BATCH = 1000
_HASH_CHUNK = 4 * 1024**2


_CHECK_ATTEMPTS = 2
_CHECK_CONNECT_TIMEOUT_S = 2
_DATA_CONNECT_TIMEOUT_S = 5
_DATA_READ_TIMEOUT_S = 120  # a multipart part of MULTIPART_THRESHOLD on a slow link, and a busy server's answer
# botocore's retries: its legacy mode's total attempts when a client sets none, and the standard and adaptive
# modes' longest backoff between two attempts (botocore.retries.standard.ExponentialBackoff).
_BOTOCORE_DEFAULT_ATTEMPTS = 5
_BOTOCORE_MAX_BACKOFF_S = 20.0
DOWNLOAD_DISK_ADVICE = "Free space there, or download to a disk with room, then retry"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    last_modified: datetime | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def sha256(self) -> str | None:
        return self.metadata.get(SHA256_METADATA_KEY)


class WriteGuard(Protocol):
    def __call__(self, key: str, *, in_flight_s: float) -> Mapping[str, str] | None:
        """Raise a `StoreError` to refuse writing (or deleting) `key` with a request that may stay in flight for
        up to `in_flight_s` after it is sent; else the user metadata to stamp on the object written, if any."""


def longest_request_s(client, *, with_retries: bool) -> float:
    """How long a request of `client` may stay in flight once sent, by its own config: one attempt's connect
    and read timeouts; `with_retries`: every attempt botocore may make and the backoff between them."""
    config = client.meta.config
    attempt_s = float(config.connect_timeout) + float(config.read_timeout)
    if not with_retries:
        return attempt_s
    attempts = (config.retries or {}).get("total_max_attempts", _BOTOCORE_DEFAULT_ATTEMPTS)
    return attempts * attempt_s + (attempts - 1) * _BOTOCORE_MAX_BACKOFF_S


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore:
    """One bucket on one S3 endpoint. Build it with `ObjectStore.from_settings(settings)`."""

    def __init__(self, client, bucket: str, *, endpoint_url: str = "", scratch_dir: Path | None = None,
                 probe_client=None, client_factory: Callable[[], Any] | None = None):
        self.client = client
        self._client_factory = client_factory  # a fresh client like `client`, for a fenced view
        # `check` answers within seconds: its own client retries little and gives up connecting fast.
        self.probe_client = probe_client or client
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self._scratch_dir = scratch_dir
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD
        )
        self._write_guard: WriteGuard | None = None
        self._in_flight_s = 0.0  # what the guard is told: see `fenced`

    @classmethod
    def from_settings(cls, settings: Settings) -> ObjectStore:
        def client(*, max_attempts: int, connect_timeout: float, read_timeout: float):
            config = Config(
                region_name=settings.s3_region,
                retries={"max_attempts": max_attempts, "mode": "adaptive"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                s3={"addressing_style": "path"},
                # Our own sha256 covers integrity end to end; CRC trailers are not supported by every S3 server.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            return boto3.client(
                "s3",
                endpoint_url=settings.s3_endpoint_url,
                aws_access_key_id=settings.s3_access_key_id.get_secret_value(),
                aws_secret_access_key=settings.s3_secret_access_key.get_secret_value(),
                config=config,
            )

        def data_client():
            return client(max_attempts=settings.s3_max_attempts, connect_timeout=_DATA_CONNECT_TIMEOUT_S,
                          read_timeout=_DATA_READ_TIMEOUT_S)

        return cls(
            data_client(),
            settings.s3_bucket,
            client_factory=data_client,
            endpoint_url=settings.s3_endpoint_url,
            scratch_dir=settings.work_path("tmp"),
            probe_client=client(max_attempts=min(_CHECK_ATTEMPTS, settings.s3_max_attempts),
                                connect_timeout=_CHECK_CONNECT_TIMEOUT_S, read_timeout=10),
        )

    def __repr__(self) -> str:
        return f"ObjectStore(bucket={self.bucket!r}, endpoint_url={self.endpoint_url!r})"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def fenced(self, guard: WriteGuard) -> ObjectStore:
        """This bucket with `guard(key, in_flight_s=...)` called before every write and delete of `key` (it
        raises a `StoreError` to refuse; the metadata it returns is stamped on the object written); reads are
        not guarded. The view has a client of its own that asks the guard again right before each HTTP attempt
        of a write is sent, the client's own retries and each part of a multipart upload included, telling it
        the longest one attempt may stay in flight (connect + read timeout): a write whose first attempt passed
        the guard cannot go out on a later retry after the guard started refusing (a multipart upload stopped
        that way is aborted before the object exists). The view of a store built without a client factory shares
        its client: the guard is asked once per call, told the whole call's time, every retry included."""
        view = copy.copy(self)
        view._write_guard = guard
        if self._client_factory is not None:
            view.client = self._client_factory()
            # last: after botocore's own before-send handlers, e.g. the adaptive mode's rate limiter, which may wait
            view.client.meta.events.register_last("before-send", view._guard_attempt)
        view._in_flight_s = longest_request_s(view.client, with_retries=self._client_factory is None)
        return view

    def key_of(self, uri_or_key: str) -> str:
        """The key of `s3://<this bucket>/<key>` (a bare key as it is); a ValueError for another bucket's URI."""
        if not uri_or_key.startswith("s3://"):
            return uri_or_key
        bucket, _, key = uri_or_key.removeprefix("s3://").partition("/")
        if bucket != self.bucket:
            raise ValueError(f"{uri_or_key!r} is in bucket {bucket!r}, not this store's {self.bucket!r}")
        return key

    # ---- health -----------------------------------------------------------------------------

    def check(self, *, create_bucket: bool = False) -> None:
        """Fail within seconds, naming the setting to fix, when the endpoint is unreachable or not an S3
        server, or the credentials or bucket are wrong. A GET (unlike HEAD) brings back the server's
        XML error code, which tells an S3 server's "no such bucket" from any other server's 404."""
        try:
            with self._errors(key=None):
                listing = self.probe_client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
            if listing.get("Name") != self.bucket:  # some HTTP server answered 200 with a page, not a listing
                server = listing["ResponseMetadata"].get("HTTPHeaders", {}).get("server", "unnamed")
                detail = f"its answer to a bucket listing is not one (server: {server})"
                raise StoreConfigError(not_s3(self.endpoint_url, detail))
        except StoreConfigError as error:
            if create_bucket and "does not exist" in str(error):
                with self._errors(key=None):
                    self.probe_client.create_bucket(Bucket=self.bucket)
                return
            raise

    # ---- writes -----------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None,
                  content_type: str = "application/octet-stream", if_absent: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        """Write `data` under `key`. Conditional with `if_absent` (only if no object has the key:
        If-None-Match: *) or `if_match` (only if the object is still at that ETag: If-Match); when
        the condition does not hold, `PreconditionFailed` and nothing is written. A server that ignores
        preconditions writes anyway, so a caller that relies on them reads the object back."""
        condition, extra = _precondition(if_absent=if_absent, if_match=if_match)
        stamp = self._may_write(key)
        digest = sha256_bytes(data)
        meta = {**(metadata or {}), **stamp, SHA256_METADATA_KEY: digest}
        with self._errors(key, condition=condition):
            response = self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata=meta, ContentType=content_type, **extra
            )
        return ObjectInfo(key=key, size=len(data), etag=response["ETag"].strip('"'), metadata=meta)

    def put_file(self, key: str, path: Path | str, *, metadata: dict[str, str] | None = None,
                 sha256: str | None = None, progress: bool | None = None) -> ObjectInfo:
        """Upload a local file (multipart above 16 MiB); its sha256 is computed unless given."""
        path = Path(path)
        size = path.stat().st_size
        stamp = self._may_write(key)
        meta = {**(metadata or {}), **stamp, SHA256_METADATA_KEY: sha256 or sha256_file(path)}
        with self._errors(key), _transfer_progress(f"upload {path.name}", size, progress) as callback:
            self.client.upload_file(
                str(path), self.bucket, key, ExtraArgs={"Metadata": meta},
                Config=self._transfer, Callback=callback,
            )
        return self.head(key)

    def put_stream(self, key: str, stream: IO[bytes], *, metadata: dict[str, str] | None = None) -> ObjectInfo:
        """Upload a stream of unknown length: spooled to local scratch while hashing, then put_file."""
        scratch = self._scratch()
        with tempfile.NamedTemporaryFile(dir=scratch, delete=False) as spool:
            digest = hashlib.sha256()
            while chunk := stream.read(_HASH_CHUNK):
                digest.update(chunk)
                spool.write(chunk)
        try:
            return self.put_file(key, spool.name, metadata=metadata, sha256=digest.hexdigest())
        finally:
            os.unlink(spool.name)

    def copy(self, source_key: str, dest_key: str) -> ObjectInfo:
        """A server-side copy with the source's metadata (and the fence's stamp, on a fenced view)."""
        stamp = self._may_write(dest_key)
        extra = None
        if stamp:
            extra = {"Metadata": {**self.head(source_key).metadata, **stamp}, "MetadataDirective": "REPLACE"}
        with self._errors(source_key):
            self.client.copy({"Bucket": self.bucket, "Key": source_key}, self.bucket, dest_key, ExtraArgs=extra)
        return self.head(dest_key)

    # ---- reads ------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        with self._errors(key):
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        return ObjectInfo(
            key=key,
            size=response["ContentLength"],
            etag=response["ETag"].strip('"'),
            last_modified=response.get("LastModified"),
            metadata=dict(response.get("Metadata", {})),
        )

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def get_bytes(self, key: str, *, verify: bool = True) -> bytes:
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            data = response["Body"].read()
        if verify:
            self._verify(key, response.get("Metadata", {}).get(SHA256_METADATA_KEY), sha256_bytes(data))
        return data

    def get_file(self, key: str, path: Path | str, *, verify: bool = True, progress: bool | None = None,
                 disk_advice: str = DOWNLOAD_DISK_ADVICE, sha256: str | None = None) -> Path:
        """Download atomically: into a temp file beside `path`, verified, then renamed. `DiskFull` (naming the
        dir, the object's size and what is free, then `disk_advice`) before anything is written when the
        object cannot fit, or once the partial file is removed when the disk fills during the download.
        `sha256`: the hash of the version the caller chose (from an earlier `head`), verified instead of the
        one the object has now, so an object replaced since then is refused."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        info = self.head(key)
        what = f"the download of {self.uri(key)}"
        require_free(path.parent, info.size, what=what, advice=disk_advice)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        try:
            with self._errors(key), _transfer_progress(f"download {key}", info.size, progress) as callback:
                self.client.download_file(self.bucket, key, tmp_name, Config=self._transfer, Callback=callback)
            if verify:
                self._verify(key, sha256 or info.sha256, sha256_file(Path(tmp_name)))
            os.replace(tmp_name, path)
        except OSError as error:  # s3transfer has removed its own partial file by now
            discard_partial_write(error, partial=Path(tmp_name), needed_bytes=info.size, what=what,
                                  advice=disk_advice)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
        return path

    @contextlib.contextmanager
    def open_stream(self, key: str) -> Iterator[IO[bytes]]:
        """A streaming body for large objects (`.iter_lines()`, `.read(n)`); not checksum-verified."""
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=key)
        body = response["Body"]
        try:
            yield body
        finally:
            body.close()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes start..end inclusive."""
        with self._errors(key):
            response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            return response["Body"].read()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under `prefix`, across pages."""
        paginator = self.client.get_paginator("list_objects_v2")
        with self._errors(key=None):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        key=item["Key"], size=item["Size"], etag=item["ETag"].strip('"'),
                        last_modified=item.get("LastModified"),
                    )

    # ---- deletes and links ------------------------------------------------------------------

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete one object (an absent key is no error, as in S3). With `if_match`, only while the
        object is at that ETag: `PreconditionFailed` when it changed or is gone."""
        condition, extra = _precondition(if_match=if_match)
        self._may_write(key)
        with self._errors(key, condition=condition):
            self.client.delete_object(Bucket=self.bucket, Key=key, **extra)

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete in batches of 1,000; raise naming the keys the server refused."""
        batch: list[str] = []
        deleted = 0
        for key in keys:
            batch.append(key)
            if len(batch) == _DELETE_BATCH:
                deleted += self._delete_batch(batch)
                batch = []
        if batch:
            deleted += self._delete_batch(batch)
        return deleted

    def _delete_batch(self, keys: list[str]) -> int:
        for key in keys:
            self._may_write(key)
        with self._errors(key=None):
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
            )
        errors = response.get("Errors", [])
        if errors:
            listed = ", ".join(f"{e['Key']} ({e.get('Code')})" for e in errors[:5])
            raise StoreError(f"{len(errors)} of {len(keys)} deletes failed: {listed}")
        return len(keys)

    def presigned_url(self, key: str, *, expires_s: int = 3600) -> str:
        """A bearer link that embeds the access key id: never store one in a database (e.g. a Prefect artifact)."""
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
        )

    def incomplete_uploads(self, prefix: str = "") -> list[dict]:
        """Multipart uploads started under `prefix` and never completed nor aborted (their parts use
        space without being objects): [{"key", "upload_id", "initiated"}]."""
        found = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        with self._errors(key=None):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                found += [{"key": u["Key"], "upload_id": u["UploadId"], "initiated": u.get("Initiated")}
                          for u in page.get("Uploads", [])]
        return found

    def abort_incomplete_uploads(self, prefix: str = "") -> int:
        """Abort every incomplete multipart upload under `prefix` (call it when no upload of this
        prefix is in flight); how many were aborted."""
        uploads = self.incomplete_uploads(prefix)
        for upload in uploads:
            self._may_write(upload["key"])
            with self._errors(upload["key"]):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["key"],
                                                   UploadId=upload["upload_id"])
        return len(uploads)

    # ---- internals --------------------------------------------------------------------------

    def _may_write(self, key: str) -> dict[str, str]:
        """Ask the guard, if any; the metadata it stamps on the write."""
        if self._write_guard is None:
            return {}
        return dict(self._write_guard(key, in_flight_s=self._in_flight_s) or {})

    def _guard_attempt(self, request, **_) -> None:
        """botocore's before-send hook of a fenced view: a write's every HTTP attempt asks the guard."""
        if request.method in ("PUT", "POST", "DELETE"):
            path = urllib.parse.unquote(urllib.parse.urlsplit(request.url).path)
            self._may_write(path.lstrip("/").partition("/")[2])  # path-style: /bucket/key

    def _scratch(self) -> Path:
        scratch = self._scratch_dir or Path(tempfile.gettempdir())
        scratch.mkdir(parents=True, exist_ok=True)
        return scratch

    def _verify(self, key: str, expected: str | None, actual: str) -> None:
        if expected is not None and expected != actual:
            raise ChecksumMismatch(
                f"{self.uri(key)}: sha256 {actual} does not match the {expected} recorded at upload; "
                "the object is corrupt or was overwritten outside dflash"
            )

    @contextlib.contextmanager
    def _errors(self, key: str | None, *, condition: str | None = None) -> Iterator[None]:
        """Turn botocore errors into the `dflash_core.storage.errors` kinds, naming the key or the
        setting to fix; `condition`: the request's precondition, if any."""
        try:
            yield
        except BOTO_ERRORS as error:
            raise translate(error, bucket=self.bucket, endpoint_url=self.endpoint_url, key=key,
                            condition=condition) from error


def _precondition(*, if_absent: bool = False, if_match: str | None = None) -> tuple[str | None, dict]:
    """A conditional request's precondition: as text for its error, and as boto3 arguments."""
    if if_absent and if_match is not None:
        raise ValueError("if_absent and if_match exclude each other")
    if if_absent:
        return "If-None-Match: *", {"IfNoneMatch": "*"}
    if if_match is not None:
        return f"If-Match: {if_match}", {"IfMatch": f'"{if_match}"'}
    return None, {}


@contextlib.contextmanager
def _transfer_progress(label: str, size: int, enabled: bool | None):
    """A rich progress bar for large transfers; yields a boto3 transfer callback (or None)."""
    if enabled is False or (enabled is None and size < PROGRESS_THRESHOLD):
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), transient=True) as bar:
        task_id = bar.add_task(label, total=size)
        yield lambda sent: bar.advance(task_id, sent)

