"""The producer of an artifact as seen from inside a Prefect run (flow and task run ids)."""

from __future__ import annotations

from prefect.runtime import flow_run, task_run

from dflash_core.provenance import Producer, current_producer


def run_producer() -> Producer:
    """Git SHA, version and host, plus the current flow run id and task run id when there are any."""
    return current_producer(flow_run_id=_or_none(flow_run.id), task_run_id=_or_none(task_run.id))


def _or_none(value: object) -> str | None:
    return str(value) if value else None


def flow_version() -> str | None:
    """The version every flow and deployment carries: the git SHA of the checkout (None outside git)."""
    from dflash_core.provenance import git_sha

    return git_sha()


def attempt_segments() -> tuple[str, str]:
    """(flow run id, attempt-<n>): the key segments of a run's reports. A Retry reruns the same flow run,
    so the attempt number keeps a failed attempt's evidence beside the retry's."""
    return str(flow_run.id or "local"), f"attempt-{flow_run.run_count or 1}"
