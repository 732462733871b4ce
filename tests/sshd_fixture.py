"""A real OpenSSH server on loopback for the SSH backend's tests: a free port, a throwaway host key and
user key, key-only auth, the caller's own user. Skips, saying why, where Debian's openssh-server is not
installed (`infra/setup.sh` installs it when it runs as root on Debian, as CI does).
"""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_core.nodes import Node
from tests.conftest import free_port

SSHD = Path("/usr/sbin/sshd")


@dataclass
class Sshd:
    port: int
    user: str
    user_key: Path
    known_hosts: Path
    home: Path

    def node(self, *, name: str = "loopback", work_dir: str | None = None, **changes) -> Node:
        fields = dict(name=name, host="127.0.0.1", port=self.port, user=self.user, key_path=self.user_key,
                      known_hosts=self.known_hosts, work_dir=work_dir or str(self.home / "work"), connect_timeout_s=10)
        return Node(**{**fields, **changes})


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dflash-test", "-f", str(path)], check=True)


def start_sshd(home: Path):
    """Start sshd; yield an Sshd; stop it."""
    if not SSHD.exists():
        pytest.skip("SSH backend tests SKIPPED: /usr/sbin/sshd is missing. Install Debian's openssh-server "
                    "(`bash infra/setup.sh` does when run as root on Debian, as in CI; or `apt-get install "
                    "openssh-server`).")
    host_key, user_key = home / "host_key", home / "user_key"
    _keygen(host_key)
    _keygen(user_key)
    authorized = home / "authorized_keys"
    authorized.write_text(user_key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = home / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nAuthorizedKeysFile {authorized}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
        f"PidFile {home / 'sshd.pid'}\nLogLevel VERBOSE\nSubsystem sftp internal-sftp\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege-separation dir sshd insists on as root
    log = open(home / "sshd.log", "ab")
    process = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log,
                               stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited {process.returncode}: {(home / 'sshd.log').read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not listen: {(home / 'sshd.log').read_text()[-2000:]}") from None
            time.sleep(0.1)
    known_hosts = home / "known_hosts"
    key_type, key = host_key.with_suffix(".pub").read_text().split()[:2]
    known_hosts.write_text(f"[127.0.0.1]:{port} {key_type} {key}\n")
    try:
        yield Sshd(port=port, user=getpass.getuser(), user_key=user_key, known_hosts=known_hosts, home=home)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
