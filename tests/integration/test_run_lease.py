"""One live run per run name across hosts, on the real SeaweedFS: the conditional writes the lease
relies on, a second "host" (another output dir, another DFLASH_HOST_NAME) refused while the first
trains, the lease released at the first's SIGTERM exit, a stale lease taken over with its old owner
named (never before the owner's own stale time), a dead PID's lease taken over at once only when it is of
this very boot and PID namespace.
What a lease does when its owner is cut off from the bucket: test_run_lease_outage.py.

Run: `.venv/bin/python -m pytest tests/integration/test_run_lease.py -q`
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from dflash_core.layout import run_lease_key
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from dflash_core.train.report import load_metrics
from dflash_core.train.run_lease import RunLease, RunLeaseHeld, RunLeaseLost
from tests.conftest import free_port
from tests.train_fixtures import synthetic_shard

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, name: str, output_dir: Path, **changes) -> Path:
    shard = tmp_path / "data" / "shard-00000.arrow"
    if not shard.exists():
        synthetic_shard(shard, num_samples=200, min_len=12, max_len=24)
    config = {
        "run_name": name, "target": "tiny:llama", "data": [str(shard)], "output_dir": str(output_dir),
        "token_budget": 96, "max_steps": 100000, "checkpoint_every": 2, "keep_last": 2, "log_every": 1,
        "upload_checkpoints": True, "validate_capture_batches": 0,
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        **changes,
    }
    path = output_dir.parent / f"{output_dir.name}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def _env(tmp_path: Path, settings: Settings, host: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DFLASH_HOST_NAME": host,
            "DFLASH_WORK_DIR": str(tmp_path / f"work-{host}"),
            "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
            "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
            "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value()}


def _entry(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_core.train.entry", "--config", str(config), *extra]


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in load_metrics(path).records), default=0) if path.exists() else 0


def test_seaweedfs_honours_the_conditional_writes_the_lease_uses(store: ObjectStore, prefix: str) -> None:
    client, bucket, key = store.client, store.bucket, f"{prefix}/lease.json"
    first = client.put_object(Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError) as exists:
        client.put_object(Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
    assert exists.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    client.put_object(Bucket=bucket, Key=key, Body=b"3", IfMatch=first)
    with pytest.raises(ClientError) as stale:
        client.put_object(Bucket=bucket, Key=key, Body=b"4", IfMatch=first)  # overwritten since
    assert stale.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(ClientError):
        client.delete_object(Bucket=bucket, Key=key, IfMatch=first)
    assert store.get_bytes(key, verify=False) == b"3"


def test_a_second_host_is_refused_while_the_first_trains(store, settings, tmp_path) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    key = run_lease_key(settings.s3_prefixes, name)
    first_config = _config(tmp_path, name, tmp_path / "host-a" / "runs")
    second_config = _config(tmp_path, name, tmp_path / "host-b" / "runs")
    first = subprocess.Popen(_entry(first_config, "--resume"), env=_env(tmp_path, settings, "host-a"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_a = tmp_path / "host-a" / "runs" / name
    try:
        deadline = time.monotonic() + 120
        while _logged_step(run_a) < 3:  # step 2's checkpoint is on its way to S3
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the first run did not reach step 3"
            time.sleep(0.1)
        holder = json.loads(store.get_bytes(key))
        assert (holder["host"], holder["pid"]) == ("host-a", first.pid)

        second = subprocess.run(_entry(second_config, "--resume"), env=_env(tmp_path, settings, "host-b"),
                                capture_output=True, text=True, timeout=120)
        last = second.stderr.strip().splitlines()[-1]
        assert second.returncode == 1, second.stderr[-3000:]
        assert last.startswith(f"error: run {name!r} is already running as PID {first.pid} on host host-a"), last
        for part in ("started 20", "last heartbeat 20", "s ago by the S3 server's clock", store.uri(key),
                     "Wait for it to finish, choose another run_name, or, if that run is gone, delete"):
            assert part in last, (part, last)
        run_b = tmp_path / "host-b" / "runs" / name
        assert not (run_b / "checkpoints").exists() or not any((run_b / "checkpoints").iterdir()), \
            "the refused run touched a checkpoint"
        assert json.loads(store.get_bytes(key))["owner"] == holder["owner"], "the refused run changed the lease"

        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=120)[0]
        assert first.returncode == 143, output[-3000:]
        assert not store.exists(key), "the lease outlived its run's SIGTERM exit"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def quick_store(settings: Settings, *, endpoint_url: str | None = None, connect_s: float = 0.5, read_s: float = 1.5,
                retries: int = 1) -> ObjectStore:
    """The bucket (through `endpoint_url`, default the server itself) with timeouts short enough for a lease of
    a few seconds to let its writes out (they must land before it may be taken over); built like
    `ObjectStore.from_settings`'s, so a fenced view asks its guard before each attempt."""
    url = endpoint_url or settings.s3_endpoint_url

    def client():
        config = Config(region_name=settings.s3_region, connect_timeout=connect_s, read_timeout=read_s,
                        retries={"max_attempts": retries, "mode": "standard"}, s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        return boto3.client("s3", endpoint_url=url, config=config,
                            aws_access_key_id=settings.s3_access_key_id.get_secret_value(),
                            aws_secret_access_key=settings.s3_secret_access_key.get_secret_value())

    return ObjectStore(client(), settings.s3_bucket, endpoint_url=url, client_factory=client)


def _lease(store: ObjectStore, key: str, host: str, messages: list[str], **kwargs) -> RunLease:
    return RunLease(store, key, run_name="r", run_dir=Path(f"/runs/{host}/r"), host=host, log=messages.append,
                    **kwargs)


def _stop_beating(lease: RunLease) -> None:
    """The owner stops renewing without releasing: killed, or frozen."""
    lease._stop.set()
    for thread in lease._threads:
        thread.join()



def test_a_fresh_lease_is_kept_and_a_stale_one_taken_over(store, prefix) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    timing = {"heartbeat_every_s": 0.3, "stale_after_s": 3.0}
    a_log: list[str] = []
    b_log: list[str] = []
    a = _lease(store, key, "host-a", a_log, **timing).acquire()
    time.sleep(4.0)  # longer than stale_after_s: only the heartbeat keeps it fresh
    with pytest.raises(RunLeaseHeld, match=rf"already running as PID {os.getpid()} on host host-a .*started "):
        _lease(store, key, "host-b", b_log, **timing).acquire()

    _stop_beating(a)  # host-a stops beating without releasing (killed, cut off)
    time.sleep(5.5)  # past stale_after_s and the server dates' one second
    b = _lease(store, key, "host-b", b_log, **timing).acquire()
    assert b.held
    took = [m for m in b_log if m.startswith("took over")]
    assert len(took) == 1 and f"PID {os.getpid()} on host host-a" in took[0] and "no heartbeat for" in took[0], b_log
    assert json.loads(store.get_bytes(key))["host"] == "host-b"

    a._refresh()  # host-a comes back: its heartbeat must not overwrite host-b's lease
    with pytest.raises(RunLeaseLost, match="taken over or deleted.*host host-b"):
        a.raise_if_lost()
    a.release()
    assert json.loads(store.get_bytes(key))["host"] == "host-b", "the old owner deleted the new owner's lease"
    b.release()  # the name changed hands: the lease stays, released, with both claims for the next owner
    released = json.loads(store.get_bytes(key))
    assert released["released_at"] and [c["owner"] for c in released["claims"]] == [a.record.owner, b.record.owner]
    assert all(c["at"] for c in released["claims"]), released["claims"]
    c = _lease(store, key, "host-c", b_log, **timing).acquire()
    assert c.held and b_log[-1].startswith("claimed") and "released by its owner" in b_log[-2], b_log
    assert [claim.owner for claim in c.claims] == [a.record.owner, b.record.owner, c.record.owner]
    c.release()


def test_a_dead_pid_on_this_host_is_taken_over_at_once(store, prefix) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    messages: list[str] = []
    earlier = _lease(store, key, "node-1", messages)
    earlier.record = replace(earlier.record, pid=dead.pid)  # a kill -9'd attempt of this run on this host
    earlier.acquire()
    _stop_beating(earlier)
    retry = _lease(store, key, "node-1", messages).acquire()
    assert retry.held and any(f"PID {dead.pid} is no longer running on this host" in m for m in messages), messages
    retry.release()


def test_a_lease_lost_mid_run_stops_the_trainer(store, settings, prefix, tmp_path, one_thread) -> None:
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import load_corpus, read_shard_table
    from dflash_core.train.assemble import build_trainer

    config = TrainConfig.model_validate(json.loads(_config(tmp_path, "lost", tmp_path / "runs").read_text()))
    corpus = load_corpus([(item, read_shard_table(Path(item))) for item in config.data])
    key = f"{prefix}/checkpoints/lost/lease.json"
    messages: list[str] = []
    lease = _lease(store, key, "host-a", messages, heartbeat_every_s=0.2, stale_after_s=3.0).acquire()
    trainer = build_trainer(config.model_copy(update={"max_steps": 100000, "checkpoint_every": 1000}), corpus=corpus,
                      store=store, checkpoint_prefix=f"{prefix}/checkpoints/lost", lease=lease)
    store.put_bytes(key, b'{"owner": "someone else"}')  # deleted or taken over behind our back
    try:
        with pytest.raises(RunLeaseLost, match="taken over or deleted while this run trained"):
            trainer.run()
        assert trainer.step < 100000
    finally:
        trainer.close()
        lease.release()
    assert store.get_bytes(key) == b'{"owner": "someone else"}', "the run deleted a lease that was not its own"


def test_the_trainers_uploader_is_fenced_by_the_runs_lease(store, settings, prefix, tmp_path, one_thread) -> None:
    """The trainer hands its lease to the uploader it starts: once the claim expires on the owner's side
    (renewals stopped past the stale time), the uploader writes nothing into the run's checkpoints."""
    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import load_corpus, read_shard_table
    from dflash_core.train.run_lease import RunLeaseNotHeld

    config = TrainConfig.model_validate(json.loads(_config(tmp_path, "fenced", tmp_path / "runs").read_text()))
    corpus = load_corpus([(item, read_shard_table(Path(item))) for item in config.data])
    messages: list[str] = []
    quick = quick_store(settings)  # a write may be in flight for 2 s: it goes out up to 1 s after a renewal
    lease = _lease(quick, f"{prefix}/checkpoints/fenced/lease.json", "host-a", messages, heartbeat_every_s=0.2,
                   stale_after_s=3.0).acquire()
    trainer = build_trainer(config, corpus=corpus, store=quick, checkpoint_prefix=f"{prefix}/checkpoints/fenced",
                            lease=lease)
    probe = f"{prefix}/checkpoints/fenced/step-000002/probe"
    try:
        trainer._start_uploader()
        trainer.uploader.store.put_bytes(probe, b"held")  # written while the claim is held
        assert store.head(probe).metadata["run-lease-owner"] == lease.record.owner
        _stop_beating(lease)
        time.sleep(3.0)
        with pytest.raises(RunLeaseNotHeld, match="not writing"):
            trainer.uploader.store.put_bytes(probe, b"expired")
        assert store.get_bytes(probe) == b"held"
    finally:
        trainer.close()
        lease.release()


def test_s3_down_at_the_claim_leaves_it_pending(settings, tmp_path) -> None:
    down = ObjectStore.from_settings(settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                                                      s3_max_attempts=1))
    messages: list[str] = []
    lease = _lease(down, "checkpoints/r/lease.json", "host-a", messages, heartbeat_every_s=0.2, stale_after_s=3.0)
    lease.acquire()
    assert not lease.held and not lease.wait_held(0.5)
    assert any(m.startswith("cannot claim run 'r'") and "retrying in the background" in m for m in messages), messages
    lease.release()


# ---- a dead PID: only of this very boot and PID namespace -----------------------------------------


@pytest.mark.parametrize("elsewhere", [
    {"pid_ns": "pid:[4026532999]"},  # another container with this host name, on this kernel
    {"boot_id": "0" * 8 + "-0000-0000-0000-" + "0" * 12},  # another machine (or boot) with this host name
    {"boot_id": None, "pid_ns": None},  # a lease that does not say
], ids=["other-pid-namespace", "other-boot", "unknown"])
def test_a_dead_pid_elsewhere_under_this_host_name_is_not_taken_over(store, prefix, elsewhere) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # no such PID here; in the owner's namespace it may well be running
    messages: list[str] = []
    owner = _lease(store, key, "node-1", messages)
    owner.record = replace(owner.record, pid=dead.pid, **elsewhere)
    owner.acquire()
    _stop_beating(owner)
    with pytest.raises(RunLeaseHeld, match=rf"already running as PID {dead.pid} on host node-1 "):
        _lease(store, key, "node-1", messages).acquire()
    assert json.loads(store.get_bytes(key))["owner"] == owner.record.owner
    assert not any(m.startswith("took over") for m in messages), messages


def test_a_lease_goes_stale_only_after_its_owners_own_stale_time(store, prefix) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    messages: list[str] = []
    owner = _lease(store, key, "host-a", messages, heartbeat_every_s=1.0, stale_after_s=60.0).acquire()
    _stop_beating(owner)
    time.sleep(2.5)  # past the newcomer's 1 s by the server's clock, far short of the owner's 60 s
    with pytest.raises(RunLeaseHeld, match="already running as PID"):
        _lease(store, key, "host-b", messages, heartbeat_every_s=0.2, stale_after_s=1.0).acquire()
    assert json.loads(store.get_bytes(key))["owner"] == owner.record.owner


# ---- cut off from the bucket -------------------------------------------------------------------------
