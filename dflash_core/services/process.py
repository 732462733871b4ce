"""Detached, recorded processes: started in their own session (setsid) so they outlive the shell
that launched them, logged to a file, stopped by their recorded process group.

Used by the local services here and by the inference-server launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_core.redaction import redact_argv


class ServiceError(RuntimeError):
    """A managed process failed to start or to become ready; the message quotes its log."""


@dataclass
class ProcessRecord:
    name: str
    pid: int
    argv: list[str]
    log_path: str
    started_at: float

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ProcessRecord | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None


def start_detached(name: str, argv: Sequence[str], *, log_path: Path, record_path: Path,
                   env: Mapping[str, str] | None = None, cwd: Path | None = None,
                   umask: int = -1) -> ProcessRecord:
    """Start `argv` in a new session with stdout+stderr appended to `log_path`; record its PID.
    `umask` (e.g. 0o077) applies to the process; -1 keeps ours."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True, umask=umask,
        )
    record = ProcessRecord(name=name, pid=process.pid, argv=redact_argv(list(argv)), log_path=str(log_path),
                           started_at=time.time())
    record.save(record_path)
    return record


def is_alive(record: ProcessRecord | None) -> bool:
    """True when the recorded PID runs and is still the program we started (not a reused PID)."""
    if record is None:
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{record.pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): trust the PID
    if ") Z " in stat:  # zombie: exited, not yet reaped
        return False
    # A console script runs as `python /path/script ...`: accept the program in either of the first two slots.
    if cmdline == [b""]:
        return True  # mid-exec: the kernel shows no command line yet
    program = Path(record.argv[0]).name
    return any(Path(part.decode(errors="replace")).name == program for part in cmdline[:2])


def stop(record: ProcessRecord, *, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL after `timeout_s`."""
    if not is_alive(record):
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(record.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(record.pid)
            if not is_alive(record):
                _reap(record.pid)
                return
            time.sleep(0.1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def log_tail(path: str | Path, *, lines: int = 30) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(record: ProcessRecord, probe: Callable[[], bool], *, timeout_s: float,
               interval_s: float = 0.25) -> float:
    """Poll `probe` until it returns True; return seconds waited. Raise quoting the log when the
    process dies or the deadline passes."""
    start = time.monotonic()
    while True:
        _reap(record.pid)
        if not is_alive(record):
            raise ServiceError(
                f"{record.name} exited before it was ready (log {record.log_path}):\n{log_tail(record.log_path)}"
            )
        try:
            if probe():
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - any probe failure means "not ready yet"
            pass
        if time.monotonic() - start > timeout_s:
            raise ServiceError(
                f"{record.name} was not ready after {timeout_s:.0f} s (log {record.log_path}):\n"
                f"{log_tail(record.log_path)}"
            )
        time.sleep(interval_s)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
