"""The node's own stage worker: a worker of the `dflash` pool that polls only this node's work queue
(`node-<name>`), started on the node by provision, so every stage the pipeline sends to that queue runs
there, with the node's venv, GPUs and model placement.

It is the stage server (`python -m flows.serve --work-queue node-<name> --no-register`) in a process
of its own session (setsid: it outlives the SSH session or command that started it), recorded under
`<work_dir>/worker/` (not `<work_dir>/pids/`, which preserve stops: a preserved node keeps its worker,
so a Retry still finds it). The settings it runs with (bucket keys, Prefect URL) go in a file only its
owner reads, never on a command line.
"""

from __future__ import annotations

import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from dflash_core.nodes.access import DetachedProcess, NodeAccess, NodeError

WORKER_DIR = "worker"
WORKER_NAME = "stage-worker"
QUEUE_PREFIX = "node-"
# Prefect's default is 30 s: a generation across nodes counts a node lost when its worker falls silent
# (generate's node_timeout_s), so it should hear often; one small request a heartbeat.
WORKER_HEARTBEAT_S = 10
WORKER_READY_TIMEOUT_S = 180.0  # importing the stage server on a busy node, then its first call to the server


def node_queue(node_name: str) -> str:
    """The work queue of the `dflash` pool whose worker runs on `node_name`."""
    return f"{QUEUE_PREFIX}{node_name}"


class NodeWorker(BaseModel):
    queue: str
    pid: int
    log_path: str
    started: bool = Field(description="False: the recorded worker was already running and was left alone.")
    python: str
    repo_dir: str
    process: DetachedProcess = Field(description="The worker's process record on the node.")


def ensure_node_worker(access: NodeAccess, *, node_name: str, work_dir: str, python: str, repo_dir: str,
                       env: dict[str, str], unset: Sequence[str] = ()) -> NodeWorker:
    """Start the node's worker unless the one recorded under `<work_dir>/worker/` runs; idempotent.

    It runs with `env` and without the variables named in `unset` or Prefect's run context (`PREFECT__*`), which
    it would inherit when started from a flow run on this host (the local backend): it is part of no run.

    A running worker keeps the settings it was started with: stop it (`stop_node_worker`) to change them."""
    queue = node_queue(node_name)
    record_dir = f"{work_dir}/{WORKER_DIR}"
    for record in access.recorded_processes(record_dir):
        if record.name == WORKER_NAME and access.is_running(record):
            return NodeWorker(queue=queue, pid=record.pid, log_path=record.log_path, started=False, python=python,
                              repo_dir=repo_dir, process=record)
    if not access.exists(f"{repo_dir}/flows/serve.py"):
        raise NodeError(f"on {access.name}: {repo_dir} holds no checkout of this project (flows/serve.py): put one "
                        f"there (git clone, or copy the repository) or set provision.repo_dir")
    env_file = f"{record_dir}/worker.env"
    body = "".join(f"unset {name}\n" for name in unset)
    body += "for name in $(env | sed -n 's/^\\(PREFECT__[A-Za-z0-9_]*\\)=.*/\\1/p'); do unset \"$name\"; done\n"
    body += "".join(f"export {key}={shlex.quote(value)}\n" for key, value in sorted(env.items()))
    access.run(f"mkdir -p {shlex.quote(record_dir)} && chmod 700 {shlex.quote(record_dir)}", timeout_s=30)
    with tempfile.TemporaryDirectory() as local:  # copied as a file: write_text would put the secrets on a command line
        (Path(local) / "worker.env").write_text(body)
        (Path(local) / "worker.env").chmod(0o600)
        access.put(Path(local) / "worker.env", env_file)
    access.run(["chmod", "600", access.path(env_file)], timeout_s=30)
    command = (f". {shlex.quote(env_file)} && exec {shlex.quote(python)} -m flows.serve "
               f"--work-queue {shlex.quote(queue)} --no-register")
    record: DetachedProcess = access.start_detached(WORKER_NAME, command, log_path=f"{record_dir}/worker.log",
                                                    record_dir=record_dir, cwd=repo_dir)
    return NodeWorker(queue=queue, pid=record.pid, log_path=record.log_path, started=True, python=python,
                      repo_dir=repo_dir, process=record)


def wait_for_worker(access: NodeAccess, worker: NodeWorker, *, reached: Callable[[], bool],
                    timeout_s: float = WORKER_READY_TIMEOUT_S, poll_s: float = 1.0) -> None:
    """Return once `reached()` says the server has heard from the worker; raise NodeError with its log's tail if
    it exits first (no Prefect in that venv, a server the node cannot reach) or `timeout_s` passes, stopping a
    worker still starting so that a retry starts afresh. A worker that never comes up would leave every stage
    sent to its queue Scheduled for ever."""
    deadline = time.monotonic() + timeout_s
    while not reached():
        running = access.is_running(worker.process)
        if not running or time.monotonic() > deadline:
            if running:
                access.stop_detached(worker.process)
            tail = access.run(["tail", "-n", "30", worker.log_path], check=False, timeout_s=30).stdout
            what = "exited" if not running else f"did not reach the Prefect server in {timeout_s:.0f} s"
            raise NodeError(f"on {access.name}: the stage worker ({worker.python} -m flows.serve in {worker.repo_dir}, "
                            f"queue {worker.queue}) {what}; its log {worker.log_path} ends:\n{tail}")
        time.sleep(poll_s)


def stop_node_worker(access: NodeAccess, *, work_dir: str) -> list[str]:
    """Stop the node's recorded worker; what happened to each record."""
    return [f"{record.name} {record.pid}: {access.stop_detached(record)}"
            for record in access.recorded_processes(f"{work_dir}/{WORKER_DIR}")]
