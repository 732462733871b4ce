"""A run resumed from S3 on a fresh machine (no local run dir) keeps its metrics.jsonl whole, each step
once, locally and in the bucket: the log starts from S3's copy cut at the resumed step, and the
uploader replaces S3's copy with it. On the real S3 server, with the real trainer on CPU.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_metrics_resume.py`
"""

from __future__ import annotations

import json
import shutil
import uuid

from dflash_core.layout import DEFAULT_PREFIXES, checkpoints_key, train_report_key
from dflash_core.train.assemble import build_trainer
from tests.unit.test_trainer import tiny_config


def _steps(data: bytes) -> list[int]:
    return [json.loads(line)["step"] for line in data.decode().splitlines()]


def test_a_run_resumed_from_s3_logs_each_step_once_locally_and_in_s3(store, tmp_path):
    name = f"metrics-{uuid.uuid4().hex[:8]}"
    config = tiny_config(tmp_path, run_name=name, max_steps=6, log_every=1, checkpoint_every=2, keep_last=3,
                         upload_checkpoints=True)
    key = train_report_key(DEFAULT_PREFIXES, name, "metrics.jsonl")
    first = build_trainer(config, store=store)
    first.run()
    first.close()
    assert _steps(store.get_bytes(key)) == [1, 2, 3, 4, 5, 6]

    # A fresh machine, and the last checkpoint never reached S3: the run resumes at step 4 from the bucket.
    shutil.rmtree(config.run_dir)
    store.delete_many([info.key for info in store.list(f"{checkpoints_key(DEFAULT_PREFIXES, name)}/step-000006/")])
    resumed = build_trainer(config, store=store)
    assert resumed.resume() and resumed.step == 4
    result = resumed.run()
    resumed.close()
    assert _steps(result.metrics_path.read_bytes()) == [1, 2, 3, 4, 5, 6]
    assert store.get_bytes(key) == result.metrics_path.read_bytes()
