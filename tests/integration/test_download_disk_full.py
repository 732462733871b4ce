"""A download that does not fit on the local disk, against the real SeaweedFS: refused before it starts
when the object is larger than what is free, and, when the disk fills during it, the partial file removed
and one `DiskFull` naming the dir, the size and what is free instead of s3transfer's bare OSError. Training
on an S3 shard that cannot fit ends with the same `error: disk full: ...` line a checkpoint gives.

The disk: a real 64 KiB tmpfs, mounted in a child's own user and mount namespace (`unshare -rm`; skipped
where the kernel refuses one), and, where the write must really start before the disk runs out, the
free-space answer of the check before it faked once. The training test fakes the free space only.

Run: `.venv/bin/python -m pytest tests/integration/test_download_disk_full.py -q -n 0`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import write_artifact
from dflash_core.storage import disk as disk_space
from dflash_core.units import binary_bytes
from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]
_TMPFS_BYTES = 64 * 1024
_OBJECT_BYTES = 256 * 1024

# Run in the child, on the tmpfs: one download refused up front, one whose free-space check is fooled once
# so that the write itself runs out of space.
_CHILD = r"""
import json, sys
from pathlib import Path
from dflash_core.settings import load_settings
from dflash_core.storage import ObjectStore
from dflash_core.storage import disk as disk_space

key, disk = sys.argv[1], Path(sys.argv[2])
store = ObjectStore.from_settings(load_settings())
real_free = disk_space.free_bytes
report = {}

def attempt(case):
    try:
        store.get_file(key, disk / case / "big.bin")
        report[case] = {"error": None}
    except Exception as error:
        report[case] = {"error": str(error), "type": type(error).__name__,
                        "errno": getattr(error, "errno", None),
                        "cause": type(error.__cause__).__name__ if error.__cause__ else None,
                        "left": sorted(p.name for p in (disk / case).iterdir())}

attempt("refused")
answers = iter([1 << 40])  # the check before the download sees room enough, every later look the truth
disk_space.free_bytes = lambda directory: next(answers, None) or real_free(directory)
attempt("ran-out")
print(json.dumps(report))
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="no user and mount namespace for a tmpfs (unshare -rm)")
def test_a_download_into_a_full_tmpfs_is_refused_or_cleaned_up_with_a_named_error(store, settings, prefix,
                                                                                   tmp_path) -> None:
    key = f"{prefix}/big.bin"
    store.put_bytes(key, os.urandom(_OBJECT_BYTES))
    disk = tmp_path / "small-disk"
    disk.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url,
           "DFLASH_S3_BUCKET": settings.s3_bucket,
           "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
           "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value(),
           "DFLASH_S3_MAX_ATTEMPTS": "1", "DFLASH_WORK_DIR": str(tmp_path / "work")}
    mount = f'mount -t tmpfs -o size={_TMPFS_BYTES} tmpfs "$0" && exec "$1" -c "$2" "$3" "$0"'
    child = subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(disk), sys.executable, _CHILD, key],
                           env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    needs = f"disk full: the download of {store.uri(key)} needs about {binary_bytes(_OBJECT_BYTES)} in {disk}"

    refused = report["refused"]
    assert refused["type"] == "DiskFull" and refused["left"] == [], refused
    assert refused["error"].startswith(f"{needs}/refused, and "), refused
    assert "are free there; nothing was written. Free space there, or download to a disk with room" \
        in refused["error"], refused

    ran_out = report["ran-out"]  # the real ENOSPC of the tmpfs, mid-download
    assert ran_out["type"] == "DiskFull" and ran_out["errno"] == 28 and ran_out["cause"] is not None, ran_out
    assert ran_out["left"] == [], f"the partial download stayed on the full disk: {ran_out}"
    assert ran_out["error"].startswith(f"{needs}/ran-out, and "), ran_out
    assert "are free there; the partial .big.bin." in ran_out["error"], ran_out
    assert " was removed. Free space there" in ran_out["error"], ran_out


def test_a_shard_that_cannot_fit_ends_the_run_with_a_disk_full_line(store, env_settings, prefix, tmp_path,
                                                                      monkeypatch) -> None:
    from dflash_core.train import entry

    shard = synthetic_shard(tmp_path / "src" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    key = f"{prefix}/tokenized/shard-00000.arrow"
    write_artifact(store, key, shard, kind=ArtifactKind.TOKENIZED)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({
        "run_name": "full-cache", "target": "tiny:llama", "data": [key], "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 1, "checkpoint_every": 1, "upload_checkpoints": False,
        "validate_capture_batches": 0, "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8,
                                                   "loss_gamma": 4.0}}))
    monkeypatch.setattr(disk_space, "free_bytes", lambda directory: 1000)  # the injected free-space answer
    with pytest.raises(SystemExit) as stopped:
        entry.main(["--config", str(config)])
    line = str(stopped.value.code)
    cache = tmp_path / "runs" / ".cache" / key
    size = binary_bytes(shard.stat().st_size)
    assert line == (f"error: disk full: the download of {store.uri(key)} needs about {size} in "
                    f"{cache.parent}, and 1,000 B are free there; nothing was written. Free space there, or "
                    "download to a disk with room, then retry"), line
    assert not cache.parent.exists() or list(cache.parent.iterdir()) == []
