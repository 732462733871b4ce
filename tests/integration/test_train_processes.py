"""Training as real processes: kill -9 and resume bit-identically, SIGTERM saves and exits 143,
and 2-process gloo DDP equals 1 process with the same global batch. All `slow`: each training
process costs seconds of imports.

Run: `.venv/bin/python -m pytest tests/integration/test_train_processes.py -q`
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_core.train.checkpoint import latest_checkpoint, load_checkpoint
from dflash_core.train.report import load_metrics
from tests.train_fixtures import synthetic_shard

VENV_BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, name: str, **changes) -> Path:
    shard = tmp_path / "data" / "shard-00000.arrow"
    if not shard.exists():
        synthetic_shard(shard, num_samples=300, min_len=12, max_len=24)
    config = {
        "run_name": name, "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 20, "checkpoint_every": 10, "keep_last": 5, "log_every": 1,
        "upload_checkpoints": False, "validate_capture_batches": 1,
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        **changes,
    }
    path = tmp_path / f"{name}.json"  # JSON is YAML
    path.write_text(json.dumps(config))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_WORK_DIR": str(tmp_path / "work"),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _train(config: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_core.train.entry", "--config", str(config), *extra],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a crash and after resume) keeps the last value. A line
    being written (or cut short by the kill) is skipped, as the flow's report skips it."""
    return {r["step"]: r["loss"] for r in load_metrics(run_dir / "metrics.jsonl").records}


def _start(config: Path, tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_core.train.entry", "--config", str(config), *extra],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(_losses(run_dir), default=0) >= step:
            return
        if process.poll() is not None:
            pytest.fail(f"training exited early: {process.stdout.read()}")
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout_s} s")


def test_kill_9_then_resume_is_bit_identical(tmp_path) -> None:
    straight = _train(_config(tmp_path, "straight"), tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = _losses(tmp_path / "runs" / "straight")
    assert sorted(expected) == list(range(1, 21))

    config = _config(tmp_path, "killed")
    process = _start(config, tmp_path)
    _wait_for_step(tmp_path / "runs" / "killed", 13, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert latest_checkpoint(tmp_path / "runs" / "killed" / "checkpoints").name == "step-000010"
    resumed = _train(config, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(tmp_path / "runs" / "killed") == expected, "losses after resume differ"
    final_a, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "straight" / "checkpoints"))
    final_b, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "killed" / "checkpoints"))
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_sigterm_saves_and_exits_143(tmp_path) -> None:
    config = _config(tmp_path, "stopped", max_steps=100000, checkpoint_every=1000)
    process = _start(config, tmp_path)
    _wait_for_step(tmp_path / "runs" / "stopped", 5, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143
    saved = latest_checkpoint(tmp_path / "runs" / "stopped" / "checkpoints")
    assert saved is not None and int(saved.name.split("-")[1]) >= 5
    assert (tmp_path / "runs" / "stopped" / "run.yaml").exists()
    provenance = json.loads((tmp_path / "runs" / "stopped" / "provenance.json").read_text())
    assert provenance["versions"]["torch"].startswith("2.") and provenance["argv"]
    fresh = _train(config, tmp_path)  # no --resume on a run that has checkpoints: refused, nothing pruned
    assert fresh.returncode != 0 and "pass --resume" in fresh.stderr
    assert latest_checkpoint(tmp_path / "runs" / "stopped" / "checkpoints") == saved


def test_sigterm_under_ddp_stops_every_rank_with_a_checkpoint(tmp_path) -> None:
    config = _config(tmp_path, "ddp-stopped", max_steps=100000, checkpoint_every=1000)
    process = subprocess.Popen([str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                                "-m", "dflash_core.train.entry", "--config", str(config)],
                               env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    _wait_for_step(tmp_path / "runs" / "ddp-stopped", 3, process)
    os.killpg(process.pid, signal.SIGTERM)  # as a scheduler would: every rank, at slightly different times
    process.wait(timeout=60)
    saved = latest_checkpoint(tmp_path / "runs" / "ddp-stopped" / "checkpoints")
    assert saved is not None and int(saved.name.split("-")[1]) >= 3


def test_two_process_ddp_equals_one_process(tmp_path) -> None:
    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig

    # The one-process reference (2 micro-batches a step) trains here: a process start less.
    single_config = _config(tmp_path, "single", max_steps=6, checkpoint_every=6,
                            optim={"lr": 1e-2, "warmup_steps": 5, "grad_accum": 2})
    single = build_trainer(TrainConfig.model_validate(json.loads(single_config.read_text())))
    single.validate_capture()
    single.run()
    single.close()
    ddp_config = _config(tmp_path, "ddp", max_steps=6, checkpoint_every=6)
    ddp = subprocess.run([str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                          "-m", "dflash_core.train.entry", "--config", str(ddp_config)],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    weights_single, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "single" / "checkpoints"))
    weights_ddp, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "ddp" / "checkpoints"))
    for name, tensor in weights_single.items():
        torch.testing.assert_close(weights_ddp[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
