"""The object store against a real SeaweedFS S3 server.

Run: `.venv/bin/python -m pytest tests/integration/test_storage.py -q`
"""

from __future__ import annotations

import http.server
import io
import os
import threading
import time
import urllib.request

import pytest

from dflash_core.settings import Settings
from dflash_core.storage import (
    ChecksumMismatch, ObjectNotFound, ObjectStore, StoreConfigError, StoreUnavailable, sha256_bytes,
)


def test_bytes_round_trip_records_sha256(store: ObjectStore, prefix: str) -> None:
    payload = b"hello dflash\n" * 100
    info = store.put_bytes(f"{prefix}/a.txt", payload, metadata={"purpose": "test"})
    assert store.get_bytes(f"{prefix}/a.txt") == payload
    head = store.head(f"{prefix}/a.txt")
    assert head.size == len(payload) == info.size
    assert head.sha256 == sha256_bytes(payload)
    assert head.metadata["purpose"] == "test"
    assert store.get_range(f"{prefix}/a.txt", 0, 4) == b"hello"


def test_multipart_file_round_trip(store: ObjectStore, prefix: str, tmp_path) -> None:
    source = tmp_path / "big.bin"
    payload = os.urandom(20 * 1024**2 + 123)  # above the 16 MiB multipart threshold: 2 parts
    source.write_bytes(payload)
    info = store.put_file(f"{prefix}/big.bin", source)
    assert "-" in info.etag, "a multipart upload's ETag carries the part count"
    target = store.get_file(f"{prefix}/big.bin", tmp_path / "out" / "big.bin")
    assert target.read_bytes() == payload
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")], "no temp file left behind"


def test_stream_upload_and_streaming_read(store: ObjectStore, prefix: str) -> None:
    lines = [f"line {i}".encode() for i in range(1000)]
    store.put_stream(f"{prefix}/s.jsonl", io.BytesIO(b"\n".join(lines) + b"\n"))
    with store.open_stream(f"{prefix}/s.jsonl") as body:
        assert list(body.iter_lines()) == lines
    assert store.head(f"{prefix}/s.jsonl").sha256 == sha256_bytes(b"\n".join(lines) + b"\n")


def test_list_paginates_past_1000_and_batch_delete(store: ObjectStore, prefix: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    keys = [f"{prefix}/many/k-{i:05d}" for i in range(1105)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put_bytes(k, k.encode()), keys))
    listed = [info.key for info in store.list(f"{prefix}/many/")]
    assert sorted(listed) == keys
    assert store.delete_many(listed) == 1105
    assert list(store.list(f"{prefix}/many/")) == []


def test_missing_object_error_names_the_key(store: ObjectStore, prefix: str, tmp_path) -> None:
    key = f"{prefix}/nope.bin"
    for call in (lambda: store.get_bytes(key), lambda: store.head(key),
                 lambda: store.get_file(key, tmp_path / "x")):
        with pytest.raises(ObjectNotFound, match=key):
            call()
    assert not store.exists(key)


def test_checksum_mismatch_detected(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/tampered.txt"
    # Written outside our API with a wrong recorded hash: a read must refuse it.
    store.client.put_object(Bucket=store.bucket, Key=key, Body=b"actual", Metadata={"sha256": "0" * 64})
    with pytest.raises(ChecksumMismatch, match=key):
        store.get_bytes(key)
    assert store.get_bytes(key, verify=False) == b"actual"


def test_copy_and_presigned_url(store: ObjectStore, prefix: str) -> None:
    store.put_bytes(f"{prefix}/src", b"copy me")
    store.copy(f"{prefix}/src", f"{prefix}/dst")
    assert store.get_bytes(f"{prefix}/dst") == b"copy me"
    url = store.presigned_url(f"{prefix}/dst", expires_s=60)
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.read() == b"copy me"


def test_wrong_credentials_rejected(settings: Settings, s3_server) -> None:
    bad = ObjectStore.from_settings(settings.replace(s3_secret_access_key="wrong"))
    with pytest.raises(StoreConfigError, match="DFLASH_S3_SECRET_ACCESS_KEY"):
        bad.put_bytes("scratch/forbidden", b"x")


def test_missing_bucket_names_the_setting(settings: Settings, s3_server) -> None:
    missing = ObjectStore.from_settings(settings.replace(s3_bucket="no-such-bucket"))
    with pytest.raises(StoreConfigError, match="DFLASH_S3_BUCKET"):
        missing.check()
    # (SeaweedFS creates a bucket on first write, so flows call check() before writing anything.)


def test_unreachable_endpoint_fails_within_seconds_naming_the_url(settings: Settings) -> None:
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    dead = ObjectStore.from_settings(settings.replace(s3_endpoint_url=url))  # default attempts: check stays fast
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"cannot reach the S3 endpoint {url}.*DFLASH_S3_ENDPOINT_URL"):
        dead.check()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("status", [404, 200])
def test_an_endpoint_that_is_not_s3_is_named_as_such(settings: Settings, status: int) -> None:
    class NotS3(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>a web page</body></html>"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        other = ObjectStore.from_settings(settings.replace(s3_endpoint_url=url))
        started = time.monotonic()
        with pytest.raises(StoreConfigError, match=f"{url} is not an S3 server.*DFLASH_S3_ENDPOINT_URL"):
            other.check()
        assert time.monotonic() - started < 5
    finally:
        server.shutdown()


def test_configuration_errors_are_not_retried_by_check_store(settings: Settings, s3_server, prefect_server) -> None:
    from prefect import flow

    from tasks.store import check_store

    @flow
    def check(s: Settings) -> str:
        return check_store(s)

    for bad in (settings.replace(s3_secret_access_key="wrong"), settings.replace(s3_bucket="no-such-bucket")):
        started = time.monotonic()
        state = check(bad, return_state=True)
        assert state.is_failed()
        with pytest.raises(StoreConfigError):
            state.result()
        assert time.monotonic() - started < 5, "a 403 or a missing bucket was retried"
    from tests.conftest import free_port

    started = time.monotonic()  # unreachable: transient, so retried once, and still over within seconds
    state = check(settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}"), return_state=True)
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        state.result()
    assert time.monotonic() - started < 10


def test_incomplete_multipart_uploads_are_listed_and_aborted(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/half.bin"
    upload = store.client.create_multipart_upload(Bucket=store.bucket, Key=key)
    store.client.upload_part(Bucket=store.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                             Body=b"x" * 1024)
    assert [u["key"] for u in store.incomplete_uploads(prefix + "/")] == [key]
    assert store.abort_incomplete_uploads(prefix + "/") == 1
    assert store.incomplete_uploads(prefix + "/") == [] and not store.exists(key)
