"""A full disk under a training run's own files (the run record run.yaml and provenance.json, metrics.jsonl):
the run ends with the `error: disk full: ...` line a checkpoint gives, which the training task does not
retry, and leaves no partial file (no 0-byte provenance.json, no torn metrics line, no temp file).

The disk: a real tmpfs per case as the run's output_dir, mounted in a child's own user and mount namespace
(`unshare -rm`; skipped where the kernel refuses one), filled but for a few pages before the real training
task starts the real entry on a tiny target. What each page holds, in order: the task's run.yaml, the run's
.lock, the entry's run.yaml (a temp file renamed over the task's), provenance.json, then metrics.jsonl.

Run: `.venv/bin/python -m pytest tests/integration/test_run_record_disk_full.py -q -n 0`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]
_TMPFS_BYTES = 256 * 1024
# Free pages left on each case's disk before the task starts: none (the task's own run.yaml), two (the
# entry's run record), four (metrics.jsonl's first page fills after a few steps).
_CASES = {"task-run-yaml": 0, "run-record": 2, "metrics": 4}

_CHILD = r"""
import json, logging, os, sys
from pathlib import Path
import tasks.train as train_tasks
from dflash_core.train.config import TrainConfig

config_json, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
train_tasks.get_run_logger = lambda: logging.getLogger("child")
train_tasks.create_progress_artifact = lambda **kwargs: None
train_tasks.update_progress_artifact = lambda *args, **kwargs: None

class State:
    def __init__(self, error):
        self.error = error
    def result(self):
        raise self.error

def fill(disk, free_pages):
    page = os.statvfs(disk).f_bsize
    filler = os.statvfs(disk).f_bavail * page - free_pages * page
    (disk / "filler").write_bytes(b"\0" * filler)

report = {}
for case, (disk, free_pages) in cases.items():
    disk = Path(disk)
    fill(disk, free_pages)
    config = TrainConfig.model_validate({**config_json, "output_dir": str(disk)})
    try:
        train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None)
        error = None
    except Exception as caught:
        error = caught
    files = {p.name: p.stat().st_size for p in config.run_dir.iterdir()} if config.run_dir.exists() else {}
    metrics = (config.run_dir / "metrics.jsonl").read_bytes() if "metrics.jsonl" in files else b""
    report[case] = {
        "type": type(error).__name__ if error else None, "error": str(error).splitlines()[0] if error else None,
        "retried": train_tasks.retry_unless_refused(None, None, State(error)) if error else None,
        "files": files, "run_dir": str(config.run_dir),
        "metrics_whole": metrics.endswith(b"\n") and all(json.loads(l) for l in metrics.splitlines()),
        "metrics_lines": len(metrics.splitlines())}
print(json.dumps(report))
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Every case, in one child that mounts a tmpfs per case."""
    root = tmp_path_factory.mktemp("run-record-disk-full")
    shard = synthetic_shard(root / "data" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    config = {"run_name": "full", "target": "tiny:llama", "data": [str(shard)], "token_budget": 96,
              "max_steps": 30, "checkpoint_every": 30, "log_every": 1, "upload_checkpoints": False,
              "validate_capture_batches": 0,
              "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}}
    disks = {case: root / case for case in _CASES}
    for disk in disks.values():
        disk.mkdir()
    mounts = " && ".join(f'mount -t tmpfs -o size={_TMPFS_BYTES} tmpfs "{disk}"' for disk in disks.values())
    cases = {case: (str(disk), _CASES[case]) for case, disk in disks.items()}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DFLASH_WORK_DIR": str(root / "work")}
    child = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mounts} && exec "$0" -c "$1" "$2" "$3"',
                            sys.executable, _CHILD, json.dumps(config), json.dumps(cases)],
                           env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not _unshare_works(), reason="no user and mount namespace for a tmpfs (unshare -rm)")
_ADVICE = ("Free space on that disk or set output_dir to one with room, then rerun with --resume (the last "
           "complete checkpoint is intact)")


def test_a_full_disk_at_the_run_record_is_a_named_refusal_without_a_partial_file(report) -> None:
    case = report["run-record"]
    assert case["type"] == "TrainingRefused" and case["retried"] is False, case
    assert case["error"].startswith(f"disk full: the run record run.yaml needs about "), case
    assert f"in {case['run_dir']}, and 0 B are free there; the partial .run.yaml." in case["error"], case
    assert case["error"].endswith(f" was removed. {_ADVICE}"), case
    assert sorted(case["files"]) == [".lock", "run.yaml"], f"debris of the run record: {case['files']}"
    assert case["files"]["run.yaml"] > 0


def test_a_full_disk_at_a_metrics_record_is_a_named_refusal_with_whole_lines_left(report) -> None:
    case = report["metrics"]
    assert case["type"] == "TrainingRefused" and case["retried"] is False, case
    step = case["metrics_lines"] + 1
    assert case["error"].startswith(f"disk full: the metrics record of step {step} needs about "), case
    assert f"in {case['run_dir']}, and " in case["error"] and f"nothing was written. {_ADVICE}" in case["error"]
    assert case["metrics_lines"] >= 1 and case["metrics_whole"], case
    assert sorted(case["files"]) == [".lock", "metrics.jsonl", "provenance.json", "run.yaml"], case["files"]
    assert case["files"]["provenance.json"] > 0


def test_a_full_disk_at_the_tasks_own_run_yaml_is_not_retried(report) -> None:
    case = report["task-run-yaml"]
    assert case["type"] == "DiskFull" and case["retried"] is False, case
    assert case["error"].startswith(f"disk full: the run config run.yaml needs about "), case
    assert case["files"] == {}, f"debris of the task's run.yaml: {case['files']}"
