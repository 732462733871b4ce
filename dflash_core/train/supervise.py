"""A child process that dies with its parent: the training run a `dflash train` (or a flow task)
starts must not go on as an orphan when the parent is killed, even by kill -9.

On Linux the kernel sends the child SIGTERM when the parent dies (PR_SET_PDEATHSIG), so the run
writes a checkpoint and exits 143 as on any SIGTERM; signals the parent receives are forwarded.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent() -> None:
    """`preexec_fn` for Popen: SIGTERM this child when the process that started it exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run_tied(argv: Sequence[str], **popen_kwargs) -> int:
    """Run `argv` to completion as a child that dies with us; SIGINT/SIGTERM/SIGHUP we get are passed
    on (the child then stops at its next step boundary with a checkpoint). Its exit code."""
    process = subprocess.Popen(list(argv), preexec_fn=die_with_parent, **popen_kwargs)

    def forward(signum, frame) -> None:
        if process.poll() is None:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
