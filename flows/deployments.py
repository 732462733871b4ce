"""Every flow of infra/prefect.yaml as a deployment, and how one flow starts another: as a deployment
run, so each stage is its own flow run with a Retry in the UI and a failed stage can be retried alone.

infra/prefect.yaml is the one list of deployments (names, descriptions, default parameters,
schedules). Two ways to run them, with the same names: `dflash deploy` + a worker of the `dflash`
pool, or `python -m flows.serve` (what `dflash demo` and `dflash run` start), which serves them all
from one process. Whichever registered last runs them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

REPO_DIR = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO_DIR / "infra" / "prefect.yaml"
STAGE_POLL_S = 1.0


def deployment_specs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The `deployments:` entries of infra/prefect.yaml (anchors resolved)."""
    return yaml.safe_load(path.read_text())["deployments"]


def flow_name(entrypoint: str) -> str:
    """The Prefect flow name behind an entrypoint such as `flows/train.py:train`."""
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(REPO_DIR / entrypoint)).name


def deployment_for(module: str) -> str:
    """`flow name/deployment name` of the first deployment whose entrypoint is flows/<module>.py."""
    for spec in deployment_specs():
        if spec["entrypoint"].split(":")[0] == f"flows/{module}.py":
            return f"{flow_name(spec['entrypoint'])}/{spec['name']}"
    raise ValueError(f"no deployment in {PREFECT_YAML.name} runs flows/{module}.py")


# The deployment each pipeline stage runs as (flow name/deployment name in infra/prefect.yaml).
STAGES = {
    "generate": "dflash-generate/generate",
    "tokenize": "dflash-tokenize/tokenize-nightly",
    "train": "dflash-train/train",
    "evaluate": "dflash-evaluate/evaluate",
}


class StageFailed(RuntimeError):
    """A stage's flow run ended failed or crashed; retry it from the UI (or rerun the pipeline)."""


# The flow behind each stage, for a caller that is not itself a deployment run.
STAGE_FLOWS = {"generate": "flows.generate:generate", "tokenize": "flows.tokenize:tokenize",
               "train": "flows.train:train", "evaluate": "flows.evaluate:evaluate"}


def run_stage(stage: str, params: BaseModel, *, timeout_s: float | None = None) -> Any:
    """Run `stage` as a deployment run, a subflow of the current flow run, and return its result.

    The run is keyed by (this flow run, stage): when this flow run is retried, a stage that already
    completed is not run again (its result is reused), and a failed one is retried in place (same
    flow run, its finished tasks come back Cached) instead of starting a new one. A flow called
    directly from Python (not a deployment run: a test, a notebook) runs the stage in-process.
    """
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.runtime import deployment, flow_run as current

    if not deployment.id:
        import importlib

        module, name = STAGE_FLOWS[stage].split(":")
        return getattr(importlib.import_module(module), name)(params)
    key = f"{current.id}:{stage}" if current.id else None
    run = run_deployment(STAGES[stage], parameters={"params": params.model_dump(mode="json")}, timeout=0,
                         idempotency_key=key, flow_run_name=_run_name(current.name, stage))
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
        if state is not None and state.is_final() and not state.is_completed():
            retry_flow_run(client, run.id, message=f"retried by {current.flow_name} {current.name}")
        state = wait_final(client, run.id, timeout_s=timeout_s)
    if not state.is_completed():
        raise StageFailed(f"stage {stage} ({STAGES[stage]}, flow run {run.name} {run.id}) ended {state.name}: "
                          f"{state.message or ''}. Fix the cause, then press Retry on that flow run (or on this one).")
    return state.result()


def retry_flow_run(client, flow_run_id, *, message: str = "Retry") -> None:
    """What the UI's Retry button does: put a finished run back to AwaitingRetry (the runner picks it up)."""
    from prefect.states import AwaitingRetry

    client.set_flow_run_state(flow_run_id, AwaitingRetry(message=message), force=True)


def wait_final(client, flow_run_id, *, timeout_s: float | None = None):
    """The final state of a flow run, polled (a Retry between polls puts it back to Scheduled)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_final():
            return state
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"flow run {flow_run_id} still {state.name if state else 'unknown'} after {timeout_s} s")
        time.sleep(STAGE_POLL_S)


def _run_name(parent: str | None, stage: str) -> str | None:
    return f"{parent}-{stage}" if parent else None
