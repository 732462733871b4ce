"""`dflash run` follows a run's logs on the real Prefect server: a stage that waits for its concurrency slot
is said to wait once, not once per poll of the worker (which logs "submitting flow run" and "Aborted submission ...
SCHEDULED" each time the server keeps the run waiting); a new wait after the run has logged something else is said
again.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_launch_follow.py`
"""

from __future__ import annotations

import io
import time
from contextlib import redirect_stdout
from datetime import UTC, datetime, timedelta


def _followed(messages_of) -> list[str]:
    """What `_follow` prints (less the time and label) of a finished run whose logs are `messages_of(run id)`."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.states import Completed

    from flows import launch

    @flow(name="dflash-follow-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe, name="waiting-run")
        messages = messages_of(run.id)
        start = datetime.now(UTC)
        client.create_logs([LogCreate(name="prefect.flow_runs.worker", level=20, message=message,
                                      timestamp=start + timedelta(milliseconds=10 * i), flow_run_id=run.id)
                            for i, message in enumerate(messages)])
        client.set_flow_run_state(run.id, Completed(), force=True)
        deadline = time.monotonic() + 30
        while len(client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))) < len(messages):
            assert time.monotonic() < deadline, "the server never listed the logs"
            time.sleep(0.2)
        printed = io.StringIO()
        with redirect_stdout(printed):
            assert launch._follow(client, run.id, poll_s=0).is_completed()
    return [line.split(" | ", 1)[1] for line in printed.getvalue().splitlines()]


WAITS = "waiting (SCHEDULED): the server does not let the worker start this run yet"


def _refused(run_id) -> str:
    return f"Aborted submission of flow run '{run_id}': Server returned a non-pending state 'SCHEDULED'"


def _shortened(printed: list[str]) -> list[str]:
    return [line[:len(WAITS)] if line.startswith("waiting") else line for line in printed]


def test_a_run_waiting_for_its_slot_is_said_to_wait_once(prefect_server):
    printed = _followed(lambda run_id: [_refused(run_id)] * 27 + ["Beginning flow run", _refused(run_id),
                                                                 _refused(run_id), "Finished in state Completed()"])
    assert _shortened(printed) == [WAITS, "Beginning flow run", WAITS, "Finished in state Completed()"]
    assert not any("Aborted submission" in line for line in printed)


def test_the_workers_submission_line_of_each_poll_does_not_say_the_wait_again(prefect_server):
    """What a Prefect 3.9 worker logs to a run at each poll while the server keeps it waiting: "submitting", then
    the refusal. The first submission is said, the wait once, and the start after it."""
    def worker_polls(run_id) -> list[str]:
        submitting = f"Worker 'ProcessWorker 1f0e' submitting flow run '{run_id}'"
        return [submitting, _refused(run_id)] * 12 + [submitting, "Opening process...", "Beginning flow run",
                                                      "Finished in state Completed()"]

    printed = _followed(worker_polls)
    assert _shortened(printed) == [printed[0], WAITS, "Opening process...", "Beginning flow run",
                                   "Finished in state Completed()"]
    assert "submitting flow run" in printed[0]
