"""The stage server: register every deployment of flows/deployment_table.py in the `dflash` work pool
(the same registration `dflash deploy` makes), then run a process worker of that pool here, which
runs each flow run, including a Retry pressed in the UI, in a subprocess. `dflash services up` (and so
`dflash demo`) keeps one running; `prefect worker start --pool dflash` on more hosts adds workers.

Run: `python -m flows.serve` (PREFECT_API_URL pointing at the server, DFLASH_REPO_DIR at this repo).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket

from dflash_core.services.stages import READY_FILE_ENV, WORKER_POLL_S
from dflash_core.settings import load_settings
from flows.deployment_table import WORK_POOL
from flows.deployments import REPO_DIR, REPO_DIR_VARIABLE, register_deployments
from flows.results import save_result_storage


async def run_worker(*, work_pool: str = WORK_POOL) -> None:
    from prefect.workers.process import ProcessWorker

    name = f"stages-{socket.gethostname()}-{os.getpid()}"
    async with ProcessWorker(work_pool_name=work_pool, name=name, prefetch_seconds=WORKER_POLL_S,
                             create_pool_if_not_found=False) as worker:
        await worker.start()


def main() -> None:
    os.environ.setdefault(REPO_DIR_VARIABLE, str(REPO_DIR))  # the deployments' pull step enters it
    save_result_storage(load_settings())
    registered = register_deployments(work_pool=WORK_POOL)
    ready_file = os.environ.get(READY_FILE_ENV)
    if ready_file:  # tells `dflash services up` that this process (not an earlier one) registered them
        with open(ready_file, "w") as out:
            json.dump({"pid": os.getpid(), "deployments": sorted(registered)}, out)
    asyncio.run(run_worker())


if __name__ == "__main__":
    main()
