"""SeaweedFS's informational endpoints on the local object store: what answers an unauthenticated
request on 127.0.0.1 and what does not (#28.8).

Closed: the master UI and `/cluster/status`, the volume server's `/status` (data dir, disk usage)
and the admin server's `/metrics` and `/health` speak HTTPS that requires the work dir's client
certificate (plain HTTP gets 400, HTTPS without the certificate fails the handshake); with the
certificate they answer, so the certificate is what guards them. No other port listens (no debug,
metrics, WebDAV, Iceberg or Lance listener), the service home is the owner's only, the unix sockets
SeaweedFS puts under /tmp are connectable by their owner only, and signed S3 still works.

Known open (SeaweedFS offers no flag to close them): see KNOWN_OPEN. When a future SeaweedFS closes
one, its test fails: move the case to the closed ones.

Run: `.venv/bin/python -m pytest -q tests/integration/test_store_endpoints.py`
"""

from __future__ import annotations

import os
import ssl
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_core.services.local import grpc_certificates

# (port name, path) that used to answer anyone in plain HTTP: now HTTPS with client certificates.
CLOSED = [("master", "/"), ("master", "/ui/index.html"), ("master", "/cluster/status"), ("master", "/healthz"),
          ("volume", "/status"), ("volume", "/healthz"), ("volume", "/ui/index.html"),
          ("admin", "/metrics"), ("admin", "/health")]
# What each answers the certificate's holder: proof the endpoint is there and the certificate opens it.
WITH_CERTIFICATE = {("master", "/"): b"SeaweedFS", ("master", "/cluster/status"): b"Leader",
                    ("volume", "/status"): b"DiskStatuses", ("admin", "/metrics"): b"# HELP"}
# (port name, path, status, reason): still answering without credentials, with nothing in the body
# but the status. The S3 gateway registers its health checks ahead of request signing, and the
# filer's HTTP listener stays up (404 on every path) under -disableHttp; `weed mini` 4.48 has no
# flag for either, and HTTPS on them would break boto3 (S3) or gains nothing (the filer's 404s).
KNOWN_OPEN = [("s3", "/status", 200, "S3 health check, unconditional in SeaweedFS; empty body"),
              ("s3", "/healthz", 200, "S3 health check, unconditional in SeaweedFS; empty body"),
              ("filer", "/", 404, "filer HTTP listener stays open under -disableHttp; 404 everywhere")]


def _ports(settings) -> dict[str, int]:
    return {"s3": settings.s3_port, "filer": settings.s3_filer_port, "master": settings.s3_master_port,
            "volume": settings.s3_volume_port, "admin": settings.s3_admin_port}


def _get(url: str, context: ssl.SSLContext | None = None) -> tuple[int | str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        try:
            return error.code, error.read()
        except ConnectionError:  # Go's TLS server may reset right after its 400 to plain HTTP
            return error.code, b"(reset)"
    except (urllib.error.URLError, ConnectionError, ssl.SSLError) as error:
        return type(getattr(error, "reason", error)).__name__, b""


def _contexts(s3_server) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(trusts our CA but has no client certificate, holds the work dir's client certificate)."""
    ca, cert, key = grpc_certificates(s3_server.home / "tls")
    anonymous = ssl.create_default_context(cafile=str(ca))
    holder = ssl.create_default_context(cafile=str(ca))
    holder.load_cert_chain(str(cert), str(key))
    return anonymous, holder


@pytest.fixture(scope="module")
def admin_up(settings, s3_server):
    """The admin server starts a few seconds after S3 is ready: wait until it answers the holder."""
    _, holder = _contexts(s3_server)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _get(f"https://127.0.0.1:{settings.s3_admin_port}/health", holder)[0] == 200:
            return
        time.sleep(0.5)
    pytest.fail("the admin server never answered its /health with the client certificate")


@pytest.mark.parametrize(("port_name", "path"), CLOSED, ids=[f"{p}{q}" for p, q in CLOSED])
def test_endpoint_refuses_an_unauthenticated_request(settings, s3_server, admin_up, port_name, path) -> None:
    port = _ports(settings)[port_name]
    anonymous, holder = _contexts(s3_server)
    status, body = _get(f"http://127.0.0.1:{port}{path}")  # Go's TLS server answers plain HTTP with a 400
    assert status == 400 and (b"HTTPS" in body or body == b"(reset)"), (status, body[:200])
    status, body = _get(f"https://127.0.0.1:{port}{path}", anonymous)
    assert isinstance(status, str) and body == b"", f"answered without a client certificate: {status} {body[:200]}"
    if (port_name, path) in WITH_CERTIFICATE:
        status, body = _get(f"https://127.0.0.1:{port}{path}", holder)
        assert status == 200 and WITH_CERTIFICATE[(port_name, path)] in body, (status, body[:200])


@pytest.mark.parametrize(("port_name", "path", "status", "reason"), KNOWN_OPEN, ids=[f"{p}{q}" for p, q, *_ in KNOWN_OPEN])
def test_known_open_endpoint_still_answers_only_its_status(settings, s3_server, port_name, path, status,
                                                           reason) -> None:
    got, body = _get(f"http://127.0.0.1:{_ports(settings)[port_name]}{path}")
    assert got == status, (f"{port_name}{path} no longer answers {status} without credentials ({got}): SeaweedFS "
                           f"closed it; move it from KNOWN_OPEN ({reason}) to CLOSED")
    assert body.strip() in (b"", b"404 page not found"), body[:200]


def _listening_ports(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc: no `ss` needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((address if width == 32 else ".".join(str(int(address[i:i + 2], 16))
                                                               for i in (6, 4, 2, 0)), int(port, 16)))
    return found


def test_only_the_configured_ports_listen_on_loopback(settings, s3_server, admin_up) -> None:
    pid = s3_server.record().pid
    expected = {port + offset for port in _ports(settings).values() for offset in (0, 10000)}
    listening = _listening_ports(pid)
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening
    assert {port for _, port in listening} <= expected, f"unexpected listener(s): {listening}"


def test_files_and_sockets_are_the_owners_only(settings, s3_server) -> None:
    assert stat.S_IMODE(os.stat(s3_server.home).st_mode) == 0o700
    sockets = [path for port in _ports(settings).values() for offset in (0, 10000)
               for path in Path("/tmp").glob(f"seaweedfs-*-{port + offset}.sock")]
    assert sockets, "SeaweedFS made no unix socket under /tmp (the test's premise changed)"
    for path in sockets:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is connectable by others"


def test_signed_s3_still_works_and_wrong_keys_do_not(settings, store) -> None:
    big = os.urandom(9 * 1024 * 1024)  # three chunks: the filer writes each to the volume server over HTTPS
    store.put_bytes("scratch/endpoints/big.bin", big)
    assert store.get_bytes("scratch/endpoints/big.bin") == big
    from dflash_core.storage import ObjectStore

    wrong = ObjectStore.from_settings(settings.replace(s3_secret_access_key="not-the-secret-0123456789"))
    with pytest.raises(Exception, match="(?i)signature|access|denied|credentials"):
        wrong.get_bytes("scratch/endpoints/big.bin")
