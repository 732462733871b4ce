"""The SSH backend (paramiko): host keys checked against known_hosts, keys or an agent, never passwords.

Commands run under coreutils `timeout` on the node, so a command that outlives its deadline is killed
there too, not only abandoned here.
"""

from __future__ import annotations

import shlex
import socket
import stat
import time
from pathlib import Path, PurePosixPath

import paramiko

from dflash_core.storage.local_paths import path_inside
from dflash_core.nodes.access import CommandResult, CommandTimeout, HostKeyError, NodeAccess, NodeUnreachable

_TIMEOUT_EXIT = 124  # coreutils timeout's exit status when it killed the command
# sshd can send the exit status before the last of the command's output; the channel's EOF follows all of
# it. A command that leaves a background child holding its output never sends EOF: wait this long for it.
_EOF_AFTER_EXIT_S = 2.0


class SSHAccess(NodeAccess):
    def __init__(self, name: str, *, host: str, user: str | None, port: int = 22, key_path: Path | None = None,
                 known_hosts: Path | None = None, connect_timeout_s: float = 10.0):
        super().__init__(name)
        self.host, self.port = host, port
        known_hosts = Path(known_hosts or "~/.ssh/known_hosts").expanduser()
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(str(known_hosts))
        except FileNotFoundError:
            raise HostKeyError(f"node {name}: known_hosts file {known_hosts} does not exist; add {host}'s host key "
                               f"to it after checking it (`ssh-keyscan -p {port} {host}` shows the key)") from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        where = f"{user + '@' if user else ''}{host}:{port}"
        try:
            client.connect(host, port=port, username=user, key_filename=str(Path(key_path).expanduser()) if key_path
                           else None, allow_agent=True, look_for_keys=key_path is None, timeout=connect_timeout_s,
                           banner_timeout=connect_timeout_s, auth_timeout=connect_timeout_s, password=None)
        except paramiko.BadHostKeyException as error:
            raise HostKeyError(f"node {name}: the host key of {where} does not match {known_hosts} (got "
                               f"{error.key.get_name()} {error.key.get_fingerprint().hex()}): the host was "
                               "reinstalled, or someone is in the middle; check before replacing the entry") from None
        except paramiko.SSHException as error:
            if "not found in known_hosts" in str(error):
                raise HostKeyError(f"node {name}: {where} is not in {known_hosts}; refusing an unknown host key. "
                                   f"Check it and add it (`ssh-keyscan -p {port} {host} >> {known_hosts}`)") from None
            if isinstance(error, paramiko.AuthenticationException):
                raise NodeUnreachable(f"node {name}: {where} refused our key "
                                      f"({key_path or 'ssh agent / default keys'}): {error}") from None
            raise NodeUnreachable(f"node {name}: SSH to {where} failed: {error}") from None
        except (OSError, socket.timeout) as error:
            raise NodeUnreachable(f"node {name}: cannot connect to {where}: {error}") from None
        self._client = client
        self._sftp: paramiko.SFTPClient | None = None

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self._client.close()

    def _run(self, command: str, *, timeout_s: float) -> CommandResult:
        start = time.monotonic()
        wrapped = f"timeout -k 5 {max(1, int(timeout_s))} sh -c {shlex.quote(command)}"
        try:
            channel = self._client.get_transport().open_session(timeout=30)
        except (paramiko.SSHException, OSError, AttributeError) as error:
            raise NodeUnreachable(f"node {self.name}: the SSH session to {self.host} dropped: {error}") from None
        channel.exec_command(wrapped)
        channel.shutdown_write()
        stdout, stderr = bytearray(), bytearray()
        deadline = start + timeout_s + 10
        exited_at = None
        while True:
            while channel.recv_ready():
                stdout += channel.recv(65536)
            while channel.recv_stderr_ready():
                stderr += channel.recv_stderr(65536)
            if channel.exit_status_ready():
                exited_at = exited_at or time.monotonic()
                drained = not channel.recv_ready() and not channel.recv_stderr_ready()
                if drained and (channel.eof_received or time.monotonic() - exited_at > _EOF_AFTER_EXIT_S):
                    break
            if time.monotonic() > deadline:
                channel.close()
                raise CommandTimeout(f"on {self.name}: `{command[:300]}` still ran after {timeout_s:.0f} s")
            time.sleep(0.005)
        returncode = channel.recv_exit_status()
        channel.close()
        if returncode == _TIMEOUT_EXIT and time.monotonic() - start >= timeout_s:
            raise CommandTimeout(f"on {self.name}: `{command[:300]}` still ran after {timeout_s:.0f} s; killed")
        return CommandResult(command=command, returncode=returncode, stdout=stdout.decode(errors="replace"),
                             stderr=stderr.decode(errors="replace"), seconds=time.monotonic() - start)

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self._client.open_sftp()
        return self._sftp

    def put(self, local: Path, remote: str) -> None:
        local, remote = Path(local), self.path(remote)
        if not local.exists():
            raise FileNotFoundError(f"{local} does not exist")
        self.run(["mkdir", "-p", str(PurePosixPath(remote).parent)])
        if local.is_dir():
            self.run(["mkdir", "-p", remote])
            for item in sorted(local.rglob("*")):
                target = f"{remote}/{item.relative_to(local).as_posix()}"
                if item.is_dir():
                    if not _remote_exists(self.sftp, target):
                        self.sftp.mkdir(target)
                else:
                    self.sftp.put(str(item), target)
        else:
            self.sftp.put(str(local), remote)

    def get(self, remote: str, local: Path) -> None:
        remote, local = self.path(remote), Path(local)
        try:
            attrs = self.sftp.stat(remote)
        except FileNotFoundError:
            raise FileNotFoundError(f"{remote} does not exist on {self.name}") from None
        local.parent.mkdir(parents=True, exist_ok=True)
        if stat.S_ISDIR(attrs.st_mode):
            local.mkdir(exist_ok=True)
            self._get_folder(remote, local, relative="")
        else:
            self.sftp.get(remote, str(local))

    def _get_folder(self, remote: str, root: Path, *, relative: str) -> None:
        """The node's folder `remote` into `root / relative`; each name the node lists must stay inside `root`."""
        for entry in self.sftp.listdir_attr(remote):
            source, name = f"{remote}/{entry.filename}", f"{relative}{entry.filename}"
            local = path_inside(root, name)
            if stat.S_ISDIR(self.sftp.stat(source).st_mode):
                local.mkdir(exist_ok=True)
                self._get_folder(source, root, relative=f"{name}/")
            else:
                self.sftp.get(source, str(local))


def _remote_exists(sftp: paramiko.SFTPClient, path: str) -> bool:
    try:
        sftp.stat(path)
    except FileNotFoundError:
        return False
    return True
