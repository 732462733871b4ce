"""A full disk at a checkpoint, at the embedded model's conversion or under a download's partial file,
without filling a disk: the writers are patched to fail as they do on a full disk (OSError ENOSPC,
safetensors' error text, torch's errno-less zip-writer RuntimeError). The temp dir (or file) goes at once,
the error names the dir, what the write needs and what is free, and the run ends with an `error:` line
the flow does not retry. (A real full tmpfs under a download: tests/integration/test_download_disk_full.py.)

Run: `.venv/bin/python -m pytest tests/unit/test_disk_full.py -q`
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from dflash_core import embedded
from dflash_core.train import checkpoint as ckpt
from dflash_core.storage import disk as disk_space
from dflash_core.storage.disk import DiskFull, tensor_bytes
from dflash_core.units import binary_bytes
from tests.train_fixtures import synthetic_shard

_DIM = 64
_Usage = namedtuple("_Usage", "total used free")


def _state() -> tuple[dict, dict]:
    model = {"w": torch.ones(_DIM, _DIM), "b": torch.zeros(_DIM)}
    train = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(_DIM, _DIM)}}}, "step": 4}
    return model, train


def _save(root: Path, step: int) -> Path:
    model, train = _state()
    return ckpt.save_checkpoint(root, step=step, model_state=model, train_state=train, meta={}, keep_last=3)


def _free(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: _Usage(10**12, 10**12 - free, free))


def _torch_save_writing(exception: BaseException):
    def save(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 4096)  # the part written before the disk filled
        raise exception
    return save


def _assert_reported(error: DiskFull, root: Path, *, free: int | None = None) -> None:
    model, train = _state()
    message = str(error)
    assert message.startswith("disk full: checkpoint step-000004 needs about "), message
    assert binary_bytes(tensor_bytes(model) + tensor_bytes(train)) in message and str(root) in message, message
    assert free is None or f"and {binary_bytes(free)} are free there" in message, message
    assert "set output_dir to one with room, then rerun with --resume" in message, message
    assert error.errno == errno.ENOSPC and isinstance(error, OSError)


def test_enospc_at_a_checkpoint_removes_its_temp_dir_and_says_why(tmp_path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    kept = _save(root, 2)
    monkeypatch.setattr(ckpt.torch, "save", _torch_save_writing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(DiskFull) as full:
        _save(root, 4)
    assert sorted(p.name for p in root.iterdir()) == [kept.name], "the partial checkpoint stayed on the full disk"
    _assert_reported(full.value, root, free=shutil.disk_usage(root).free)
    assert "the partial .step-000004.tmp-" in str(full.value)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-000002"]


def test_safetensors_disk_full_error_is_recognised(tmp_path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"

    def save_file(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", save_file)
    with pytest.raises(DiskFull) as full:
        _save(root, 4)
    assert list(root.iterdir()) == []
    _assert_reported(full.value, root)


def test_torch_writer_error_counts_as_disk_full_only_when_the_checkpoint_cannot_fit(tmp_path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    cause = RuntimeError("basic_ios::clear: iostream error")
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    short.__context__ = cause
    monkeypatch.setattr(ckpt.torch, "save", _torch_save_writing(short))
    model, train = _state()
    needed = tensor_bytes(model) + tensor_bytes(train)
    calls = iter([needed, needed // 2])  # enough before the write; less than needed once the temp dir is gone
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: _Usage(10**12, 0, next(calls)))
    with pytest.raises(DiskFull) as full:
        _save(root, 4)
    _assert_reported(full.value, root, free=needed // 2)
    assert full.value.__cause__ is short and list(root.iterdir()) == []

    _free(monkeypatch, 10**11)  # room enough: some other failure, re-raised as it was, temp dir gone too
    with pytest.raises(RuntimeError, match="inline_container") as other:
        _save(root, 4)
    assert not isinstance(other.value, DiskFull) and list(root.iterdir()) == []


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    root = tmp_path / "checkpoints"
    _free(monkeypatch, 1000)
    with pytest.raises(DiskFull, match=r"and 1,000 B are free there; nothing was written") as full:
        _save(root, 4)
    _assert_reported(full.value, root, free=1000)
    assert list(root.iterdir()) == []


class _ModelOnAFullDisk:
    """What `_convert_model` saves, with a writer that fails as safetensors does on a full disk."""

    def state_dict(self) -> dict:
        return {"embed": torch.zeros(_DIM, _DIM, dtype=torch.bfloat16)}

    def save_pretrained(self, out_dir, **kwargs) -> None:
        (Path(out_dir) / "model.safetensors").write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_model_conversion_into_a_full_work_dir(tmp_path, monkeypatch) -> None:
    models = tmp_path / "work" / "models"
    monkeypatch.setattr(embedded, "_dequantized_model", _ModelOnAFullDisk)
    with pytest.raises(DiskFull) as full:
        embedded.embedded_model_dir(models)
    message = str(full.value)
    assert message.startswith(f"disk full: the converted embedded model ({embedded.MODEL_DIR_NAME}) needs about "
                              f"{binary_bytes(_DIM * _DIM * 2)} in {models}, and "), message
    assert "are free there; the partial ." in message and "set DFLASH_WORK_DIR to one with room" in message
    assert list(models.iterdir()) == [], "the partial conversion stayed in the work dir"


def test_disk_full_ends_the_run_with_an_error_line_the_flow_does_not_retry(tmp_path, monkeypatch) -> None:
    import tasks.train as train_tasks
    from dflash_core.train import entry
    from dflash_core.train.config import TrainConfig

    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps({
        "run_name": "full", "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 2, "checkpoint_every": 2, "log_every": 1, "upload_checkpoints": False,
        "validate_capture_batches": 0,
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}}))
    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setattr(ckpt.torch, "save", _torch_save_writing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(SystemExit) as stopped:
        entry.main(["--config", str(config_path)])
    line = str(stopped.value.code)
    root = tmp_path / "runs" / "full" / "checkpoints"
    assert line.startswith("error: disk full: checkpoint step-000002 needs about ") and str(root) in line, line
    assert list(root.iterdir()) == []

    # The flow's task: the `error:` line (here followed by what torchrun prints when a rank fails) is a refusal.
    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_progress_artifact", lambda **kwargs: None)
    torchrun_report = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    script = f"import sys; print({line!r}); print({torchrun_report!r}); sys.exit(1)"
    monkeypatch.setattr(train_tasks, "training_argv", lambda path, **kwargs: [sys.executable, "-c", script])
    config = TrainConfig(target="tiny:llama", data=[str(shard)], output_dir=tmp_path / "flow")
    with pytest.raises(train_tasks.TrainingRefused, match="disk full: checkpoint step-000002") as refused:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)

    class State:
        def result(self):
            raise refused.value

    assert train_tasks.retry_unless_refused(None, None, State()) is False


def test_a_partial_file_goes_too(tmp_path) -> None:
    partial = tmp_path / "cache" / ".shard-00000.arrow.x1y2"
    partial.parent.mkdir()
    partial.write_bytes(b"\0" * 4096)  # a download cut short by the full disk
    reported = (r"^disk full: the download of s3://b/k needs about 8\.0 KiB in .*cache, and .* are free "
                r"there; the partial \.shard-00000\.arrow\.x1y2 was removed\. Retry$")
    with pytest.raises(DiskFull, match=reported):
        disk_space.discard_partial_write(OSError(errno.ENOSPC, "No space left on device"), partial=partial,
                                         needed_bytes=8192, what="the download of s3://b/k", advice="Retry")
    assert not partial.exists()
