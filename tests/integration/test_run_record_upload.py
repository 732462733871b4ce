"""A training run's record (run.yaml, provenance.json, metrics.jsonl) reaches the bucket with manifests at
its start and at each checkpoint, through the background uploader: a run killed mid-way is auditable from
S3 alone, and after the run S3's metrics.jsonl equals the local one.

Run: `.venv/bin/python -m pytest tests/integration/test_run_record_upload.py -q`
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dflash_core.layout import DEFAULT_PREFIXES, TRAIN_RUN_FILES, manifest_key, train_report_key
from dflash_core.lineage import read_manifest
from dflash_core.storage import ObjectNotFound, StoreUnavailable, sha256_bytes
from dflash_core.train.checkpoint import latest_checkpoint
from dflash_core.train.config import TrainConfig
from dflash_core.train.uploader import CheckpointUploader
from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, name: str) -> Path:
    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=200, min_len=12, max_len=24)
    path = tmp_path / f"{name}.json"  # JSON is YAML
    path.write_text(json.dumps({
        "run_name": name, "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 100000, "checkpoint_every": 3, "keep_last": 2, "log_every": 1,
        "validate_capture_batches": 0,
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0},
        "optim": {"lr": 1e-2, "warmup_steps": 5}}))
    return path


def _env(tmp_path: Path, settings) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_WORK_DIR": str(tmp_path / "work"),
            "PYTHONPATH": str(REPO),
            "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
            "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
            "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value()}


def _steps(data: bytes) -> list[int]:
    return [json.loads(line)["step"] for line in data.decode().splitlines()]


def _remote(store, key: str) -> bytes | None:
    try:
        return store.get_bytes(key)
    except ObjectNotFound:
        return None


def _assert_stored_with_manifest(store, key: str, data: bytes) -> None:
    assert store.get_bytes(key) == data
    manifest = read_manifest(store, key)
    assert manifest.kind == "report" and manifest.sha256 == sha256_bytes(data) and manifest.bytes == len(data)


def _assert_whole_after_a_kill(store, key: str, data: bytes) -> None:
    """A .jsonl record as a kill -9 can leave it: the object whole (its bytes hash to the sha256 it was stored
    with), and its manifest naming it, or, when the kill fell between the object's put and its manifest's,
    naming the upload before it: a prefix of the object, since the record only grows. The resumed run's
    uploader sees the manifest differ and writes it again (checked after the resume)."""
    assert store.get_bytes(key) == data and store.head(key).sha256 == sha256_bytes(data)
    manifest = read_manifest(store, key)
    assert manifest.kind == "report" and manifest.bytes <= len(data)
    assert manifest.sha256 == sha256_bytes(data[:manifest.bytes]), "the manifest names no upload of this record"


@pytest.mark.slow  # two training processes
def test_a_killed_run_is_auditable_from_the_bucket_and_its_metrics_end_equal(store, settings, tmp_path,
                                                                            monkeypatch) -> None:
    name = f"record-{uuid.uuid4().hex[:8]}"
    config = _config(tmp_path, name)
    run_dir = tmp_path / "runs" / name
    key = {file: train_report_key(settings.s3_prefixes, name, file) for file in TRAIN_RUN_FILES}
    entry = [sys.executable, "-m", "dflash_core.train.entry", "--config", str(config)]
    process = subprocess.Popen(entry, env=_env(tmp_path, settings), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        # Until a checkpoint is saved and the record uploaded after it, manifest and all. The record's upload at
        # start runs when the uploader gets to it, so on a busy machine it alone can already carry step 3, and a
        # kill between that first object's put and its manifest's leaves no manifest yet (a full run did).
        while (max(_steps(_remote(store, key["metrics.jsonl"]) or b""), default=0) < 3
               or not store.exists(manifest_key(key["metrics.jsonl"]))
               or latest_checkpoint(run_dir / "checkpoints") is None):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "metrics.jsonl never reached S3 while the run trained"
            time.sleep(0.2)
    finally:
        process.kill()  # the node is gone, as after kill -9
        process.wait()

    # What the bucket alone says about the run: its config and code as they ran, its metrics so far.
    for file in ("run.yaml", "provenance.json"):
        _assert_stored_with_manifest(store, key[file], (run_dir / file).read_bytes())
    assert json.loads(store.get_bytes(key["provenance.json"]))["versions"]["torch"]
    remote = store.get_bytes(key["metrics.jsonl"])
    _assert_whole_after_a_kill(store, key["metrics.jsonl"], remote)
    assert remote.endswith(b"\n") and (run_dir / "metrics.jsonl").read_bytes().startswith(remote)
    assert _steps(remote)[:3] == [1, 2, 3]

    # Resumed to its end: S3 holds the local record exactly.
    step = int(latest_checkpoint(run_dir / "checkpoints").name.split("-")[1])
    resumed = subprocess.run([*entry, "--resume", "--set", f"max_steps={step + 2}"],
                             env=_env(tmp_path, settings), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for file in TRAIN_RUN_FILES:
        _assert_stored_with_manifest(store, key[file], (run_dir / file).read_bytes())
    assert _steps(store.get_bytes(key["metrics.jsonl"]))[-1] == step + 2

    # The train flow's report writes the same keys last, its manifests naming the final checkpoint.
    import tasks.train as train_tasks

    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_table_artifact", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_tasks, "png_artifact", lambda *args, **kwargs: None)
    final, train_config = str(latest_checkpoint(run_dir / "checkpoints")), TrainConfig.from_yaml(config)
    report = train_tasks.report_training.fn(settings, train_config, checkpoint=final)
    assert report.metrics == store.uri(key["metrics.jsonl"]) and report.run_yaml == store.uri(key["run.yaml"])
    model = store.uri(f"{train_tasks.checkpoint_prefix(settings, train_config, final)}/model.safetensors")
    for file in TRAIN_RUN_FILES:
        _assert_stored_with_manifest(store, key[file], (run_dir / file).read_bytes())
        assert [ref.uri for ref in read_manifest(store, key[file]).inputs] == [model]


class _FlakyStore:
    """The session's store, whose writes fail as in an outage until `failures` of them have."""

    def __init__(self, store, *, failures: int):
        self._store, self.failures = store, failures

    def put_bytes(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("simulated outage")
        return self._store.put_bytes(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_the_record_rides_out_an_outage_and_sends_complete_records_only(store, prefix, tmp_path) -> None:
    prefixes = {kind: f"{prefix}/{folder}" for kind, folder in DEFAULT_PREFIXES.items()}
    files = {train_report_key(prefixes, "r", file): tmp_path / file for file in TRAIN_RUN_FILES}
    key = {path.name: k for k, path in files.items()}
    (tmp_path / "run.yaml").write_text("run_name: r\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # the trainer mid-append
    flaky = _FlakyStore(store, failures=2)
    messages: list[str] = []
    uploader = CheckpointUploader(flaky, root=tmp_path / "checkpoints", key_prefix=f"{prefix}/checkpoints/r",
                                  keep_last=2, run_files=files, backoff_s=(0.2, 0.4), log=messages.append)
    started = time.monotonic()
    uploader.submit_run_files()  # what the trainer calls after a checkpoint: it never waits for S3
    assert time.monotonic() - started < 0.5, "it waited out the backoff (0.2 + 0.4 s)"
    uploader.finish(final=None)
    assert any("upload of the run's record failed (S3 unavailable" in m and "training goes on" in m
               for m in messages), messages
    assert any(m.startswith("S3 is back after") for m in messages), messages
    _assert_stored_with_manifest(store, key["run.yaml"], b"run_name: r\n")
    _assert_stored_with_manifest(store, key["metrics.jsonl"], b'{"step": 1}\n')
    assert not store.exists(key["provenance.json"])  # not written yet: nothing to upload

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "loss": 1.0}\n')
    (tmp_path / "provenance.json").write_text("{}")
    again = CheckpointUploader(store, root=tmp_path / "checkpoints", key_prefix=f"{prefix}/checkpoints/r",
                               keep_last=2, run_files=files, log=messages.append)
    again.finish(final=None)
    assert again.uploaded_run_files == [key["provenance.json"], key["metrics.jsonl"]]  # run.yaml: S3 has it
    _assert_stored_with_manifest(store, key["metrics.jsonl"], (tmp_path / "metrics.jsonl").read_bytes())
