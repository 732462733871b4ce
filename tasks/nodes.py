"""Prefect tasks over dflash_core.nodes: provision and preserve a node, register its record.

Retries only for transient faults (the node or S3 did not answer); a command that failed with a clear
error, a refused host key or a refused provision plan fails at once.
"""

from __future__ import annotations

from prefect import task

from dflash_core.lineage import Manifest
from dflash_core.nodes import Node, NodeError, NodeRecord, PreserveConfig, PreserveResult, ProvisionConfig
from dflash_core.nodes import preserve, provision, upload_node_record, write_node_record
from dflash_core.nodes.worker import (
    WORKER_DIR, WORKER_HEARTBEAT_S, NodeWorker, ensure_node_worker, node_queue, wait_for_worker,
)
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.provenance import run_producer
from tasks.retry import retry_unreachable


_RETRY = {"retries": 3, "retry_delay_seconds": [5, 15, 30], "retry_condition_fn": retry_unreachable}


@task(**_RETRY, task_run_name="provision {node.name}")
def provision_node(node: Node, config: ProvisionConfig) -> NodeRecord:
    """Provision `node` idempotently and write its record to <work_dir>/node-record.json there."""
    with node.connect() as access:
        record = provision(access, node, config)
        write_node_record(access, node.work_dir, record)
    return record


@task(**_RETRY)
def register_node_record(settings: Settings, record: NodeRecord) -> Manifest:
    """The node record as an S3 artifact with its manifest."""
    return upload_node_record(ObjectStore.from_settings(settings), settings.s3_prefixes, record,
                              producer=run_producer())


@task(**_RETRY, task_run_name="preserve {node.name}")
def preserve_node(settings: Settings, node: Node, config: PreserveConfig) -> PreserveResult:
    """Stop our servers on `node`, upload its scripts, logs, configs and inventory, write the note."""
    store = ObjectStore.from_settings(settings)
    with node.connect() as access:
        return preserve(access, node, store, settings.s3_prefixes, config, producer=run_producer())


@task(**_RETRY, task_run_name="start the stage worker of {node.name}")
def start_node_worker(settings: Settings, node: Node, record: NodeRecord, *, repo_dir: str | None = None,
                      python: str | None = None) -> NodeWorker:
    """Start the node's worker on its own queue (`node-<name>`), with this run's settings, unless it runs; return
    once the server has heard from a worker it started."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    from dflash_core.services.stages import READY_FILE_ENV, REPO_DIR, WORK_POOL, stage_server_env

    queue = node_queue(node.name)
    with get_client(sync_client=True) as client, node.connect() as access:
        try:  # the worker polls it from its start; a run sent there before would create it too
            client.create_work_queue(name=queue, work_pool_name=WORK_POOL,
                                     description=f"stages that run on node {node.name}")
        except ObjectAlreadyExists:
            pass
        except ObjectNotFound:  # the worker would exit at once: it never creates the pool
            raise NodeError(f"work pool {WORK_POOL!r} does not exist on {settings.prefect_api_url}: start the stage "
                            f"server (`dflash services up`) or register the deployments (`dflash deploy`) first, "
                            f"or provision with start_worker off") from None
        repo = access.path(repo_dir or str(REPO_DIR))  # `~/...` would reach the pull step's chdir unexpanded
        env = {**stage_server_env(settings), "DFLASH_REPO_DIR": repo, "DFLASH_WORK_DIR": record.work_dir,
               # the node's own Prefect home, not the controller's path (which need not exist there)
               "PREFECT_HOME": f"{record.work_dir}/{WORKER_DIR}/prefect",
               "PREFECT_WORKER_HEARTBEAT_SECONDS": str(WORKER_HEARTBEAT_S)}
        worker = ensure_node_worker(access, node_name=node.name, work_dir=record.work_dir,
                                    python=access.path(python or f"{record.venv.path}/bin/python"), repo_dir=repo,
                                    env=env, unset=[READY_FILE_ENV])  # the stage server's own, on a local node
        if worker.started:
            # flows/serve.py names its worker stages-<host>-<pid>-<queues>: this process, heard from by the server
            wait_for_worker(access, worker, reached=lambda: any(
                w.name.endswith(f"-{worker.pid}-{queue}") for w in client.read_workers_for_work_pool(WORK_POOL)))
    return worker
