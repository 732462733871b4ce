"""A Retry of a generation across nodes first stops the node runs an earlier attempt left running
(flows/generate_nodes.py `stop_earlier_shares`): each is cancelled, and one that no worker ends in time (its node
is gone) is marked Crashed, so no share is answered by its old node and its new one at once. Against the
session's real Prefect server.

Run: `.venv/bin/python -m pytest -q -n 0 tests/integration/test_generate_nodes_retry.py`
"""

from __future__ import annotations

import contextvars
import threading
import time

from prefect import flow


@flow(name="dflash-test-generation-parent")
def _parent() -> None:
    """Never run: its flow stands for the generate run whose Retry stops its earlier node runs."""


def _child(client, parent_run, *, name: str, params: dict, state):
    from prefect import Task

    task = Task(name=f"stage-{name}", fn=lambda: None)
    task_run = client.create_task_run(task=task, flow_run_id=parent_run.id, dynamic_key=name, state=state)
    return client.create_flow_run(_parent, name=name, parameters={"params": params}, parent_task_run_id=task_run.id,
                                  state=state)


def test_a_retry_stops_the_node_runs_an_earlier_attempt_left_running(prefect_server) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Completed, Running

    from flows.generate_nodes import stop_earlier_shares

    share = {"prompt_shards": ["prompts/d/v1/prompts-00000.jsonl"], "node": {"name": "gpu-2"}}
    with get_client(sync_client=True) as client:
        parent = client.create_flow_run(_parent, name="coordinator", state=Running())
        gone = _child(client, parent, name="share-on-a-dead-node", params=share, state=Running())
        alive = _child(client, parent, name="share-on-a-live-node", params=share, state=Running())
        done = _child(client, parent, name="share-finished", params=share, state=Completed())
        provision = _child(client, parent, name="provision-gpu-2", params={"node": {"name": "gpu-2"}}, state=Running())

        def live_worker_cancels() -> None:  # what the live node's worker does with a Cancelling run
            with get_client(sync_client=True) as worker_client:
                deadline = time.monotonic() + 10
                while worker_client.read_flow_run(alive.id).state.name != "Cancelling":
                    assert time.monotonic() < deadline, "the live share was never asked to cancel"
                    time.sleep(0.1)
                worker_client.set_flow_run_state(alive.id, Cancelled(message="killed by its worker"), force=True)

        # Prefect's settings (the session server's URL) live in a context variable: the thread needs a copy
        worker = threading.Thread(target=contextvars.copy_context().run, args=(live_worker_cancels,))
        worker.start()
        stopped = stop_earlier_shares(str(parent.id), timeout_s=3, poll_s=0.2)
        worker.join()
        states = {run.name: client.read_flow_run(run.id).state for run in (gone, alive, done, provision)}
    assert sorted(stopped) == ["share-on-a-dead-node", "share-on-a-live-node"]
    assert states["share-on-a-live-node"].name == "Cancelled"
    assert states["share-on-a-dead-node"].name == "Crashed"
    assert "its node is gone" in states["share-on-a-dead-node"].message
    assert states["share-finished"].name == "Completed"  # finished work is never touched
    assert states["provision-gpu-2"].name == "Running"  # only node shares are stopped
