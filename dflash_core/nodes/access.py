"""One way to reach a node: run a command with a timeout, start a detached process, copy files.

`NodeAccess` is the interface; `LocalAccess` (this machine) and `SSHAccess` (paramiko) implement the
three primitives (`_run`, `put`, `get`). Everything else, detached processes included, is built here
from shell commands, so both backends behave the same way.
"""

from __future__ import annotations

import json
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel


class NodeError(RuntimeError):
    """Base of every node error; the message names the node and what to do."""


class NodeUnreachable(NodeError):
    """The node did not answer (network, sshd down): transient, worth a retry."""


class HostKeyError(NodeError):
    """The node's host key is unknown or changed: never accepted silently, never retried."""


class CommandFailed(NodeError):
    def __init__(self, message: str, result: CommandResult):
        super().__init__(message)
        self.result = result


class CommandTimeout(NodeError):
    pass


@dataclass(frozen=True)
class CommandResult:
    command: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class DetachedProcess(BaseModel):
    """A process we started on a node, recorded so that only ours are ever stopped."""

    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells our process from a later one with a reused PID
    command: str
    log_path: str
    record_path: str
    started_at: float


class NodeAccess(ABC):
    """A node reached through some backend. Use as a context manager."""

    def __init__(self, name: str):
        self.name = name
        self._home: str | None = None

    # ---- the three primitives a backend provides ---------------------------------------------

    @abstractmethod
    def _run(self, command: str, *, timeout_s: float) -> CommandResult:
        """Run `command` with /bin/sh on the node; kill it after `timeout_s` (raise CommandTimeout)."""

    @abstractmethod
    def put(self, local: Path, remote: str) -> None:
        """Copy a local file or directory to `remote` on the node (parents created)."""

    @abstractmethod
    def get(self, remote: str, local: Path) -> None:
        """Copy a file or directory on the node to `local` here (parents created)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> NodeAccess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- built on them ------------------------------------------------------------------------

    def run(self, command: str | Sequence[str], *, timeout_s: float = 120.0, check: bool = True) -> CommandResult:
        """Run a shell command (a string) or an argv (quoted for the shell); raise on non-zero exit if `check`."""
        text = command if isinstance(command, str) else shlex.join(command)
        result = self._run(text, timeout_s=timeout_s)
        if check and result.returncode != 0:
            detail = (result.stderr.strip() or result.stdout.strip())[-1500:]
            raise CommandFailed(f"on {self.name}: `{_short(text)}` exited {result.returncode}: {detail}", result)
        return result

    def path(self, path: str) -> str:
        """`~/x` -> the node's home + /x (SFTP and our quoting do not expand `~`)."""
        if path == "~" or path.startswith("~/"):
            if self._home is None:
                self._home = self.run('printf %s "$HOME"', timeout_s=30).stdout
            return self._home + path[1:]
        return path

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", self.path(path)], check=False, timeout_s=30).returncode == 0

    def read_text(self, path: str, *, timeout_s: float = 60) -> str:
        return self.run(["cat", self.path(path)], timeout_s=timeout_s).stdout

    def write_text(self, path: str, text: str) -> None:
        """Write atomically (temp file + rename) on the node."""
        target = self.path(path)
        tmp = f"{target}.tmp-{time.time_ns()}"
        self.run(f"mkdir -p {shlex.quote(str(Path(target).parent))} && printf '%s' {shlex.quote(text)} > "
                 f"{shlex.quote(tmp)} && mv {shlex.quote(tmp)} {shlex.quote(target)}", timeout_s=60)

    def start_detached(self, name: str, command: str, *, log_path: str, record_dir: str, cwd: str | None = None,
                       env: Mapping[str, str] | None = None) -> DetachedProcess:
        """Start `command` in its own session (setsid + nohup: it survives this connection), output appended
        to `log_path`; record its PID in `<record_dir>/<name>.json` on the node."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"process name {name!r} must be a plain file name")
        log_path, record_dir = self.path(log_path), self.path(record_dir)
        record_path = f"{record_dir}/{name}.json"
        pid_file = f"{record_dir}/.{name}.pid"
        exports = "".join(f"export {key}={shlex.quote(value)}; " for key, value in (env or {}).items())
        inner = (f"echo $$ > {shlex.quote(pid_file)}; {exports}"
                 f"{'cd ' + shlex.quote(self.path(cwd)) + ' && ' if cwd else ''}exec sh -c {shlex.quote(command)}")
        script = (
            f"mkdir -p {shlex.quote(record_dir)} {shlex.quote(str(Path(log_path).parent))} && "
            f"rm -f {shlex.quote(pid_file)} && "
            f"nohup setsid sh -c {shlex.quote(inner)} >> {shlex.quote(log_path)} 2>&1 < /dev/null & "
            f"i=0; while [ ! -s {shlex.quote(pid_file)} ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done; "
            f"pid=$(cat {shlex.quote(pid_file)}) && rm -f {shlex.quote(pid_file)} && echo $pid && "
            f"cat /proc/$pid/stat"
        )
        out = self.run(script, timeout_s=30).stdout.splitlines()
        if len(out) < 2:
            raise NodeError(f"on {self.name}: {name} did not start (log {log_path})")
        record = DetachedProcess(name=name, pid=int(out[0]), start_ticks=_start_ticks(out[1]), command=command,
                                 log_path=log_path, record_path=record_path, started_at=time.time())
        self.write_text(record_path, record.model_dump_json(indent=2))
        return record

    def is_running(self, record: DetachedProcess) -> bool:
        """True while the recorded PID runs and is the very process we started (same start time, not a zombie)."""
        stat = self.run(f"cat /proc/{record.pid}/stat 2>/dev/null", check=False, timeout_s=30).stdout
        if not stat.strip():
            return False
        state = stat.rsplit(")", 1)[1].split()[0]
        return state != "Z" and _start_ticks(stat) == record.start_ticks

    def stop_detached(self, record: DetachedProcess, *, timeout_s: float = 15.0) -> str:
        """SIGTERM our process group, SIGKILL after `timeout_s`. Returns what happened:
        'stopped', 'killed' or 'not running' (exited already, or the PID now belongs to someone else)."""
        if not self.is_running(record):
            return "not running"
        pid = record.pid
        alive = (f"st=$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f1); "
                 f'[ -n "$st" ] && [ "$st" != Z ]')
        polls = max(1, int(timeout_s / 0.2))
        script = (
            f"kill -TERM -- -{pid} 2>/dev/null || kill -TERM {pid} 2>/dev/null; i=0; "
            f"while {alive} && [ $i -lt {polls} ]; do sleep 0.2; i=$((i+1)); done; "
            f"if {alive}; then kill -KILL -- -{pid} 2>/dev/null || kill -KILL {pid}; echo killed; else echo stopped; fi"
        )
        return self.run(script, timeout_s=timeout_s + 30).stdout.strip() or "stopped"

    def recorded_processes(self, record_dir: str) -> list[DetachedProcess]:
        """The process records in `record_dir` on the node (unreadable ones are reported, not skipped)."""
        listing = self.run(f"for f in {shlex.quote(self.path(record_dir))}/*.json; do [ -f \"$f\" ] && "
                           "{ echo \"==> $f\"; cat \"$f\"; echo; }; done; true", timeout_s=60).stdout
        records = []
        for chunk in listing.split("==> ")[1:]:
            path, _, body = chunk.partition("\n")
            try:
                records.append(DetachedProcess.model_validate(json.loads(body)))
            except ValueError as error:
                raise NodeError(f"on {self.name}: process record {path} is not valid: {error}") from error
        return records


def _start_ticks(stat: str) -> int:
    # Fields after the command name (which may hold spaces and parentheses) start at field 3.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _short(command: str, limit: int = 300) -> str:
    return command if len(command) <= limit else command[:limit] + " ..."
