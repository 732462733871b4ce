"""Who made an artifact: git SHA, package version, host, and the run ids the caller passes in."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel

from dflash_core.redaction import redact_argv

PACKAGE_NAME = "dflash-pipeline"


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
    return Producer(
        flow_run_id=flow_run_id,
        task_run_id=task_run_id,
        git_sha=git_sha(),
        package_version=package_version(),
        host=platform.node(),
        argv=redact_argv(list(sys.argv)),
    )
