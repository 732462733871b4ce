"""Fail a flow run with one clear message instead of a traceback.

An expected failure (a quality gate, a stage that failed in its own run) is not a bug: the flow logs
it once, as one error record naming what failed and what to do, and returns a Failed state carrying
the exception (so `state.result()` still raises it). Raising instead would make Prefect log the
traceback in this run and again in every run above it.
"""

from __future__ import annotations

from prefect import get_run_logger
from prefect.states import Failed, State


def fail_run(error: Exception, *, already_logged: bool = False) -> State:
    """The Failed state a flow returns for `error`; logs the message unless its own run did already."""
    if not already_logged:
        get_run_logger().error(str(error))
    return Failed(message=str(error), data=error)
