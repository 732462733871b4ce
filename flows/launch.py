"""`dflash run <flow>` / `dflash demo`: start a flow as a run of its deployment (so it has a Retry in
the UI, and its stages too), wait for it, print its result; exit 1 when it did not complete.

Run: `python -m flows.launch pipeline --params '{}'` (the stage server must be up: `dflash services up`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_UI_URL

from flows.command_line import result_json
from flows.deployments import deployment_for


def launch(module: str, params: dict) -> int:
    name = deployment_for(module)
    run = run_deployment(name, parameters={"params": params} if params else None, timeout=0, as_subflow=False)
    ui = PREFECT_UI_URL.value() or ""
    print(f"{name}: flow run {run.name} {ui}/runs/flow-run/{run.id}", flush=True)
    with get_client(sync_client=True) as client:
        state = _follow(client, run.id)
    if not state.is_completed():
        print(f"{name}: {state.name}: {state.message or ''}\nFix the cause, then press Retry on the failed flow run "
              f"in the UI (its finished stages are not redone).", file=sys.stderr)
        return 1
    print(result_json(state.result()))
    return 0


def _follow(client, root_id, *, poll_s: float = 2.0):
    """Print the logs of a flow run and of every stage it starts (their own flow runs) until it ends."""
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId, LogFilterTimestamp,
    )
    from prefect.client.schemas.sorting import LogSort

    runs, names, after = {root_id}, {}, None
    while True:
        state = client.read_flow_run(root_id).state
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=list(runs))))
        runs |= {child.id for child in children}
        names.update({child.id: child.name for child in children})
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(runs)),
                                                     timestamp=LogFilterTimestamp(after_=after)),
                                sort=LogSort.TIMESTAMP_ASC, limit=200)
        for log in logs:
            if after is not None and log.timestamp <= after:
                continue
            print(f"{log.timestamp:%H:%M:%S} {names.get(log.flow_run_id, 'pipeline'):>28} | {log.message}", flush=True)
        after = logs[-1].timestamp if logs else after
        if state is not None and state.is_final() and len(logs) < 200:
            return state
        time.sleep(poll_s if len(logs) < 200 else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a flow as a run of its deployment and wait for it.")
    parser.add_argument("flow", help="module under flows/ (e.g. pipeline)")
    parser.add_argument("--params", default="{}", help="the flow's params as JSON ({} for the deployment's defaults)")
    args = parser.parse_args()
    sys.exit(launch(args.flow, json.loads(args.params)))


if __name__ == "__main__":
    main()
