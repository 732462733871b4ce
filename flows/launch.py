"""`dflash run <flow>` / `dflash demo`: start a flow as a run of its deployment (so it has a Retry in
the UI, and its stages too), wait for it, print its result; exit 1 when it did not complete.

Run: `python -m flows.launch pipeline --params '{}'` (the stage server must be up: `dflash services up`).
"""

from __future__ import annotations

import argparse
import json
import sys

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_UI_URL

from flows.deployments import deployment_for, wait_final


def launch(module: str, params: dict) -> int:
    name = deployment_for(module)
    run = run_deployment(name, parameters={"params": params} if params else None, timeout=0, as_subflow=False)
    ui = PREFECT_UI_URL.value() or ""
    print(f"{name}: flow run {run.name} {ui}/runs/flow-run/{run.id}", flush=True)
    with get_client(sync_client=True) as client:
        state = wait_final(client, run.id)
    if not state.is_completed():
        print(f"{name}: {state.name}: {state.message or ''}\nFix the cause, then press Retry on the failed flow run "
              f"in the UI (its finished stages are not redone).", file=sys.stderr)
        return 1
    print(json.dumps(state.result(), indent=2, default=str))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a flow as a run of its deployment and wait for it.")
    parser.add_argument("flow", help="module under flows/ (e.g. pipeline)")
    parser.add_argument("--params", default="{}", help="the flow's params as JSON ({} for the deployment's defaults)")
    args = parser.parse_args()
    sys.exit(launch(args.flow, json.loads(args.params)))


if __name__ == "__main__":
    main()
