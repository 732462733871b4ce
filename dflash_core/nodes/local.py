"""The local backend: this machine, through /bin/sh and the filesystem."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from dflash_core.nodes.access import CommandResult, CommandTimeout, NodeAccess


class LocalAccess(NodeAccess):
    def __init__(self, name: str | None = None):
        super().__init__(name or socket.gethostname())

    def _run(self, command: str, *, timeout_s: float) -> CommandResult:
        start = time.monotonic()
        # Own session, so a timeout kills the whole command (pipes and children), not just the shell.
        process = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, env=_node_env())
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.communicate()
            raise CommandTimeout(f"on {self.name}: `{command[:300]}` still ran after {timeout_s:.0f} s; killed") from None
        return CommandResult(command=command, returncode=process.returncode, stdout=stdout.decode(errors="replace"),
                             stderr=stderr.decode(errors="replace"), seconds=time.monotonic() - start)

    def put(self, local: Path, remote: str) -> None:
        _copy(Path(local), Path(self.path(remote)))

    def get(self, remote: str, local: Path) -> None:
        _copy(Path(self.path(remote)), Path(local))


def _node_env() -> dict[str, str]:
    """This process's environment minus what points Python at this process's packages: a command on the
    node must see the node's interpreters as a login shell would (as over SSH), not our PYTHONPATH or venv."""
    return {k: v for k, v in os.environ.items()
            if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONNOUSERSITE"}}


def _copy(source: Path, dest: Path) -> None:
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(source, dest)
