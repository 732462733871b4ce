"""`dflash run <flow>` / `dflash demo`: start a flow as a run of its deployment (so it has a Retry in
the UI, and its stages too), wait for it, print its result; exit 1 when it did not complete. Parameters its flow's
model refuses (a typo, JSON that is not an object) and an unknown flow end in one `error:` line and exit 2 before
anything reaches the server.

Run: `python -m flows.launch pipeline --params '{}'` (the stage server must be up: `dflash services up`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_UI_URL

from pydantic import ValidationError

from dflash_core.strict import validation_summary
from flows.command_line import result_json
from flows.deployment_table import spec_for
from flows.deployments import deployment_for, params_model


def checked_params(module: str, params_text: str) -> dict:
    """`params_text` as the flow's params, checked against the flow's own parameter model before anything reaches
    the server; a ValueError naming what is wrong (a typo's dotted path and its nearest field) otherwise. `{}`
    leaves the deployment's defaults, so it is not checked here."""
    model = params_model(spec_for(module).entrypoint)
    try:
        params = json.loads(params_text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--params is not JSON: {error}") from None
    if not isinstance(params, dict):
        raise ValueError(f"--params must be a JSON object ({model.__name__}'s fields), not a "
                         f"{_json_kind(params)}")
    if params:
        try:
            model.model_validate(params)
        except ValidationError as error:
            raise ValueError(f"--params: {validation_summary(error)}") from None
    return params


def _json_kind(value) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def launch(module: str, params: dict) -> int:
    name = deployment_for(module)
    run = run_deployment(name, parameters={"params": params} if params else None, timeout=0, as_subflow=False)
    ui = PREFECT_UI_URL.value() or ""
    print(f"{name}: flow run {run.name} {ui}/runs/flow-run/{run.id} (log times below are UTC)", flush=True)
    with get_client(sync_client=True) as client:
        state = _follow(client, run.id)
    if not state.is_completed():
        print(f"{name}: {state.name}: {state.message or ''}\nFix the cause, then press Retry on the failed flow run "
              f"in the UI (its finished stages are not redone).", file=sys.stderr)
        return 1
    print(result_json(state.result()))
    return 0


STAGE_WIDTH = 8  # "evaluate", "tokenize": the stage column lines up for the pipeline's stages


def log_label(flow_name: str | None, run_name: str | None, task_run_name: str | None = None) -> str:
    """How `dflash run` labels a log line: the stage (its flow's name without `dflash-`: tokenize, train, ...),
    the flow run's name, and the task run's name when a task logged it (so a "Finished in state Cached(...)"
    line says which task's result was reused)."""
    stage = (flow_name or "").removeprefix("dflash-")
    label = " ".join(part for part in (f"{stage:<{STAGE_WIDTH}}" if stage else "", run_name) if part).rstrip() or "?"
    return f"{label} / {task_run_name}" if task_run_name else label


def log_line(timestamp, message: str, label: str) -> str:
    return f"{timestamp:%H:%M:%S} {label} | {message}"


# A worker logs this to a flow run each time the server refuses to let it start the run (e.g. while the run's
# deployment has no free concurrency slot): every ~10 s poll, for as long as the run waits.
_SUBMISSION_REFUSED = re.compile(r"Aborted submission of flow run '[^']*': Server returned a non-pending state "
                                 r"'?(?P<state>\w+)'?")


# What a worker logs to a flow run before each try to start it, refused or not (Prefect 3.9's workers/base.py).
_RESUBMITTING = re.compile(r"Worker '[^']*' submitting flow run '|Running on worker id: ")


def followed_line(message: str, *, waiting: bool) -> tuple[str | None, bool]:
    """(what to print for a flow run's log line, or None; whether the run waits to start after it). A waiting run's
    wait is said once: its refusals and the worker's submission line before each are not printed again."""
    said = waiting_message(message)
    if said is not None:
        return (None if waiting else said), True
    if waiting and _RESUBMITTING.match(message):
        return None, True
    return message, False


def waiting_message(message: str) -> str | None:
    """What a worker's refused submission says, once, for a run that waits to start; None for any other line."""
    refused = _SUBMISSION_REFUSED.match(message)
    if refused is None:
        return None
    return (f"waiting ({refused.group('state')}): the server does not let the worker start this run yet, e.g. until "
            f"a concurrency slot of its deployment frees; the worker asks again each poll (said once)")


def _follow(client, root_id, *, poll_s: float = 2.0, patience: int = 3):
    """Print the logs of a flow run and of every stage it starts (their own flow runs) until it ends, each
    labelled by its stage, run and (for a task's line) task run. Flow and task run names are read once each.
    A task run is recorded from events and may reach the server after its log line: a line whose task run is
    not known yet waits (with the lines after it) up to `patience` polls, then is printed with the task run's id.
    A run waiting to start is said once (`followed_line`), not at each of the worker's polls."""
    from prefect.client.schemas.filters import (
        FlowFilter, FlowFilterId, FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId,
        LogFilterTimestamp, TaskRunFilter, TaskRunFilterId,
    )
    from prefect.client.schemas.sorting import LogSort

    runs, run_names, run_flows = {root_id}, {}, {}
    flow_names: dict = {}
    task_names: dict = {}
    waited: dict = {}  # task run id -> polls its line has waited for the task run's name
    waiting: set = set()  # flow runs whose wait to start was printed, until they log anything else
    after, printed_at_after = None, set()  # the last printed line's timestamp, and the ids printed at it
    while True:
        root = client.read_flow_run(root_id)
        state = root.state
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=list(runs))))
        for run in (root, *children):
            runs.add(run.id)
            run_names[run.id], run_flows[run.id] = run.name, run.flow_id
        if unknown_flows := {f for f in run_flows.values() if f not in flow_names}:
            flow_names.update({f.id: f.name for f in client.read_flows(
                flow_filter=FlowFilter(id=FlowFilterId(any_=list(unknown_flows))))})
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(runs)),
                                                     timestamp=LogFilterTimestamp(after_=after)),
                                sort=LogSort.TIMESTAMP_ASC, limit=200)
        fresh = [log for log in logs if after is None or log.timestamp > after
                 or (log.timestamp == after and log.id not in printed_at_after)]
        if unknown_tasks := {log.task_run_id for log in fresh if log.task_run_id} - task_names.keys():
            task_names.update({t.id: t.name for t in client.read_task_runs(
                task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=list(unknown_tasks))))})
        held = False
        for log in fresh:
            task_name = None
            if log.task_run_id:
                task_name = task_names.get(log.task_run_id)
                if task_name is None:
                    waited[log.task_run_id] = waited.get(log.task_run_id, 0) + 1
                    if waited[log.task_run_id] <= patience:
                        held = True
                        break
                    task_name = f"task run {str(log.task_run_id)[:8]}"
            label = log_label(flow_names.get(run_flows.get(log.flow_run_id)), run_names.get(log.flow_run_id),
                              task_name)
            message, still_waiting = followed_line(log.message, waiting=log.flow_run_id in waiting)
            if still_waiting:
                waiting.add(log.flow_run_id)
            else:
                waiting.discard(log.flow_run_id)
            if message is not None:
                print(log_line(log.timestamp, message, label), flush=True)
            if log.timestamp != after:
                after, printed_at_after = log.timestamp, set()
            printed_at_after.add(log.id)
        if state is not None and state.is_final() and len(logs) < 200 and not held:
            return state
        time.sleep(poll_s if len(logs) < 200 or held else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a flow as a run of its deployment and wait for it.")
    parser.add_argument("flow", help="module under flows/ (e.g. pipeline)")
    parser.add_argument("--params", default="{}", help="the flow's params as JSON ({} for the deployment's defaults)")
    args = parser.parse_args()
    try:
        params = checked_params(args.flow, args.params)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(args.flow, params))


if __name__ == "__main__":
    main()
