"""Local services: idempotent start, status, stop only what was started, clear errors.

Run: `.venv/bin/python -m pytest tests/integration/test_services.py -q`
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from dflash_core.services import local
from dflash_core.services.process import ServiceError, start_detached, stop, wait_ready
from tests.conftest import free_port


@pytest.fixture
def fresh_settings(settings, tmp_path):
    """A second S3 server's settings: its own work dir and ports."""
    return settings.replace(
        work_dir=tmp_path, s3_endpoint_url=f"http://127.0.0.1:{free_port(grpc_offset=True)}",
        s3_master_port=free_port(grpc_offset=True), s3_volume_port=free_port(grpc_offset=True),
        s3_filer_port=free_port(grpc_offset=True), s3_admin_port=free_port(grpc_offset=True),
    )


def test_s3_service_is_idempotent_and_stops_only_itself(fresh_settings) -> None:
    service = local.s3_service(fresh_settings)
    first = local.start(service)
    try:
        assert first.running and first.healthy
        assert os.getpgid(first.pid) == first.pid != os.getpgid(0), "own session, survives our shell"
        second = local.start(local.s3_service(fresh_settings))
        assert second.pid == first.pid, "a healthy running service is left alone"
        assert "-ip.bind=127.0.0.1" in service.argv and "-master.telemetry=false" in service.argv
        bucket_store = local.s3_service(fresh_settings)
        assert local.status(bucket_store).healthy
    finally:
        assert local.shutdown(service) is True
    assert local.status(service).running is False
    assert local.shutdown(service) is False, "nothing left to stop"


def test_start_refuses_a_taken_port(fresh_settings) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", fresh_settings.s3_port))
        squatter.listen()
        with pytest.raises(ServiceError, match=rf"port\(s\) \[{fresh_settings.s3_port}\]"):
            local.start(local.s3_service(fresh_settings))


def test_a_dying_process_error_quotes_its_log(tmp_path) -> None:
    record = start_detached("crasher", [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
                            log_path=tmp_path / "log", record_path=tmp_path / "rec.json")
    with pytest.raises(ServiceError, match="boom: bad flag"):
        wait_ready(record, lambda: False, timeout_s=20)


def test_stop_kills_the_whole_process_group(tmp_path) -> None:
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    record = start_detached("parent", [sys.executable, "-c", script], log_path=tmp_path / "log",
                            record_path=tmp_path / "rec.json")
    wait_ready(record, lambda: len(_group_members(record.pid)) == 2, timeout_s=20)
    stop(record, timeout_s=5)
    assert _group_members(record.pid) == []


def _group_members(pgid: int) -> list[int]:
    """Live members of a process group (zombies left to a non-reaping PID 1 in containers don't count)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if line.split() and not line.split()[1].startswith("Z")]


def test_cli_status_lists_both_services(fresh_settings) -> None:
    env = {**os.environ, "DFLASH_WORK_DIR": str(fresh_settings.work_dir)}
    out = subprocess.run([sys.executable, "-m", "dflash_core.cli", "services", "status"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "s3" in out.stdout and "prefect" in out.stdout and "False" in out.stdout
