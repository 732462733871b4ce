"""Registering the deployments of flows/deployment_table.py, and how one flow starts another: as a
deployment run, so each stage is its own flow run with a Retry in the UI and a failed stage can be
retried alone.

`register_deployments` is the one way deployments reach the server: the stage server calls it at
start, `dflash deploy` calls it. Every deployment goes to the `dflash` process work pool with a pull
step that enters $DFLASH_REPO_DIR, so registering twice (or from two hosts) changes nothing and any
worker of the pool runs any of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from flows.deployment_table import DEPLOYMENTS, STAGE_MODULES, WORK_POOL, DeploymentSpec, spec_for, spec_named

REPO_DIR = Path(__file__).resolve().parent.parent
STAGE_POLL_S = 0.5  # how often a pipeline checks its running stage: one query to the local server
REPO_DIR_VARIABLE = "DFLASH_REPO_DIR"
PULL_STEPS = [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $" + REPO_DIR_VARIABLE + " }}"}}]
# Persist results so a Retry from the UI resumes at the failed task (finished ones come back Cached).
JOB_ENV = {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "DO_NOT_TRACK": "1"}


def flow_name(entrypoint: str) -> str:
    """The Prefect flow name behind an entrypoint such as `flows/train.py:train`."""
    return _load_flow(entrypoint).name


def params_model(entrypoint: str) -> type[BaseModel]:
    """The model of the `params` argument of the flow behind `entrypoint` (TrainFlowParams for flows/train.py:train)."""
    from typing import get_type_hints

    return get_type_hints(_load_flow(entrypoint).fn)["params"]


def _load_flow(entrypoint: str):
    """The flow object of `flows/train.py:train`, imported as flows.train (the same classes its callers use)."""
    import importlib

    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def deployment_for(module_or_name: str) -> str:
    """`flow name/deployment name` of the deployment called `module_or_name`, else of the first whose
    entrypoint is flows/<module_or_name>.py."""
    spec = spec_for(module_or_name)
    return f"{flow_name(spec.entrypoint)}/{spec.name}"


def register_deployments(*, work_pool: str = WORK_POOL) -> dict[str, UUID]:
    """Create the process work pool if missing and create or update every deployment of the table in
    it; `flow name/deployment name` -> deployment id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        _ensure_process_pool(client, work_pool)
        return {name: deployment_id for name, deployment_id in
                (_register_retrying(client, spec, work_pool=work_pool) for spec in DEPLOYMENTS)}


REGISTER_TRIES = 12  # each try is one request: a busy SQLite server refuses a large upsert now and then


def _register_retrying(client, spec: DeploymentSpec, *, work_pool: str) -> tuple[str, UUID]:
    """`_register`, tried again soon after a 503. On SQLite the server answers 503 when the upsert's transaction
    lost a race with another writer (WAL mode refuses it at once). A large deployment (the pipeline's form) takes
    seconds to upsert and loses that race often on a busy server, and Prefect's own retries back off
    exponentially (2, 4, ... 32 s, then give up); short, jittered retries of the one upsert get through."""
    import random

    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    for attempt in range(1, REGISTER_TRIES + 1):
        try:
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                return _register(client, spec, work_pool=work_pool)
        except PrefectHTTPStatusError as error:
            if error.response.status_code != 503 or attempt == REGISTER_TRIES:
                raise
            time.sleep(random.uniform(0.2, 1.5))
    raise AssertionError("unreachable")


def _ensure_process_pool(client, name: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:  # another process created it meanwhile
            pass
        return
    if pool.type != "process":
        raise ValueError(f"work pool {name!r} exists with type {pool.type!r}; the dflash deployments need a process "
                         f"pool: delete it (`prefect work-pool delete {name}`) or pass another pool name")


def _register(client, spec: DeploymentSpec, *, work_pool: str) -> tuple[str, UUID]:
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.utilities.callables import parameter_schema

    from tasks.provenance import flow_version

    flow = _load_flow(spec.entrypoint)
    schedules = [DeploymentScheduleCreate(
        schedule=CronSchedule(cron=spec.schedule.cron_utc, timezone="UTC"), active=spec.schedule.active,
        slug=spec.schedule.slug, parameters=spec.schedule.parameters() if spec.schedule.parameters else {})] \
        if spec.schedule else []
    deployment_id = client.create_deployment(
        flow_id=client.create_flow_from_name(flow.name), name=spec.name, version=flow_version(),
        description=spec.description, parameters=spec.parameters() if spec.parameters else {},
        parameter_openapi_schema=parameter_schema(flow).model_dump(exclude_unset=True), schedules=schedules,
        concurrency_limit=spec.concurrency_limit, work_pool_name=work_pool, entrypoint=spec.entrypoint,
        pull_steps=PULL_STEPS, job_variables={"env": JOB_ENV}, enforce_parameter_schema=True)
    return f"{flow.name}/{spec.name}", deployment_id


class StageFailed(RuntimeError):
    """A stage's flow run ended failed or crashed; its own run logged why. Retry it from the UI (or rerun
    the pipeline)."""


@dataclass
class StartedStage:
    """A stage run started by `start_stage`: its flow run (a deployment run), or its state already (in-process)."""

    deployment: str
    name: str
    run_id: UUID | None = None
    run_name: str | None = None
    state: Any = None  # in-process: the final state


def run_stage(deployment: str, params: BaseModel, *, key: str | None = None, timeout_s: float | None = None,
              work_queue: str | None = None) -> Any:
    """Run the deployment named `deployment` (flows/deployment_table.py) as a subflow of the current flow
    run and return its result.

    The run is keyed by (this flow run, `key` or the deployment): when this flow run is retried, a stage that already
    completed is not run again (its result is reused), and a failed one is retried in place (same
    flow run, its finished tasks come back Cached) instead of starting a new one. Upstream results in
    `params` (stage records from dflash_core.stage_results) become the run's task inputs, so the UI draws
    an edge from each upstream stage to this one. `work_queue` sends the run to that queue of the pool (a
    provisioned node's, dflash_core/nodes/worker.py: the stage runs on that node); None: the default queue.
    A flow called directly from Python (not a deployment run: a test, a notebook) runs the stage in-process.
    Either way a stage that does not complete raises StageFailed, whose message says where to look.
    """
    started = start_stage(deployment, params, key=key, work_queue=work_queue)
    if started.run_id is not None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            started.state = wait_final(client, started.run_id, timeout_s=timeout_s)
    return stage_result(started)


def start_stage(deployment: str, params: BaseModel, *, key: str | None = None,
                work_queue: str | None = None) -> StartedStage:
    """`run_stage` without the wait: several stages started this way run at once (one per node); `stage_result`
    takes each one's result once its state is final."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment as current_deployment, flow_run as current

    spec = spec_named(deployment)
    if spec.module not in STAGE_MODULES:
        raise ValueError(f"deployment {deployment!r} runs flows/{spec.module}.py, not a pipeline stage {STAGE_MODULES}")
    name = f"{flow_name(spec.entrypoint)}/{spec.name}"
    if not current_deployment.id:
        return StartedStage(deployment, name, state=_load_flow(spec.entrypoint)(params, return_state=True))
    with get_client(sync_client=True) as client:
        run = _create_stage_run(client, spec, name, params, parent_flow_run_id=current.id,
                                idempotency_key=f"{current.id}:{key or deployment}",
                                flow_run_name=_run_name(current.name, key or deployment), work_queue=work_queue)
        state = client.read_flow_run(run.id).state
        if state is not None and state.is_final() and not state.is_completed():
            retry_flow_run(client, run.id, message=f"retried by {current.flow_name} {current.name}")
    return StartedStage(deployment, name, run_id=run.id, run_name=run.name)


def stage_result(started: StartedStage) -> Any:
    """The result of a stage whose state is final; StageFailed, saying where to look, when it did not complete."""
    state = started.state
    if not state.is_completed():
        where = f"({started.name}, flow run {started.run_name} {started.run_id}) " if started.run_id else ""
        retry = " Fix the cause, then press Retry on that flow run (or on this one)." if started.run_id else ""
        raise StageFailed(f"stage {started.deployment} {where}ended {state.name}: {state.message or ''}.{retry}")
    return state.result()


def _create_stage_run(client, spec: DeploymentSpec, name: str, params: BaseModel, *, parent_flow_run_id,
                      idempotency_key: str, flow_run_name: str | None, work_queue: str | None = None):
    """What `run_deployment(as_subflow=True)` does, with the upstream stages as task inputs: a task run in
    the parent that stands for the stage (its state follows the stage's), then the stage's flow run."""
    from prefect import Task
    from prefect.client.schemas.objects import FlowRunResult
    from prefect.states import Pending, Scheduled

    deployment = client.read_deployment_by_name(name)
    # The run graph joins an input's id to a node's, and a stage's node is its flow run: name the flow runs.
    upstream = [FlowRunResult(id=run_id) for run_id in _upstream_stage_runs(client, params, parent_flow_run_id)]
    stand_in = Task(name=name, fn=lambda: None, version=deployment.version)
    stand_in.task_key = f"dflash.stage.{spec.name}"
    task_run = client.create_task_run(task=stand_in, flow_run_id=parent_flow_run_id, dynamic_key=idempotency_key,
                                      task_inputs={"params": upstream}, state=Pending())
    return client.create_flow_run_from_deployment(
        deployment.id, parameters={"params": params.model_dump(mode="json")}, state=Scheduled(),
        name=flow_run_name, idempotency_key=idempotency_key, parent_task_run_id=task_run.id,
        work_queue_name=work_queue)


def _upstream_stage_runs(client, params: BaseModel, parent_flow_run_id) -> list:
    """The flow runs of this flow run's stages whose results `params` carries as its own inputs: a stage result's
    own upstream (a Checkpoint's dataset) is that stage's input, not this one's, so it draws no edge here."""
    from dflash_core.stage_results import StageResult

    from prefect.exceptions import ObjectNotFound

    found: list = []

    def visit(value: Any) -> None:
        if isinstance(value, StageResult):
            if value.flow_run:
                found.append(value.flow_run)
            return
        if isinstance(value, BaseModel):
            for field in type(value).model_fields:
                visit(getattr(value, field))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(params)
    runs = []
    for flow_run_id in dict.fromkeys(found):
        try:
            producer = client.read_flow_run(flow_run_id)
        except ObjectNotFound:  # a result of a run this server does not know (deleted): no edge to draw
            continue
        if producer.parent_task_run_id is None:
            continue
        stand_in = client.read_task_run(producer.parent_task_run_id)
        if str(stand_in.flow_run_id) == str(parent_flow_run_id):
            runs.append(producer.id)
    return runs


def retry_flow_run(client, flow_run_id, *, message: str = "Retry") -> None:
    """What the UI's Retry button does: put a finished run back to AwaitingRetry (a worker picks it up)."""
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
