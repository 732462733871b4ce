"""The local object store serves data only through signed S3 requests: an unsigned read and write on
every port of the session's SeaweedFS (S3, filer, master, volume, admin) fail, with plain HTTP on
127.0.0.1, and the gRPC ports refuse a client without the work dir's certificate.

Run: `.venv/bin/python -m pytest -q tests/integration/test_store_ports.py`
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from dflash_core.services.local import _venv_binary, grpc_certificates

SECRET = b"only-for-signed-readers-" * 8


def _http(method: str, url: str, data: bytes | None = None) -> tuple[int | str, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        try:
            return error.code, error.read()
        except ConnectionError:  # an HTTPS port answers plain HTTP with 400 and may reset before the body
            return error.code, b""
    except (urllib.error.URLError, ConnectionError) as error:
        return type(error).__name__, b""


@pytest.fixture(scope="module")
def stored(store):
    key = "scratch/ports/secret.bin"
    store.put_bytes(key, SECRET)
    return key


def _ports(settings) -> dict[str, int]:
    return {"s3": settings.s3_port, "filer": settings.s3_filer_port, "master": settings.s3_master_port,
            "volume": settings.s3_volume_port, "admin": settings.s3_admin_port}


def _fid(settings, s3_server, key: str) -> str:
    """The volume file id of the object's first chunk, asked as an admin holding the gRPC certificate."""
    ca, cert, private = grpc_certificates(s3_server.home / "tls")
    env = {**os.environ, "WEED_GRPC_CA": str(ca), "WEED_GRPC_CLIENT_CERT": str(cert), "WEED_GRPC_CLIENT_KEY": str(private)}
    out = subprocess.run([_venv_binary("weed"), "shell", f"-master=127.0.0.1:{settings.s3_master_port}",
                          f"-filer=127.0.0.1:{settings.s3_filer_port}"],
                         input=f"fs.meta.cat /buckets/{settings.s3_bucket}/{key}\n", capture_output=True, text=True,
                         timeout=60, env=env, cwd=s3_server.home)
    meta = json.loads(out.stdout[out.stdout.index("{"):out.stdout.rindex("}") + 1])
    return meta["chunks"][0]["fileId"]


def test_signed_s3_reads_back(store, stored) -> None:
    assert store.get_bytes(stored) == SECRET


@pytest.mark.parametrize("port_name", ["s3", "filer", "master", "volume", "admin"])
def test_unsigned_read_and_write_fail_on_every_port(settings, s3_server, store, stored, port_name) -> None:
    port = _ports(settings)[port_name]
    base = f"http://127.0.0.1:{port}"
    reads = [f"/{settings.s3_bucket}/{stored}", f"/buckets/{settings.s3_bucket}/{stored}",
             f"/buckets/{settings.s3_bucket}/scratch/ports/", "/dir/lookup?volumeId=1", "/dir/assign"]
    if port_name == "volume":
        reads.append("/" + _fid(settings, s3_server, stored))  # the object's real chunk
    for path in reads:
        status, body = _http("GET", base + path)
        assert status not in range(200, 400), (port_name, path, status, body[:200])
        assert SECRET[:24] not in body
    writes = [("PUT", f"/{settings.s3_bucket}/scratch/ports/evil.bin"),
              ("PUT", f"/buckets/{settings.s3_bucket}/scratch/ports/evil.bin"),
              ("POST", "/submit"), ("POST", "/1,0123456789")]
    for method, path in writes:
        status, body = _http(method, base + path, b"evil")
        assert status not in range(200, 400), (port_name, method, path, status, body[:200])
    assert not store.exists("scratch/ports/evil.bin")
    assert store.get_bytes(stored) == SECRET


@pytest.mark.parametrize("port_name", ["filer", "master", "volume", "s3"])
def test_grpc_ports_require_a_client_certificate(settings, s3_server, port_name) -> None:
    port = _ports(settings)[port_name] + 10000
    ca, _, _ = grpc_certificates(s3_server.home / "tls")
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls.recv(1024):  # TLS 1.3: the refusal arrives with the first read
                    raise ConnectionError("closed")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:  # plaintext h2c: no gRPC answer
        plain.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        try:
            answer = plain.recv(1024)
        except ConnectionError:
            answer = b""
        assert not answer.startswith(b"\x00\x00"), "a plaintext HTTP/2 SETTINGS frame came back"
