"""The embedded default's services: SeaweedFS (`weed mini`) as the S3 server and a Prefect server.

Both bind 127.0.0.1, keep data, logs and PID records under `<work_dir>/services/<name>/`, and are
idempotent: `up` leaves a healthy running service alone, `down` stops only what `up` recorded.

SeaweedFS serves data only through its S3 port, which requires signed requests. Its other ports
refuse anyone else on the host: the master and filer serve no HTTP API (`-disableHttp`), the volume
server reads and writes only with a JWT that the master and filer sign with keys drawn at each start
(kept in the process's environment only), every gRPC port requires a client certificate from a
CA made for this work dir (`services/s3/tls/`, private key readable by its owner only), and the
master, volume and admin HTTP ports speak HTTPS that requires the same client certificate: the
master UI, `/cluster/status`, the volume's `/status` (data dir, disk usage) and the admin's
`/metrics` answer nobody without it. Each service's home (`<work_dir>/services/<name>/`) is readable
by its owner only, and the services run with umask 077 (SeaweedFS's volume files and its unix
sockets under /tmp are not readable or connectable by others). What stays open, and why:
docs/troubleshooting.md ("What the local S3 server leaves open").
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.services.process import (
    ProcessRecord, ServiceError, is_alive, port_is_free, start_detached, stop, wait_ready,
)
from dflash_core.settings import Settings

S3_READY_TIMEOUT_S = 60.0
PREFECT_READY_TIMEOUT_S = 120.0  # generous: a fresh SQLite DB on a busy 2-core machine starts slowly


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    ports: list[int]
    probe: Callable[[], bool]
    ready_timeout_s: float
    home: Path
    after_ready: Callable[[], None] | None = None
    url: str = ""
    _record: ProcessRecord | None = field(default=None, repr=False)

    @property
    def record_path(self) -> Path:
        return self.home / "process.json"

    @property
    def log_path(self) -> Path:
        return self.home / "service.log"

    def record(self) -> ProcessRecord | None:
        return ProcessRecord.load(self.record_path)


@dataclass
class ServiceStatus:
    name: str
    running: bool
    healthy: bool
    pid: int | None
    url: str
    log_path: str


def _venv_binary(name: str) -> str:
    """A console script of this environment (beside sys.executable) or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServiceError(f"`{name}` is not installed: run `bash infra/setup.sh` to install the project")
    return found


def s3_service(settings: Settings) -> LocalService:
    home = settings.work_path("services", "s3")
    data = home / "data"
    ports = [settings.s3_master_port, settings.s3_volume_port, settings.s3_filer_port,
             settings.s3_port, settings.s3_admin_port]
    # What `weed mini` 4.48 lets a flag close is closed here: the admin UI (-admin.ui=false; its
    # /health and /metrics stay, so HTTPS with client certificates guards that port, see
    # seaweed_security_env), WebDAV, the Iceberg and Lance ports, telemetry, the master's and filer's
    # HTTP API (-disableHttp; the master UI and /cluster/status stay: HTTPS guards them). No -debug
    # (pprof port) and no -metricsPort / -s3.metricsPort (0: no Prometheus listener). There is no
    # flag to drop the admin server, the master UI or the volume's /status: the certificates do.
    argv = [
        _venv_binary("weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}",
        f"-s3.port={ports[3]}", f"-admin.port={ports[4]}", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", "-disableHttp",
    ]
    env = {
        # Credentials in the environment turn SeaweedFS's S3 auth on: wrong keys are refused.
        "AWS_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
        "AWS_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value(),
        "GOMEMLIMIT": "256MiB",
        **seaweed_security_env(home / "tls"),
    }

    def store():
        from dflash_core.storage import ObjectStore

        return ObjectStore.from_settings(settings)

    def probe() -> bool:
        store().client.list_buckets()
        return True

    def create_bucket() -> None:
        store().check(create_bucket=True)

    return LocalService(
        name="s3", argv=argv, env=env, ports=ports, probe=probe, ready_timeout_s=S3_READY_TIMEOUT_S,
        home=home, after_ready=create_bucket, url=settings.s3_endpoint_url,
    )


# security.toml settings as WEED_* variables (SeaweedFS reads them as the file's keys).
_JWT_KEYS = ("WEED_JWT_SIGNING_KEY", "WEED_JWT_SIGNING_READ_KEY",  # master <-> volume, writes / reads
             "WEED_JWT_FILER_SIGNING_KEY", "WEED_JWT_FILER_SIGNING_READ_KEY")  # s3 <-> filer
_GRPC_COMPONENTS = ("MASTER", "VOLUME", "FILER", "S3", "ADMIN", "WORKER", "MSG_BROKER", "MSG_AGENT", "MQ", "CLIENT")
# HTTP ports that answer without credentials in plain HTTP: the master (UI, /cluster/status, /healthz),
# the volume server (/status: data dir and disk usage, /healthz) and the admin server (/metrics,
# /health). As [https.<component>] with a CA they require a client certificate, and [https.client]
# makes SeaweedFS's own requests (filer and S3 to the volume server) present ours. The filer's HTTP
# port serves nothing (-disableHttp); the S3 port stays plain HTTP with signed requests.
_HTTPS_COMPONENTS = ("MASTER", "VOLUME", "ADMIN")


def seaweed_security_env(tls_dir: Path) -> dict[str, str]:
    """JWT signing keys (new at each start), gRPC mutual TLS for every SeaweedFS component, and
    HTTPS with client certificates on the master, volume and admin HTTP ports."""
    ca, cert, key = grpc_certificates(tls_dir)
    env = {name: secrets.token_urlsafe(32) for name in _JWT_KEYS}
    env["WEED_FILER_EXPOSE_DIRECTORY_METADATA_ENABLED"] = "false"
    env["WEED_ACCESS_UI"] = "false"
    env["WEED_GRPC_CA"] = str(ca)
    for component in _GRPC_COMPONENTS:
        env[f"WEED_GRPC_{component}_CERT"] = str(cert)
        env[f"WEED_GRPC_{component}_KEY"] = str(key)
    for component in _HTTPS_COMPONENTS:
        env.update({f"WEED_HTTPS_{component}_CERT": str(cert), f"WEED_HTTPS_{component}_KEY": str(key),
                    f"WEED_HTTPS_{component}_CA": str(ca)})
    env.update({"WEED_HTTPS_CLIENT_ENABLED": "true", "WEED_HTTPS_CLIENT_CERT": str(cert),
                "WEED_HTTPS_CLIENT_KEY": str(key), "WEED_HTTPS_CLIENT_CA": str(ca)})
    return env


def grpc_certificates(tls_dir: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, node certificate, node key) for loopback mTLS, made once per work dir. The CA's
    key is not kept: nothing else can be signed by it."""
    ca_path, cert_path, key_path = tls_dir / "ca.crt", tls_dir / "node.crt", tls_dir / "node.key"
    if ca_path.is_file() and cert_path.is_file() and key_path.is_file():
        return ca_path, cert_path, key_path
    import datetime
    import ipaddress
    import os

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, node_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dflash local SeaweedFS CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    node_cert = (x509.CertificateBuilder()
                 .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dflash-seaweedfs")]))
                 .issuer_name(ca_name).public_key(node_key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=3650))
                 .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                             x509.DNSName("localhost")]), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                       ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                 .sign(ca_key, hashes.SHA256()))
    tls_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tls_dir, 0o700)
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(node_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    cert_path.write_bytes(node_cert.public_bytes(serialization.Encoding.PEM))
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return ca_path, cert_path, key_path


def prefect_client_env(settings: Settings) -> dict[str, str]:
    """Environment for any process that talks to our Prefect server (flows, workers, the server)."""
    return {
        "PREFECT_API_URL": settings.prefect_api_url,
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(settings.work_path("services", "prefect", "home")),
    }


def prefect_service(settings: Settings) -> LocalService:
    home = settings.work_path("services", "prefect")
    port = settings.prefect_port
    env = prefect_client_env(settings)
    argv = [_venv_binary("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    health = settings.prefect_api_url + "/health"

    def probe() -> bool:
        with urllib.request.urlopen(health, timeout=2) as response:
            return response.status == 200

    return LocalService(
        name="prefect", argv=argv, env=env, ports=[port], probe=probe,
        ready_timeout_s=PREFECT_READY_TIMEOUT_S, home=home, url=settings.prefect_api_url.removesuffix("/api"),
    )


def all_services(settings: Settings) -> list[LocalService]:
    return [s3_service(settings), prefect_service(settings)]


def _healthy(service: LocalService) -> bool:
    try:
        return bool(service.probe())
    except Exception:  # noqa: BLE001 - unreachable means unhealthy
        return False


def start(service: LocalService, *, on_wait: Callable[[str], None] | None = None) -> ServiceStatus:
    """Start `service` unless our recorded process already runs healthy; wait until it is ready.

    One start at a time per service home: a second caller (another `dflash services up`) waits on
    `<home>/start.lock` (calling `on_wait` with a line saying who holds it), then finds the service
    running and leaves it alone. The lock is an flock: it goes with the process that holds it."""
    with _start_lock(service, on_wait=on_wait):
        record = service.record()
        if is_alive(record):
            wait_ready(record, service.probe, timeout_s=service.ready_timeout_s)
        else:
            busy = [port for port in service.ports if not port_is_free(port)]
            if busy:
                raise ServiceError(
                    f"cannot start {service.name}: port(s) {busy} on 127.0.0.1 are taken by another process; "
                    f"stop it or choose other ports (DFLASH_* port settings)"
                )
            record = start_detached(service.name, service.argv, log_path=service.log_path,
                                    record_path=service.record_path, env=service.env, cwd=service.home,
                                    umask=0o077)
            try:
                wait_ready(record, service.probe, timeout_s=service.ready_timeout_s)
            except ServiceError:
                stop(record)
                raise
        if service.after_ready is not None:
            service.after_ready()
    return status(service)


START_LOCK_MARGIN_S = 60.0  # beyond the holder's ready timeout: its after_ready step and a slow exit


@contextmanager
def _start_lock(service: LocalService, *, on_wait: Callable[[str], None] | None):
    """Hold `<home>/start.lock` (flock) for one start; wait for another holder up to its ready timeout."""
    service.home.mkdir(parents=True, exist_ok=True)
    os.chmod(service.home, 0o700)  # logs, data, keys and records: the owner's only
    with open(service.home / "start.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = f"another `dflash services up` ({handle.read().strip() or 'pid unknown'})"
            if on_wait is not None:
                on_wait(f"{service.name}: {holder} is starting it; waiting until that start finishes")
            deadline = time.monotonic() + service.ready_timeout_s + START_LOCK_MARGIN_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ServiceError(
                            f"cannot start {service.name}: {holder} has been starting it for longer than "
                            f"{service.ready_timeout_s + START_LOCK_MARGIN_S:.0f} s (lock {handle.name}); "
                            f"see {service.log_path}") from None
                    time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}")
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shutdown(service: LocalService) -> bool:
    """Stop the process `start` recorded; True when something was stopped."""
    record = service.record()
    if not is_alive(record):
        service.record_path.unlink(missing_ok=True)
        return False
    stop(record)
    service.record_path.unlink(missing_ok=True)
    return True


def status(service: LocalService) -> ServiceStatus:
    record = service.record()
    running = is_alive(record)
    return ServiceStatus(
        name=service.name, running=running, healthy=running and _healthy(service),
        pid=record.pid if running and record else None, url=service.url, log_path=str(service.log_path),
    )
