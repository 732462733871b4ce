"""Training under the faults of a real cluster: the S3 server stopped and restarted mid-run, a failed
upload repaired by a rerun, a configuration error failing at once, two runs with one name, the CLI
killed (its child must not live on), debris of interrupted saves and prunes.

Run: `.venv/bin/python -m pytest tests/integration/test_faults.py -q`
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore, sha256_file
from dflash_core.train.checkpoint import _FILES, complete_checkpoints, remove_debris
from dflash_core.train.report import load_metrics
from dflash_core.train.run_lock import RunLock, RunLocked
from dflash_core.train.uploader import remote_checkpoints
from tests.conftest import free_port
from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, name: str, **changes) -> Path:
    shard = tmp_path / "data" / "shard-00000.arrow"
    if not shard.exists():
        synthetic_shard(shard, num_samples=200, min_len=12, max_len=24)
    config = {
        "run_name": name, "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 40, "checkpoint_every": 5, "keep_last": 2, "log_every": 1,
        "upload_checkpoints": False, "validate_capture_batches": 0,
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        **changes,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def _env(tmp_path: Path, settings: Settings | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_WORK_DIR": str(tmp_path / "work"), "PYTHONPATH": str(REPO)}
    if settings is not None:
        env.update({"DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
                    "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
                    "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value()})
    return {**env, **extra}


def _in_process(config_path: Path, **kwargs):
    """A Trainer over the config's shard, read here (what the entry would fetch)."""
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import load_corpus, read_shard_table
    from dflash_core.train.assemble import build_trainer

    config = TrainConfig.model_validate(json.loads(config_path.read_text()))
    corpus = load_corpus([(item, read_shard_table(Path(item))) for item in config.data])
    return build_trainer(config, corpus=corpus, **kwargs)


def _entry(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_core.train.entry", "--config", str(config), *extra]


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    # through a line the trainer is still writing, as the flow's report reads
    return max((record["step"] for record in load_metrics(path).records), default=0)


def _wait(predicate, process: subprocess.Popen | None, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if process is not None and process.poll() is not None:
            pytest.fail(f"process exited ({process.returncode}) before {what}: {process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"not within {timeout_s} s: {what}")


def _assert_s3_holds(store: ObjectStore, prefix: str, root: Path, steps: list[int]) -> None:
    """S3 holds exactly `steps`, each complete with manifests and the local files' sha256."""
    remote = remote_checkpoints(store, prefix)
    assert sorted(remote) == steps, sorted(remote)
    for step in steps:
        assert remote[step].complete(), remote[step].files
        for name in _FILES:
            local = sha256_file(root / f"step-{step:06d}" / name)
            assert store.head(f"{prefix}/step-{step:06d}/{name}").sha256 == local
            manifest = json.loads(store.get_bytes(f"{prefix}/step-{step:06d}/{name}.manifest.json"))
            assert manifest["sha256"] == local and manifest["kind"] == "checkpoint"


@pytest.fixture
def private_s3(tmp_path):
    """A second SeaweedFS of this test's own (the session's server is shared and must stay up)."""
    from dflash_core.services import local

    settings = Settings(
        _env_file=None, s3_endpoint_url=f"http://127.0.0.1:{free_port(grpc_offset=True)}", s3_bucket="outage",
        s3_access_key_id="outage-key", s3_secret_access_key="outage-secret-0123456789", s3_max_attempts=2,
        s3_master_port=free_port(grpc_offset=True), s3_volume_port=free_port(grpc_offset=True),
        s3_filer_port=free_port(grpc_offset=True), s3_admin_port=free_port(grpc_offset=True),
        work_dir=tmp_path / "private-s3")
    service = local.s3_service(settings)
    local.start(service)
    yield settings, service
    local.shutdown(service)


@pytest.mark.slow  # a SeaweedFS of its own and a training process
def test_s3_stopped_and_restarted_mid_run(private_s3, tmp_path) -> None:
    from dflash_core.services import local
    from dflash_core.services.process import stop

    settings, service = private_s3
    config = _config(tmp_path, "outage", upload_checkpoints=True, max_steps=150, checkpoint_every=10)
    run_dir = tmp_path / "runs" / "outage"
    store = ObjectStore.from_settings(settings)
    prefix = "checkpoints/outage"
    process = subprocess.Popen(_entry(config), env=_env(tmp_path, settings, DFLASH_S3_MAX_ATTEMPTS="2",
                                                         DFLASH_S3_OUTAGE_LIMIT_S="120"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    _wait(lambda: any(r.complete() for r in remote_checkpoints(store, prefix).values()), process, timeout_s=120,
          what="a first checkpoint in S3")
    stop(service.record(), timeout_s=0)  # the server dies at once, as in a crash
    stopped_at = _logged_step(run_dir)
    _wait(lambda: any("S3 unavailable" in line for line in lines), None, timeout_s=60,
          what="the uploader noticing the outage")
    _wait(lambda: _logged_step(run_dir) >= min(150, stopped_at + 20), None, timeout_s=60,
          what="training going on while S3 is down")
    down_steps = _logged_step(run_dir) - stopped_at
    local.start(service)
    process.wait(timeout=180)
    reader.join(timeout=10)
    output = "".join(lines)
    assert process.returncode == 0, output[-4000:]
    assert stopped_at < 150 and down_steps >= min(20, 150 - stopped_at), (stopped_at, down_steps)
    assert "training goes on with local checkpoints" in output and "S3 is back after" in output, output[-4000:]
    root = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step-000140", "step-000150"]
    _assert_s3_holds(store, prefix, root, [140, 150])


def test_failed_upload_is_repaired_by_a_rerun_at_max_steps(store, settings, prefix, tmp_path) -> None:
    from dflash_core.lineage import read_manifest

    config_path = _config(tmp_path, "repair", upload_checkpoints=True, max_steps=6, checkpoint_every=2)
    key_prefix = f"{prefix}/checkpoints"
    first = _in_process(config_path, store=store, checkpoint_prefix=key_prefix)
    config = first.config
    first.run()
    first.close()
    root = config.run_dir / "checkpoints"
    _assert_s3_holds(store, key_prefix, root, [4, 6])
    # What a failed upload left: the final step without meta.json, an object without its manifest, a
    # corrupt copy in the older step, and an old step dir S3 kept although the run prunes to 2.
    store.delete_many([f"{key_prefix}/step-000006/meta.json", f"{key_prefix}/step-000006/meta.json.manifest.json",
                       f"{key_prefix}/step-000006/model.safetensors.manifest.json"])
    store.put_bytes(f"{key_prefix}/step-000004/train_state.pt", b"not the checkpoint")
    store.put_bytes(f"{key_prefix}/step-000002/model.safetensors", b"stale")
    second = _in_process(config_path, store=store, checkpoint_prefix=key_prefix)
    assert second.resume() and second.step == 6
    result = second.run()  # already at max_steps: nothing trained, S3 repaired
    second.close()
    assert result.checkpoint == root / "step-000006" and second.uploader.uploaded == [4, 6]
    _assert_s3_holds(store, key_prefix, root, [4, 6])
    assert read_manifest(store, f"{key_prefix}/step-000006/meta.json").sha256 == sha256_file(
        root / "step-000006" / "meta.json")
    from dflash_core.train.entry import _refuse_remote_checkpoints

    with pytest.raises(SystemExit, match=r"already holds checkpoints up to step 6: pass --resume"):
        _refuse_remote_checkpoints(store, key_prefix)  # a fresh run of this name would mix with these


def test_wrong_credentials_fail_the_run_at_once(settings, s3_server, prefix, tmp_path) -> None:
    from dflash_core.train.uploader import CheckpointUploadFailed

    bad = ObjectStore.from_settings(settings.replace(s3_secret_access_key="wrong-secret"))
    trainer = _in_process(_config(tmp_path, "badkey", upload_checkpoints=True, max_steps=400, checkpoint_every=2),
                          store=bad, checkpoint_prefix=f"{prefix}/checkpoints", s3_outage_limit_s=600)
    started = time.monotonic()
    with pytest.raises(CheckpointUploadFailed, match="cannot succeed by retrying.*DFLASH_S3_SECRET_ACCESS_KEY"):
        trainer.run()
    trainer.close()
    assert time.monotonic() - started < 20, "a configuration error is not retried for the outage limit"
    assert trainer.step < 400


@pytest.mark.slow  # three processes: the CLI, its training child, a second run
def test_two_runs_with_one_name_and_the_cli_killed(tmp_path) -> None:
    config = _config(tmp_path, "shared", max_steps=100000, checkpoint_every=1000)
    run_dir = tmp_path / "runs" / "shared"
    cli = subprocess.Popen([sys.executable, "-m", "dflash_core.cli", "train", "--config", str(config)],
                           env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _logged_step(run_dir) >= 2, cli, timeout_s=120, what="the first run's step 2")
        child = RunLock(run_dir).holder()["pid"]
        assert child != cli.pid
        second = subprocess.run(_entry(config, "--resume"), env=_env(tmp_path), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 1
        assert f"run 'shared' is already running as PID {child} on host" in second.stderr, second.stderr[-2000:]
        assert cli.poll() is None and not list((run_dir / "checkpoints").glob(".*")), \
            "the second run touched the first one's run"

        cli.send_signal(signal.SIGKILL)
        cli.wait()
        started = time.monotonic()
        while time.monotonic() - started < 30 and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the training child outlived the killed CLI"
        assert time.monotonic() - started < 30
    finally:
        if cli.poll() is None:
            cli.kill()
    saved = complete_checkpoints(run_dir / "checkpoints")
    assert saved, "the child got SIGTERM from its dying parent and saved a checkpoint"
    # The lock died with its holder. The leader thread shows as a zombie while the process's other
    # threads still finish exiting (they keep the fd table, so the flock, a moment longer): under
    # load that moment has been seen, so give it a few seconds.
    deadline = time.monotonic() + 10
    while True:
        try:
            with RunLock(run_dir):
                break
        except RunLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return ") Z " not in stat


def test_lock_names_the_holder_and_debris_is_removed(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "r"
    with RunLock(run_dir, run_name="r"):
        with pytest.raises(RunLocked, match=rf"run 'r' is already running as PID {os.getpid()} on host "):
            RunLock(run_dir, run_name="r").acquire()
    root = run_dir / "checkpoints"
    complete = root / "step-000004"
    for directory, names in {complete: _FILES, root / "step-000002": ["train_state.pt"],
                             root / ".pruned-step-000001-77": ["model.safetensors"],
                             root / ".step-000006.tmp-99": ["model.safetensors"]}.items():
        directory.mkdir(parents=True)
        for name in names:
            (directory / name).write_text("x")
    assert remove_debris(root) == [".pruned-step-000001-77", ".step-000006.tmp-99", "step-000002"]
    assert [p.name for p in root.iterdir()] == ["step-000004"]


def test_the_train_task_does_not_retry_a_refused_run(tmp_path, monkeypatch) -> None:
    import logging

    import tasks.train as train_tasks
    from dflash_core.train.config import TrainConfig

    config = TrainConfig(target="tiny:llama", data=["shard.arrow"], output_dir=tmp_path)
    refusal = "error: run 'drafter' is already running as PID 7 on host h (lock x): wait for it to finish"
    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_progress_artifact", lambda **kwargs: None)
    monkeypatch.setattr(train_tasks, "training_argv", lambda path, **kwargs: [
        sys.executable, "-c", f"import sys; print({refusal!r}); sys.exit(1)"])
    with pytest.raises(train_tasks.TrainingRefused, match="already running as PID 7") as refused:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)

    class State:
        def result(self):
            raise refused.value

    assert train_tasks.retry_unless_refused(None, None, State()) is False


def test_an_outage_past_the_limit_fails_and_the_backlog_stays_bounded(settings, tmp_path) -> None:
    from dflash_core.train.uploader import CheckpointUploader, CheckpointUploadFailed

    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        (root / f"step-{step:06d}").mkdir(parents=True)
        for name in _FILES:
            (root / f"step-{step:06d}" / name).write_text(f"{step} {name}")
    down = ObjectStore.from_settings(settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                                                      s3_max_attempts=1))
    messages: list[str] = []
    uploader = CheckpointUploader(down, root=root, key_prefix="checkpoints/down", keep_last=2, outage_limit_s=1.5,
                                  backoff_s=(0.1, 0.4), log=messages.append)
    for step in range(1, 6):
        uploader.submit(root / f"step-{step:06d}")
    assert [job.name for job in uploader._jobs if isinstance(job, Path)] == ["step-000004", "step-000005"]
    started = time.monotonic()
    with pytest.raises(CheckpointUploadFailed, match=r"failing for \d+ s, past the outage limit of 2 s.*--resume"):
        uploader.finish(final=root / "step-000005")
    assert 1.0 <= time.monotonic() - started < 10
    assert any("S3 unavailable" in m and "training goes on with local checkpoints" in m for m in messages)
    assert any(m.startswith("behind: 2 checkpoints wait") for m in messages)
