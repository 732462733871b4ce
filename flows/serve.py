"""Serve every deployment of infra/prefect.yaml from this one process: it registers them (names,
descriptions, default parameters, schedules) and runs each flow run, including a Retry pressed in
the UI, in a subprocess. `dflash services up` (and so `dflash demo`) keeps one running.

Run: `python -m flows.serve` (repo root, PREFECT_API_URL pointing at the server).
"""

from __future__ import annotations

import os

from prefect import serve
from prefect.client.schemas.schedules import CronSchedule
from prefect.flows import load_flow_from_entrypoint

from dflash_core.settings import load_settings
from flows.deployments import REPO_DIR, deployment_specs
from flows.results import save_result_storage
from tasks.provenance import flow_version


def runner_deployments() -> list:
    deployments = []
    version = flow_version()
    for spec in deployment_specs():
        flow = load_flow_from_entrypoint(str(REPO_DIR / spec["entrypoint"]))
        schedules = [CronSchedule(cron=s["cron"], timezone=s.get("timezone", "UTC")) for s in spec.get("schedules", [])]
        deployments.append(flow.to_deployment(
            name=spec["name"], description=spec.get("description"), parameters=spec.get("parameters") or {},
            schedules=schedules or None, concurrency_limit=spec.get("concurrency_limit"), version=version))
    return deployments


if __name__ == "__main__":
    os.chdir(REPO_DIR)  # entrypoints relative to the repo (flows/train.py:train), as a worker's are
    save_result_storage(load_settings())
    serve(*runner_deployments(), print_starting_message=False)
