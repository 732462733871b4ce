"""A failed training run is classified by what its ranks printed (config, data, CUDA out of memory, a refusal:
final; anything else transient), only a transient failure is retried, and the rank's own error line leads
the task's and the flow run's message instead of torchrun's ChildFailedError report.

rank_output/ holds real output of `python -m torch.distributed.run --standalone --nproc-per-node N x.py`
(torch 2.13 on this CPU; cuda_oom_h200.txt torch 2.11 on an H200), one child script each:
value_error_two_ranks (2 gloo ranks raise ValueError), gloo_peer_closed (rank 1 exits while rank 0 waits in
an all_reduce), connection_reset (a socket read reset by its peer), sigkill (the rank kills itself with -9),
cuda_oom_h200 (a 160 GiB allocation on a 139 GiB GPU after init_process_group("nccl")).

Run: `.venv/bin/python -m pytest tests/unit/test_rank_failures.py -q -n 0` (the last test starts the Prefect
server, so it is `slow`)
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from pathlib import Path

import pytest

import tasks.train as train_tasks
from dflash_core.train.config import TrainConfig
from dflash_core.train.rank_failure import FailureWatch, RankFailure, error_line
from tests.train_fixtures import synthetic_shard

OUTPUT = Path(__file__).parent / "rank_output"
TAIL = 40  # lines the training task keeps for its message
OUT_OF_RANGE = "target_layer_ids [40] out of range"


def _watched(text: str, returncode: int = 1) -> RankFailure:
    watch = FailureWatch()
    for line in text.splitlines():
        watch.read(line)
    return watch.failure(returncode)


class _State:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def result(self):
        raise self.error


def _retried(error: BaseException) -> bool:
    return train_tasks.retry_unless_refused(None, None, _State(error))


@pytest.mark.parametrize(("name", "kind", "line"), [
    ("value_error_two_ranks.txt", "config",
     "ValueError: target_layer_ids [40] out of range: a 4-layer target can be tapped at native ids 0..2"),
    ("cuda_oom_h200.txt", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 160.00 GiB."),
    ("gloo_peer_closed.txt", "transient", "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
                                          "tcp/pair.cc:553] Connection closed by peer"),
    ("connection_reset.txt", "transient", "ConnectionResetError: [Errno 104] Connection reset by peer"),
    ("sigkill.txt", "transient", "a rank was killed by SIGKILL (signal 9, PID "),
])
def test_real_rank_output_is_classified_by_the_ranks_own_line(name, kind, line) -> None:
    text = (OUTPUT / name).read_text()
    failure = _watched(text)
    assert failure.kind == kind and failure.line.startswith(line), failure
    assert "ChildFailedError" not in failure.line
    assert failure.final is (kind != "transient")


def test_the_ranks_line_is_found_where_torchruns_report_pushed_it_out_of_the_tail() -> None:
    lines = (OUTPUT / "value_error_two_ranks.txt").read_text().splitlines()
    assert not any("ValueError" in line for line in lines[-TAIL:]), "the report alone fills the tail"
    assert _watched("\n".join(lines)).kind == "config"


def test_a_final_kind_on_any_rank_wins_over_the_transient_errors_it_causes() -> None:
    peer_lost = (OUTPUT / "gloo_peer_closed.txt").read_text()
    refused = error_line("data", ValueError("training data refused: 1 of 2 shard(s) did not pass\n- a.arrow: x"))
    failure = _watched(peer_lost + "\n" + refused)
    assert failure == RankFailure("data", "training data refused: 1 of 2 shard(s) did not pass; a.arrow: x")
    assert _watched("error: run 'r' is already running as PID 7") == RankFailure(
        "refused", "run 'r' is already running as PID 7")
    assert _watched("", returncode=-9) == RankFailure("transient", "the training process was killed by signal 9")


@pytest.mark.parametrize(("name", "error", "retried"), [
    ("value_error_two_ranks.txt", train_tasks.TrainingConfigError, False),
    ("cuda_oom_h200.txt", train_tasks.TrainingOutOfMemory, False),
    ("gloo_peer_closed.txt", train_tasks.TrainingFailed, True),
    ("connection_reset.txt", train_tasks.TrainingFailed, True),
    ("sigkill.txt", train_tasks.TrainingFailed, True),
])
def test_the_task_retries_only_a_transient_failure_and_leads_with_the_ranks_line(
        tmp_path, monkeypatch, name, error, retried) -> None:
    """run_training on a process that prints the recorded output and exits 1, as torchrun does."""
    text = (OUTPUT / name).read_text()
    failure = _run_training_on(tmp_path, monkeypatch, text)
    assert type(failure) is error and _retried(failure) is retried
    first_line = str(failure).splitlines()[0]
    assert _watched(text).line in first_line and "ChildFailedError" not in first_line
    if name == "cuda_oom_h200.txt":
        assert first_line.endswith("lower token_budget (or drafter.num_anchors), or use placement=pair or "
                                   "target_fp8 (`dflash plan` says what fits)")
    if retried:
        assert first_line.startswith("training exited with 1: ") and "a retry resumes" in first_line


def _run_training_on(tmp_path: Path, monkeypatch, text: str) -> train_tasks.TrainingFailed:
    script = tmp_path / "torchrun_like.py"
    script.write_text(f"import sys\nsys.stdout.write({text!r})\nsys.exit(1)\n")
    monkeypatch.setattr(train_tasks, "training_argv", lambda path, **kwargs: [sys.executable, str(script)])
    _quiet_task(monkeypatch)
    config = TrainConfig(target="tiny:llama", data=["shard.arrow"], output_dir=tmp_path / "runs")
    with pytest.raises(train_tasks.TrainingFailed) as failed:
        train_tasks.run_training.fn(config, nproc_per_node=2, flow_run_id=None)
    return failed.value


def _quiet_task(monkeypatch) -> None:
    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_progress_artifact", lambda **kwargs: None)
    monkeypatch.setattr(train_tasks, "update_progress_artifact", lambda *args, **kwargs: None)


def test_the_transient_message_keeps_the_log_tail_after_the_ranks_line() -> None:
    failure = train_tasks.training_failure(RankFailure("transient", "ConnectionResetError: reset"), returncode=1,
                                           tail=deque(["step 3/10 loss 1.0", "ChildFailedError: ..."]))
    assert str(failure) == ("training exited with 1: ConnectionResetError: reset; a retry resumes from the last "
                            "checkpoint. Log tail:\nstep 3/10 loss 1.0\nChildFailedError: ...")


def _bad_layer_config(tmp_path: Path) -> dict:
    """A config only a rank can refuse: the tiny target (4 layers) has no layer 40 to tap."""
    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    return {"run_name": "bad-layers", "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
            "token_budget": 96, "max_steps": 2, "upload_checkpoints": False, "validate_capture_batches": 0,
            "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "target_layer_ids": [40]}}


def test_a_real_torchrun_rank_refusing_its_config_is_not_retried(tmp_path, monkeypatch) -> None:
    """One CPU process under the real torchrun: the rank's `error: run config:` line, not torchrun's report."""
    real_argv = train_tasks.training_argv

    def under_torchrun(path, **kwargs):
        entry = real_argv(path, **kwargs)[1:]  # [python, -m, dflash_core.train.entry, ...]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *entry]

    monkeypatch.setattr(train_tasks, "training_argv", under_torchrun)
    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "work"))
    _quiet_task(monkeypatch)
    config = TrainConfig.model_validate(_bad_layer_config(tmp_path))
    with pytest.raises(train_tasks.TrainingConfigError) as refused:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
    message = str(refused.value)
    assert message.startswith(f"run config: {OUT_OF_RANGE}: a "), message
    assert "\n" not in message and _retried(refused.value) is False


def test_the_flow_runs_message_is_the_ranks_own_error_line(prefect_server, env_settings, tmp_path) -> None:
    """The real training flow: its run_training task runs once, and the flow run's message quotes the rank."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.train import TrainFlowParams, train

    state = train(TrainFlowParams(config=_bad_layer_config(tmp_path)), return_state=True)
    assert state.is_failed()
    assert f"TrainingConfigError: run config: {OUT_OF_RANGE}" in state.message, state.message
    assert "ChildFailedError" not in state.message

    async def training_runs():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
            return [r for r in runs if r.name.startswith("run_training")]

    [run] = asyncio.run(training_runs())
    assert run.run_count == 1 and run.state.is_failed(), json.dumps(run.model_dump(mode="json"), default=str)
