"""The session's slowest setups, started in one background thread so that they run beside tests that need
none of them: the Prefect server, the stage server and the two shared runs of
tests/integration/shared_runs.py. In one process they start at the session's first test (tests/conftest.py
runs the unit tests first); in an xdist worker at a Prefect lane's first test, each worker starting only what
its lane's tests need (the shared runs only in the lane that reads them). Each job starts only if a selected
test needs its fixture; that fixture then waits for the job (`Early.get`) instead of doing the work itself.
These setups are mostly waits on processes, which another core runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dflash_core.services import local


class Early:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="early-setup")
        self._jobs: dict[str, Future] = {}
        self._started = False
        self.services: list[local.LocalService] = []

    def start(self, request, items) -> None:
        """Queue the setups that `items` (this process's tests) need (submit_session_setups), once."""
        if not self._started:
            self._started = True
            needed = {name for item in items for name in item.fixturenames}
            submit_session_setups(self, request, needed)

    def submit(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        self._jobs[name] = self._pool.submit(fn, *args)

    def get(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """The job's value (waiting for it), or fn(*args) here when no job was submitted."""
        job = self._jobs.get(name)
        return job.result() if job is not None else fn(*args)

    def start_service(self, service: local.LocalService, base_env: dict[str, str]) -> local.LocalService:
        """Start `service` with the environment the session had when it began (not a test's monkeypatched one)."""
        service.env = {**base_env, **service.env}
        self.services.append(service)
        local.start(service)
        return service

    def close(self) -> None:
        """Wait for what runs, skip what has not started, and stop every service a job started."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for service in reversed(self.services):
            local.shutdown(service)


def submit_session_setups(early: Early, request, needed: set[str]) -> None:
    """Queue, in order, what the selected tests need: the Prefect server, the stage server, the retried pipeline
    run and the whole DAG run."""
    if "prefect_server" not in needed:
        return
    from dflash_core.services.stages import stage_service

    settings = request.getfixturevalue("settings")
    request.getfixturevalue("s3_server")
    base_env = dict(os.environ)
    early.submit("prefect_server", early.start_service, local.prefect_service(settings), base_env)
    if "stage_server" in needed:
        early.submit("stage_server", early.start_service, stage_service(settings), base_env)
    if "retried_pipeline" in needed or "whole_run" in needed:
        from tests.integration import shared_runs

        store, target = request.getfixturevalue("store"), request.getfixturevalue("tiny_target")
        factory = request.getfixturevalue("tmp_path_factory")
        if "retried_pipeline" in needed:
            early.submit("retried_pipeline", shared_runs.retry_a_failed_pipeline_here, store, settings, target,
                         factory.mktemp("retried"))
        if "whole_run" in needed:
            early.submit("whole_run", shared_runs.run_whole_dag_in_a_process, settings, target,
                         factory.mktemp("whole-run"), factory.mktemp("sshd"), base_env)
