"""`dflash run` log labels (flows/launch.py): each line names its stage and flow run, and a task's line
(a cache hit's "Finished in state Cached(...)") its task run. Pure formatting: no server."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from flows.launch import log_label, log_line


def test_a_stage_line_names_the_stage_without_the_prefix_and_the_run() -> None:
    assert log_label("dflash-tokenize", "brave-fox") == "tokenize brave-fox"
    assert log_label("dflash-train", "calm-owl") == "train    calm-owl"  # the stage column lines up
    assert log_label("dflash-pipeline", "bold-yak").startswith("pipeline bold-yak")


def test_a_task_line_names_its_task_run() -> None:
    label = log_label("dflash-tokenize", "brave-fox", "tokenize_shard-3a1")
    assert label == "tokenize brave-fox / tokenize_shard-3a1"
    line = log_line(datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), "Finished in state Cached(type=COMPLETED)", label)
    assert line == "03:04:05 tokenize brave-fox / tokenize_shard-3a1 | Finished in state Cached(type=COMPLETED)"


def test_missing_names_still_give_a_label() -> None:
    assert log_label(None, "brave-fox") == "brave-fox"
    assert log_label("dflash-evaluate", None) == "evaluate"
    assert log_label(None, None) == "?"
    assert log_label(None, None, "task run 1a2b3c4d") == "? / task run 1a2b3c4d"
    assert log_label("my-own-flow", "x") == "my-own-flow x"  # a flow not named dflash-...: its full name


@pytest.mark.parametrize("recorded_at_poll", [2, None])
def test_follow_labels_lines_and_waits_for_a_task_run_recorded_late(capsys, recorded_at_poll) -> None:
    """_follow against a stand-in client: the pipeline and one stage; a cache line whose task run the server
    records one poll late is printed once, after the wait, with its task's name and in order; one never
    recorded is printed after `patience` polls with its id, and the follow still ends."""
    from types import SimpleNamespace as NS
    from uuid import uuid4

    from flows import launch

    root, stage, flow_p, flow_t, task = uuid4(), uuid4(), uuid4(), uuid4(), uuid4()
    done = NS(is_final=lambda: True, is_completed=lambda: True)
    t0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    logs = [NS(id=uuid4(), timestamp=t0, flow_run_id=root, task_run_id=None, message="starting"),
            NS(id=uuid4(), timestamp=t0, flow_run_id=stage, task_run_id=task, message="Finished in state Cached()"),
            NS(id=uuid4(), timestamp=t0.replace(second=6), flow_run_id=stage, task_run_id=None, message="done")]

    class Client:
        polls = 0

        def __init__(self):
            self.flow_reads = []

        def read_flow_run(self, run_id):
            self.polls += 1
            return NS(id=root, name="bold-yak", flow_id=flow_p, state=done)

        def read_flow_runs(self, **_):
            return [NS(id=stage, name="brave-fox", flow_id=flow_t)]

        def read_flows(self, *, flow_filter):
            self.flow_reads.append(sorted(map(str, flow_filter.id.any_)))
            names = {flow_p: "dflash-pipeline", flow_t: "dflash-tokenize"}
            return [NS(id=i, name=names[i]) for i in flow_filter.id.any_]

        def read_logs(self, *, log_filter, **_):
            after = log_filter.timestamp.after_
            return [log for log in logs if after is None or log.timestamp >= after]

        def read_task_runs(self, *, task_run_filter):
            recorded = recorded_at_poll is not None and self.polls >= recorded_at_poll
            return [NS(id=task, name="tokenize_shard-3a1")] if recorded else []

    client = Client()
    assert launch._follow(client, root, poll_s=0) is done
    printed = capsys.readouterr().out.splitlines()
    task_label = "tokenize_shard-3a1" if recorded_at_poll else f"task run {str(task)[:8]}"
    assert printed == ["03:04:05 pipeline bold-yak | starting",
                       f"03:04:05 tokenize brave-fox / {task_label} | Finished in state Cached()",
                       "03:04:06 tokenize brave-fox | done"]
    assert client.polls == (2 if recorded_at_poll else 4)  # patience=3 polls of waiting, then printed anyway
    assert len(client.flow_reads) == 1  # flow names read once
