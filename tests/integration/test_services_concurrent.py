"""Two `dflash services up` started at once from a stopped state (#28.9): both succeed (the second
says it waits for the first's start), exactly one set of servers runs (one SeaweedFS, one Prefect
server, one stage server, the ones recorded), and `dflash services down` stops every one of them.

Real commands in subprocesses against a fresh work dir on free ports. ~1-3 min on a busy 2-core
machine (the stage server imports every flow).

Run: `.venv/bin/python -m pytest -q tests/integration/test_services_concurrent.py`
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_core.services import local
from dflash_core.services.stages import settings_env, stage_service
from tests.conftest import free_port

UP_TIMEOUT_S = 480

pytestmark = pytest.mark.slow


def _ours(work_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process whose environment names this work dir (the services
    and anything they started; the CLI processes have exited by the time this is asked)."""
    marker = f"DFLASH_WORK_DIR={work_dir}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if ") Z " in (entry / "stat").read_text():
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def _session_leaders(pids) -> set[int]:
    leaders = set()
    for pid in pids:
        try:
            if os.getsid(pid) == pid:
                leaders.add(pid)
        except ProcessLookupError:
            pass
    return leaders


def test_two_services_up_at_once_start_one_set_and_down_stops_it(settings, tmp_path) -> None:
    fresh = settings.replace(
        work_dir=tmp_path / "work", s3_endpoint_url=f"http://127.0.0.1:{free_port(grpc_offset=True)}",
        s3_master_port=free_port(grpc_offset=True), s3_volume_port=free_port(grpc_offset=True),
        s3_filer_port=free_port(grpc_offset=True), s3_admin_port=free_port(grpc_offset=True),
        prefect_api_url=f"http://127.0.0.1:{free_port()}/api",
    )
    work_dir = fresh.work_path()
    env = {**os.environ, **settings_env(fresh), "COLUMNS": "200"}
    cli = [sys.executable, "-m", "dflash_core.cli", "services"]
    try:
        ups = [subprocess.Popen([*cli, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
        outputs = [up.communicate(timeout=UP_TIMEOUT_S)[0] for up in ups]
        for up, output in zip(ups, outputs):
            assert up.returncode == 0, output
        both = "\n".join(outputs)
        assert "is starting it; waiting until that start finishes" in both, both
        services = [*local.all_services(fresh), stage_service(fresh)]
        recorded = {service.name: service.record().pid for service in services}
        for service in services:
            assert local.status(service).healthy, (service.name, both)
        for output in outputs:  # both report the same, recorded processes
            for name, pid in recorded.items():
                assert f"{name} running (pid {pid})" in output, (name, pid, output)
        leaders = _session_leaders(_ours(work_dir))
        assert leaders == set(recorded.values()), (recorded, _ours(work_dir))
        weeds = [cmd for cmd in _ours(work_dir).values() if " mini " in cmd]
        assert len(weeds) == 1, weeds

        down = subprocess.run([*cli, "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        for name in recorded:
            assert f"{name}: stopped" in down.stdout, down.stdout
        deadline = time.monotonic() + 30
        while _ours(work_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ours(work_dir), f"left running after `services down`: {_ours(work_dir)}"
    finally:
        for pid in _session_leaders(_ours(work_dir)):  # only what this test's commands started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
