"""`dflash run` follows a run's logs on the real Prefect server: a stage that waits for its concurrency slot
is said to wait once, not once per poll of the worker (which logs "Aborted submission ... SCHEDULED" each
time the server keeps the run waiting); a new wait after the run has logged something else is said again.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_launch_follow.py`
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta


def test_a_run_waiting_for_its_slot_is_said_to_wait_once(prefect_server, capsys):
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
        refused = f"Aborted submission of flow run '{run.id}': Server returned a non-pending state 'SCHEDULED'"
        messages = [refused] * 27 + ["Beginning flow run", refused, refused, "Finished in state Completed()"]
        start = datetime.now(UTC)
        client.create_logs([LogCreate(name="prefect.flow_runs.worker", level=20, message=message,
                                      timestamp=start + timedelta(milliseconds=10 * i), flow_run_id=run.id)
                            for i, message in enumerate(messages)])
        client.set_flow_run_state(run.id, Completed(), force=True)
        deadline = time.monotonic() + 30
        while len(client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))) < len(messages):
            assert time.monotonic() < deadline, "the server never listed the logs"
            time.sleep(0.2)
        assert launch._follow(client, run.id, poll_s=0).is_completed()
    printed = [line.split(" | ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    waits = "waiting (SCHEDULED): the server does not let the worker start this run yet"
    assert [line[:len(waits)] if line.startswith("waiting") else line for line in printed] == [
        waits, "Beginning flow run", waits, "Finished in state Completed()"]
    assert not any("Aborted submission" in line for line in printed)
