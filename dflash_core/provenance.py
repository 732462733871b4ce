"""Who made an artifact: git SHA, package version, host, and the run ids of the orchestrator's run.

A process started by a run (the trainer under torchrun, started by the train task) has no
orchestrator of its own: its launcher passes the flow run and task run ids in its environment
(`producer_env`), and `current_producer` reads them there when the caller names none.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel

from dflash_core.redaction import redact_argv

PACKAGE_NAME = "dflash-pipeline"
# The run ids a launcher hands the process it starts (read at call time, never at import).
FLOW_RUN_ENV, TASK_RUN_ENV = "DFLASH_PRODUCER_FLOW_RUN_ID", "DFLASH_PRODUCER_TASK_RUN_ID"


class Producer(BaseModel):
    flow_run_id: str | None = None
    task_run_id: str | None = None
    git_sha: str | None = None
    package_version: str | None = None
    host: str | None = None
    argv: list[str] | None = None


@functools.cache
def git_sha() -> str | None:
    """HEAD of the checkout this package runs from ("<sha>-dirty" with uncommitted changes)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


@functools.cache
def package_version() -> str | None:
    try:
        return metadata.version(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        return None


def current_producer(*, flow_run_id: str | None = None, task_run_id: str | None = None) -> Producer:
    """This process as a producer; run ids not given come from the environment a launcher set
    (`producer_env`), else stay None (a command run by hand)."""
    return Producer(
        flow_run_id=flow_run_id or os.environ.get(FLOW_RUN_ENV) or None,
        task_run_id=task_run_id or os.environ.get(TASK_RUN_ENV) or None,
        git_sha=git_sha(),
        package_version=package_version(),
        host=platform.node(),
        argv=redact_argv(list(sys.argv)),
    )


def producer_env(producer: Producer) -> dict[str, str]:
    """The environment that makes a child process record `producer`'s flow run and task run as its own
    (merge it into the child's env)."""
    return {name: value for name, value in ((FLOW_RUN_ENV, producer.flow_run_id), (TASK_RUN_ENV, producer.task_run_id))
            if value}
