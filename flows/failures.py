"""Fail a flow run with one clear message instead of a traceback.

An expected failure (a quality gate, too many failed prompts, a stage that failed in its own run) is
not a bug: the flow logs it once, as one error record naming what failed and what to do, and returns
a Failed state carrying the exception (so `state.result()` still raises it). Raising instead would make
Prefect log the traceback in this run and again in every run above it.
"""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.states import Failed, State

# What Prefect's engine logs, with the traceback, when a flow run in a worker's subprocess ends failed.
_ENGINE_EXIT_MESSAGE = "Engine execution exited with unexpected exception"
_reported: set[str] = set()


class _DropReportedEngineExit(logging.Filter):
    """Drops the engine's traceback record for a failure this process already reported as one clear error."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.msg == _ENGINE_EXIT_MESSAGE and error is not None and str(error) in _reported)


_FILTER = _DropReportedEngineExit()


def fail_run(error: Exception, *, already_logged: bool = False) -> State:
    """The Failed state a flow returns for `error`; logs the message unless its own run did already."""
    if not already_logged:
        get_run_logger().error(str(error))
    _reported.add(str(error))
    flow_runs = logging.getLogger("prefect.flow_runs")
    if _FILTER not in flow_runs.filters:
        flow_runs.addFilter(_FILTER)
    return Failed(message=str(error), data=error)
