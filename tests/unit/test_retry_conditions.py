"""Each retry condition retries exactly the failures its name says, on real Prefect states."""

from __future__ import annotations

import pytest
from prefect.states import Completed, Failed

from dflash_core.nodes import NodeUnreachable
from dflash_core.storage import StoreError, StoreUnavailable
from dflash_core.tokenize.shard import TemplateFailed
from tasks.evaluate import retry_unless_user_error
from tasks.retry import retry_if, retry_store_outage, retry_unless, retry_unreachable
from tasks.tokenize import retry_unless_the_shard_fails_again
from tasks.train import (TrainingConfigError, TrainingDataError, TrainingFailed, TrainingOutOfMemory,
                         TrainingRefused, retry_unless_refused)



def _failed(error: BaseException):
    return Failed(data=error)


@pytest.mark.parametrize(("condition", "error", "retried"), [
    (retry_store_outage, StoreUnavailable("s3 down"), True),
    (retry_store_outage, StoreError("wrong credentials"), False),
    (retry_store_outage, ConnectionError("reset"), False),
    (retry_unreachable, NodeUnreachable("ssh timed out"), True),
    (retry_unreachable, StoreUnavailable("s3 down"), True),
    (retry_unreachable, TimeoutError(), True),
    (retry_unreachable, RuntimeError("command failed"), False),
    (retry_unless_user_error, ValueError("no such prompts file"), False),
    (retry_unless_user_error, RuntimeError("server died"), True),
    (retry_unless_refused, TrainingRefused("the run is already running"), False),
    (retry_unless_refused, RuntimeError("killed"), True),
    (retry_unless_refused, TrainingConfigError("run config: target_layer_ids [40] out of range"), False),
    (retry_unless_refused, TrainingDataError("training data refused: 1 of 1 shard(s)"), False),
    (retry_unless_refused, TrainingOutOfMemory("torch.OutOfMemoryError: CUDA out of memory."), False),
    (retry_unless_refused, TrainingFailed("ConnectionResetError: [Errno 104] Connection reset by peer"), True),
    (retry_unless_the_shard_fails_again, TemplateFailed("no chat template"), False),
    (retry_unless_the_shard_fails_again, StoreUnavailable("s3 down"), True),
])
def test_a_condition_retries_what_its_name_says(condition, error, retried) -> None:
    assert condition(None, None, _failed(error)) is retried


def test_a_completed_state_is_never_retried() -> None:
    for condition in (retry_if(ValueError), retry_unless(ValueError)):
        assert condition(None, None, Completed(data=1)) is False
