"""Prefect retry conditions, one per meaning. A task retries only where a second attempt can pass:
`retry_if(...)` names the failures worth another attempt (an outage), `retry_unless(...)` the ones
that fail the same way again (a refusal, a user error); everything else follows the rule."""

from __future__ import annotations

from collections.abc import Callable

from dflash_core.nodes import NodeUnreachable
from dflash_core.storage import StoreUnavailable

RetryCondition = Callable[..., bool]


def _failure(state) -> BaseException | None:
    try:
        state.result()
    except Exception as error:  # noqa: BLE001 - classified by the caller
        return error
    return None


def retry_if(*transient: type[BaseException]) -> RetryCondition:
    """Retry a failure of one of these types; any other failure is final."""
    def condition(task, task_run, state) -> bool:
        return isinstance(_failure(state), transient)
    condition.__doc__ = f"retry on {', '.join(t.__name__ for t in transient)}; fail at once on anything else"
    return condition


def retry_unless(*final: type[BaseException]) -> RetryCondition:
    """Retry any failure but one of these types (a crash or a preemption may pass next time)."""
    def condition(task, task_run, state) -> bool:
        error = _failure(state)
        return error is not None and not isinstance(error, final)
    condition.__doc__ = f"retry any failure but {', '.join(t.__name__ for t in final)}"
    return condition


# S3 did not answer (down, 5xx, throttled); a configuration error (wrong credentials, missing bucket,
# not an S3 server) or a bug fails at once.
retry_store_outage = retry_if(StoreUnavailable)
# The node or S3 did not answer; a failed command, a refused host key or a refused plan fails at once.
retry_unreachable = retry_if(NodeUnreachable, StoreUnavailable, ConnectionError, TimeoutError)
