"""The SSH backend against a real OpenSSH server on loopback (tests/sshd_fixture.py): commands with
timeouts, files both ways, detached processes that outlive the session, host keys never accepted blindly.

Run: `.venv/bin/python -m pytest tests/integration/test_nodes_ssh.py -q`
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from dflash_core.nodes import (
    CommandFailed, CommandTimeout, HostKeyError, NodeUnreachable, ProvisionConfig, provision,
)
from tests.sshd_fixture import Sshd, _keygen, start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


def _pids_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes() and b" Z " not in (proc / "stat").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def test_commands_files_and_timeouts(sshd: Sshd, tmp_path: Path) -> None:
    with sshd.node().connect() as node:
        result = node.run("echo out; echo err >&2; exit 0")
        assert (result.stdout, result.stderr, result.returncode) == ("out\n", "err\n", 0)
        assert node.run(["printf", "%s", "a b"]).stdout == "a b"  # argv is quoted for the remote shell
        with pytest.raises(CommandFailed, match="exited 3: nope"):
            node.run("echo nope >&2; exit 3")
        marker = f"dflash-timeout-{uuid.uuid4().hex[:8]}"
        start = time.monotonic()
        with pytest.raises(CommandTimeout, match="still ran after 1 s"):
            node.run(f"sleep 30 # {marker}", timeout_s=1)
        assert time.monotonic() - start < 15
        deadline = time.monotonic() + 10
        while _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _pids_with(marker) == [], "the timed-out command must be killed on the node, not just abandoned"

        source = tmp_path / "up"
        (source / "sub").mkdir(parents=True)
        (source / "a.txt").write_text("alpha")
        (source / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)
        remote = f"{sshd.home}/remote-{uuid.uuid4().hex[:6]}"
        node.put(source, remote)
        node.put(source / "a.txt", f"{remote}/single/a-copy.txt")
        assert node.read_text(f"{remote}/sub/b.bin", timeout_s=30) is not None
        back = tmp_path / "down"
        node.get(remote, back)
        assert (back / "a.txt").read_text() == "alpha"
        assert (back / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 100
        assert (back / "single" / "a-copy.txt").read_text() == "alpha"
        with pytest.raises(FileNotFoundError, match="does not exist on loopback"):
            node.get(f"{remote}/nothing-here", tmp_path / "x")


def test_every_byte_of_both_streams_arrives_even_when_the_exit_status_comes_first(sshd: Sshd) -> None:
    """sshd may send the exit status before the command's last output (CI once lost a one-line stderr):
    a run reads until the channel's EOF, which follows all of it."""
    with sshd.node().connect() as node:
        for index in range(30):
            result = node.run(f"echo out{index}; echo err{index} >&2")
            assert (result.stdout, result.stderr) == (f"out{index}\n", f"err{index}\n")


def test_a_background_child_holding_the_output_does_not_hold_the_run(sshd: Sshd) -> None:
    """Such a child keeps the channel from ever seeing EOF: the run still returns soon after the exit."""
    with sshd.node().connect() as node:
        started = time.monotonic()
        result = node.run("echo started; sleep 8 &", timeout_s=30)
        assert result.stdout == "started\n" and result.returncode == 0
        assert time.monotonic() - started < 6


def test_detached_process_outlives_the_session_and_only_ours_is_stopped(sshd: Sshd) -> None:
    node_def = sshd.node()
    records = f"{sshd.home}/pids-{uuid.uuid4().hex[:6]}"
    marker = f"dflash-detached-{uuid.uuid4().hex[:8]}"
    with node_def.connect() as node:
        record = node.start_detached("server", f"echo started; exec sleep 300 # {marker}",
                                     log_path=f"{sshd.home}/logs/server.log", record_dir=records)
    # The SSH session is closed: a process started plainly would have had SIGHUP.
    time.sleep(0.5)
    with node_def.connect() as node:
        assert node.is_running(record)
        assert [r.pid for r in node.recorded_processes(records)] == [record.pid]
        assert "started" in node.read_text(record.log_path)
        stale = record.model_copy(update={"start_ticks": record.start_ticks + 1})  # same PID, another process
        assert node.stop_detached(stale) == "not running"
        assert node.is_running(record)
        assert node.stop_detached(record, timeout_s=10) == "stopped"
        assert not node.is_running(record)
    assert _pids_with(marker) == []


def test_host_keys_are_verified_and_passwords_never_used(sshd: Sshd, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    with pytest.raises(HostKeyError, match=r"127.0.0.1:\d+ is not in .*refusing an unknown host key"):
        sshd.node(known_hosts=empty).connect()
    with pytest.raises(HostKeyError, match="does not exist"):
        sshd.node(known_hosts=tmp_path / "nope").connect()
    other = tmp_path / "other_host_key"
    _keygen(other)
    key_type, key = other.with_suffix(".pub").read_text().split()[:2]
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {key_type} {key}\n")
    with pytest.raises(HostKeyError, match="does not match"):
        sshd.node(known_hosts=wrong).connect()
    stranger = tmp_path / "stranger_key"
    _keygen(stranger)
    with pytest.raises(NodeUnreachable, match="refused our key"):
        sshd.node(key_path=stranger).connect()


@pytest.mark.slow  # a venv and pip over SSH
def test_provision_twice_and_preserve_over_ssh(sshd: Sshd, store, settings) -> None:
    from dflash_core.lineage import read_manifest
    from dflash_core.nodes import PROCESS_DIR, PreserveConfig, preserve, write_node_record

    name = f"ssh-{uuid.uuid4().hex[:8]}"
    node_def = sshd.node(name=name, work_dir=f"{sshd.home}/{name}")
    with node_def.connect() as node:
        first = provision(node, node_def, ProvisionConfig())
        second = provision(node, node_def, ProvisionConfig())
        write_node_record(node, node_def.work_dir, second)
        record = node.start_detached("server", "echo ready; exec sleep 300", log_path=f"{node_def.work_dir}/logs/s.log",
                                     record_dir=f"{node_def.work_dir}/{PROCESS_DIR}")
        result = preserve(node, node_def, store, settings.s3_prefixes, PreserveConfig(), timestamp="20261130T000000Z")
        assert not node.is_running(record)
    assert any(a.startswith("created venv") for a in first.actions) and second.actions == []
    assert second.venv.path == f"{node_def.work_dir}/venv"
    assert [(p.name, p.outcome) for p in result.stopped] == [("server", "stopped")]
    key = f"node-backups/{name}/20261130T000000Z/logs.tar.gz"
    assert read_manifest(store, key).bytes == len(store.get_bytes(key))
    assert {s.name for s in result.saved} >= {"logs.tar.gz", "records.tar.gz", "inventory.json", "pip-freeze.txt"}
