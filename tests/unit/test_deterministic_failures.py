"""Failures a retry repeats are not retried: a shard whose token ids the target's vocabulary does not have is
refused by name before the first step, and an error that recurs at the same step after a resume from the
last checkpoint ends the training task instead of being retried again. The runs are real (tiny target, the
real entry as a child process of the real training task); only the recurring fault is injected.

Run: `.venv/bin/python -m pytest tests/unit/test_deterministic_failures.py -q -n 0`
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tasks.train as train_tasks
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import read_shard_table
from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]
TINY_VOCAB = 256  # tiny_target_config's vocabulary


def _config(tmp_path: Path, shard: Path, **changes) -> dict:
    return {"run_name": "det", "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
            "token_budget": 96, "max_steps": 6, "checkpoint_every": 2, "log_every": 1, "upload_checkpoints": False,
            "validate_capture_batches": 0,
            "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}, **changes}


def _quiet_task(monkeypatch) -> None:
    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_progress_artifact", lambda **kwargs: None)
    monkeypatch.setattr(train_tasks, "update_progress_artifact", lambda *args, **kwargs: None)


class _State:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def result(self):
        raise self.error


def _retried(error: BaseException) -> bool:
    return train_tasks.retry_unless_refused(None, None, _State(error))


def test_a_shard_beyond_the_targets_vocabulary_is_refused_by_name_and_not_retried(tmp_path, monkeypatch) -> None:
    good = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    other = synthetic_shard(tmp_path / "data" / "shard-00001.arrow", num_samples=40, min_len=12, max_len=24,
                            vocab=1000, seed=1)  # tokenized with another tokenizer: ids up to 999
    largest = int(np.max(read_shard_table(other)["input_ids"].combine_chunks().values.to_numpy()))
    assert largest >= TINY_VOCAB
    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "work"))
    _quiet_task(monkeypatch)
    config = TrainConfig.model_validate(_config(tmp_path, good) | {"data": [str(good), str(other)]})
    with pytest.raises(train_tasks.TrainingFailed) as refused:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
    message = str(refused.value)
    assert type(refused.value) is train_tasks.TrainingDataError and not _retried(refused.value), message
    assert message.startswith(f"training data refused: {other}: token ids up to {largest}, but the target "
                              f"tiny:llama has a vocabulary of {TINY_VOCAB} (ids 0..{TINY_VOCAB - 1})"), message
    assert "tokenize it with the target's tokenizer" in message and str(good) not in message, message
    assert not (tmp_path / "runs" / "det" / "checkpoints").exists() or \
        not list((tmp_path / "runs" / "det" / "checkpoints").iterdir()), "a step ran before the refusal"


# The real entry, with one fault injected: the optimizer step after `fail_after` completed steps raises the
# IndexError an out-of-range embedding lookup raises, every time that step runs.
_FAILING_ENTRY = r"""
import sys
from dflash_core.train import entry, strategies

fail_after = int(sys.argv[1])
real_step = strategies.PlainSteps.step

def step(self, index, timing):
    if index == fail_after:
        raise IndexError("index out of range in self")
    return real_step(self, index, timing)

strategies.PlainSteps.step = step
sys.exit(entry.main(sys.argv[2:]))
"""


def test_an_error_at_the_same_step_after_a_resume_is_final(tmp_path, monkeypatch) -> None:
    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    script = tmp_path / "failing_entry.py"
    script.write_text(_FAILING_ENTRY)
    real_argv = train_tasks.training_argv
    monkeypatch.setattr(train_tasks, "training_argv", lambda path, **kwargs: [
        sys.executable, str(script), "3", *real_argv(path, **kwargs)[3:]])  # [python, -m, <entry>, args...]
    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    _quiet_task(monkeypatch)
    config = TrainConfig.model_validate(_config(tmp_path, shard))

    with pytest.raises(train_tasks.TrainingFailed) as first:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
    assert type(first.value) is train_tasks.TrainingFailed and _retried(first.value), str(first.value)
    assert "IndexError: index out of range in self" in str(first.value).splitlines()[0]
    assert "at step 4" in str(first.value).splitlines()[0], str(first.value)
    checkpoints = config.run_dir / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-000002"]

    with pytest.raises(train_tasks.TrainingFailed) as again:  # Prefect's retry: the same task, resuming
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
    message = str(again.value)
    assert isinstance(again.value, train_tasks.TrainingFailureRecurred) and not _retried(again.value), message
    assert message.startswith("IndexError: index out of range in self at step 4 again, after resuming from the "
                              "last checkpoint: the same error at the same step is not transient, so it is not "
                              "retried"), message


def test_a_different_step_or_error_after_a_resume_is_still_retried(tmp_path, monkeypatch) -> None:
    from dflash_core.train.rank_failure import failed_at_step_line

    config = TrainConfig(target="tiny:llama", data=["shard.arrow"], output_dir=tmp_path / "runs")
    script = tmp_path / "torchrun_like.py"
    monkeypatch.setattr(train_tasks, "training_argv", lambda path, **kwargs: [sys.executable, str(script)])
    _quiet_task(monkeypatch)

    def fails(step: int, error: str) -> train_tasks.TrainingFailed:
        output = f"{failed_at_step_line(step)}\nTraceback (most recent call last):\n  File \"x\"\n{error}\n"
        script.write_text(f"import sys\nsys.stdout.write({output!r})\nsys.exit(1)\n")
        with pytest.raises(train_tasks.TrainingFailed) as failed:
            train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
        return failed.value

    reset = "ConnectionResetError: [Errno 104] Connection reset by peer"
    assert _retried(fails(7, reset))
    assert _retried(fails(9, reset))  # further on: the resume made progress
    assert _retried(fails(9, "RuntimeError: Connection closed by peer"))
    assert not _retried(fails(9, "RuntimeError: Connection closed by peer"))
    assert json.loads((config.run_dir / train_tasks.FAILURE_RECORD).read_text())["step"] == 9

    script.write_text("print('{\"final_step\": 9}')\n")  # a run that ends well forgets the failure
    monkeypatch.setattr("dflash_core.train.checkpoint.latest_checkpoint", lambda root: root / "step-000009")
    train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
    assert not (config.run_dir / train_tasks.FAILURE_RECORD).exists()
    assert _retried(fails(9, reset))
