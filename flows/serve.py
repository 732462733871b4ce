"""The stage server: register every deployment of flows/deployment_table.py in the `dflash` work pool
(the same registration `dflash deploy` makes), then run a process worker of that pool here, which
runs each flow run, including a Retry pressed in the UI, in a subprocess. `dflash services up` (and so
`dflash demo`) keeps one running; `prefect worker start --pool dflash` on more hosts adds workers.

A node's own worker (dflash_core/nodes/worker.py, started by provision) is this module with
`--work-queue node-<name> --no-register`: it polls only that node's queue. Without `--work-queue` the
worker polls the pool's default queue, so the stages a pipeline sends to a node never run elsewhere.

Run: `python -m flows.serve [--work-queue Q] [--no-register]` (PREFECT_API_URL pointing at the server,
DFLASH_REPO_DIR at this repo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket

from dflash_core.services.stages import READY_FILE_ENV, WORKER_POLL_S
from dflash_core.settings import load_settings
from flows.deployment_table import WORK_POOL
from flows.deployments import REPO_DIR, REPO_DIR_VARIABLE, register_deployments
from flows.results import save_result_storage


DEFAULT_QUEUE = "default"  # the queue every deployment of the pool sends its runs to, unless told otherwise


async def run_worker(*, work_pool: str = WORK_POOL, work_queues: list[str] | None = None) -> None:
    from prefect.workers.process import ProcessWorker

    queues = work_queues or [DEFAULT_QUEUE]
    name = f"stages-{socket.gethostname()}-{os.getpid()}-{'-'.join(queues)}"
    async with ProcessWorker(work_pool_name=work_pool, work_queues=queues, name=name, prefetch_seconds=WORKER_POLL_S,
                             create_pool_if_not_found=False) as worker:
        await worker.start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-queue", action="append", dest="work_queues",
                        help="Poll this queue of the pool (repeatable); default: the pool's default queue.")
    parser.add_argument("--no-register", action="store_true",
                        help="Do not register the deployments (a node's worker: the controller registered them).")
    args = parser.parse_args(argv)
    os.environ.setdefault(REPO_DIR_VARIABLE, str(REPO_DIR))  # the deployments' pull step enters it
    if not args.no_register:
        save_result_storage(load_settings())
        registered = register_deployments(work_pool=WORK_POOL)
    else:
        registered = {}
    ready_file = os.environ.get(READY_FILE_ENV)
    if ready_file:  # tells `dflash services up` that this process (not an earlier one) registered them
        with open(ready_file, "w") as out:
            json.dump({"pid": os.getpid(), "deployments": sorted(registered)}, out)
    asyncio.run(run_worker(work_queues=args.work_queues))


if __name__ == "__main__":
    main()
