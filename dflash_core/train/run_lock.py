"""One training process per run directory: an exclusive `flock` on `<run_dir>/.lock`, held for the
process's life and released by the kernel when it dies (kill -9 included), so a stale lock cannot
outlive its run. The lock file names the holder (PID, host, start time) for the error a second run gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunLocked(RuntimeError):
    """Another live process holds this run's lock."""


class RunLock:
    def __init__(self, run_dir: Path, *, run_name: str | None = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.run_name = run_name or Path(run_dir).name
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise `RunLocked` naming the holder; never waits."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.holder() or {}
            raise RunLocked(
                f"run {self.run_name!r} is already running as PID {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')} (lock {self.path}): wait for it to finish, stop it, or choose another "
                "run_name") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
