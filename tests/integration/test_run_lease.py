"""One live run per run name across hosts, on the real SeaweedFS: the conditional writes the lease
relies on, a second "host" (another output dir, another DFLASH_HOST_NAME) refused while the first
trains, the lease released at the first's SIGTERM exit, a stale lease taken over with its old owner
named (never before the owner's own stale time), a dead PID's lease taken over at once only when it is of
this very boot and PID namespace.

Cut off from the bucket (a relay to the server whose port is closed, then opened again): the owner gives
its claim up on its own side before another host may take the name, holds it again if nobody did, and its
uploader, fenced by the lease, never writes into the new owner's checkpoints; without a held lease the
uploader writes nothing.

Run: `.venv/bin/python -m pytest tests/integration/test_run_lease.py -q`
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from dflash_core.layout import run_lease_key
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from dflash_core.train.checkpoint import _FILES
from dflash_core.train.report import load_metrics
from dflash_core.train.run_lease import RunLease, RunLeaseHeld, RunLeaseLost, RunLeaseNotHeld
from dflash_core.train.uploader import CheckpointUploader, CheckpointUploadFailed
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


def _lease(store: ObjectStore, key: str, host: str, messages: list[str], **kwargs) -> RunLease:
    return RunLease(store, key, run_name="r", run_dir=Path(f"/runs/{host}/r"), host=host, log=messages.append,
                    **kwargs)


def test_a_fresh_lease_is_kept_and_a_stale_one_taken_over(store, prefix) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    timing = {"heartbeat_every_s": 0.3, "stale_after_s": 3.0}
    a_log: list[str] = []
    b_log: list[str] = []
    a = _lease(store, key, "host-a", a_log, **timing).acquire()
    time.sleep(4.0)  # longer than stale_after_s: only the heartbeat keeps it fresh
    with pytest.raises(RunLeaseHeld, match=rf"already running as PID {os.getpid()} on host host-a .*started "):
        _lease(store, key, "host-b", b_log, **timing).acquire()

    a._stop.set()  # host-a stops beating without releasing (killed, cut off)
    a._thread.join()
    time.sleep(4.5)
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
    b.release()
    assert not store.exists(key)


def test_a_dead_pid_on_this_host_is_taken_over_at_once(store, prefix) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    messages: list[str] = []
    earlier = _lease(store, key, "node-1", messages)
    earlier.record = replace(earlier.record, pid=dead.pid)  # a kill -9'd attempt of this run on this host
    earlier.acquire()
    earlier._stop.set()
    earlier._thread.join()
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

_CUT_TIMING = {"heartbeat_every_s": 0.2, "stale_after_s": 1.5}  # the owner gives up after 1.3 s


class CuttableLink:
    """A TCP relay on loopback to the S3 server. `cut` closes its port and resets every connection through
    it (the bucket unreachable: connection refused), `restore` listens on the same port again."""

    def __init__(self, endpoint_url: str):
        parsed = urllib.parse.urlsplit(endpoint_url)
        self.upstream = (parsed.hostname, parsed.port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.restore()

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        with self._lock:
            self._open.append(listener)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            sockets, self._open = self._open, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                return
            with self._lock:
                if listener not in self._open:  # cut while this one was being connected
                    client.close()
                    upstream.close()
                    return
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            return
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def link(settings, s3_server):
    relay = CuttableLink(settings.s3_endpoint_url)
    yield relay
    relay.cut()


def _through(link: CuttableLink, settings: Settings) -> ObjectStore:
    """The bucket as a host behind `link` reaches it, one attempt a call."""
    return ObjectStore.from_settings(settings.replace(s3_endpoint_url=link.url, s3_max_attempts=1))


def _stop_beating(lease: RunLease) -> None:
    """The owner stops renewing without releasing: killed, or frozen."""
    lease._stop.set()
    lease._thread.join()


def _wait(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _take_over(store: ObjectStore, key: str, host: str, messages: list[str], *,
               timeout_s: float = 10.0) -> RunLease:
    """Start on `host` as soon as the lease may be taken over (the server's clock says when)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _lease(store, key, host, messages, **_CUT_TIMING).acquire()
        except RunLeaseHeld:
            assert time.monotonic() < deadline, f"{host} could not take the lease over in {timeout_s} s"
            time.sleep(0.1)


def _fake_checkpoint(root: Path, step: int) -> Path:
    path = root / f"step-{step:06d}"
    path.mkdir(parents=True)
    for name in _FILES:
        (path / name).write_text(f"{step} {name}")
    return path


def test_a_cut_off_owner_gives_its_claim_up_before_another_host_may_take_it(store, settings, prefix,
                                                                             link) -> None:
    key = f"{prefix}/checkpoints/r/lease.json"
    a_log: list[str] = []
    b_log: list[str] = []
    owner = _lease(_through(link, settings), key, "host-a", a_log, **_CUT_TIMING).acquire()
    time.sleep(0.5)
    assert owner.held
    link.cut()
    cut = time.monotonic()
    _wait(lambda: not owner.held, timeout_s=5.0, what="the cut-off owner to give its claim up")
    assert time.monotonic() - cut <= owner.expires_after_s + 0.1
    step_key = f"{prefix}/checkpoints/r/step-000002/meta.json"
    expired = (r"last renewed its lease .* ago, past its 1\.3 s: another run may take the name over after "
               rf"1\.5 s .*not writing {store.uri(step_key)}")
    with pytest.raises(RunLeaseNotHeld, match=expired):
        owner.require_held(step_key)
    _wait(lambda: any("writes nothing to S3 until a renewal succeeds" in m for m in a_log), timeout_s=2.0,
          what="the owner to log that it gave its claim up")

    newcomer = _take_over(store, key, "host-b", b_log)
    assert not owner.held, "two runs held one name at once"
    link.restore()
    _wait(lambda: owner._lost is not None, timeout_s=5.0, what="the old owner's heartbeat to find it taken")
    with pytest.raises(RunLeaseLost, match="taken over or deleted while this run trained .*host host-b"):
        owner.require_held(step_key)
    owner.release()
    assert json.loads(store.get_bytes(key))["host"] == "host-b"
    newcomer.release()


def test_an_owner_whose_name_nobody_took_holds_it_again_once_the_bucket_is_back(settings, prefix,
                                                                               link) -> None:
    messages: list[str] = []
    owner = _lease(_through(link, settings), f"{prefix}/checkpoints/r/lease.json", "host-a", messages,
                   **_CUT_TIMING).acquire()
    link.cut()
    _wait(lambda: not owner.held, timeout_s=5.0, what="the cut-off owner to give its claim up")
    link.restore()
    _wait(lambda: owner.held, timeout_s=5.0, what="the owner to renew its lease")
    assert any("nobody took the name meanwhile, S3 writes go on" in m for m in messages), "\n".join(messages)
    owner.release()


def test_a_cut_off_owners_uploader_never_writes_into_the_new_owners_checkpoints(store, settings, prefix, link,
                                                                               tmp_path) -> None:
    checkpoints = f"{prefix}/checkpoints/r"
    key = f"{checkpoints}/lease.json"
    root = tmp_path / "checkpoints"
    messages: list[str] = []
    owner_store = _through(link, settings)
    owner = _lease(owner_store, key, "host-a", messages, **_CUT_TIMING).acquire()
    uploader = CheckpointUploader(owner_store, root=root, key_prefix=checkpoints, keep_last=2, lease=owner,
                                  outage_limit_s=60.0, backoff_s=(0.1, 0.2), log=messages.append)
    uploader.submit(_fake_checkpoint(root, 2))
    _wait(lambda: uploader.uploaded == [2], timeout_s=10.0, what="step 2's upload")

    link.cut()  # host-a trains on and saves step 4, but cannot reach the bucket
    uploader.submit(_fake_checkpoint(root, 4))
    newcomer = _take_over(store, key, "host-b", messages)
    link.restore()  # host-a reaches the bucket again, which host-b now owns
    lost = "cannot succeed by retrying: run 'r': the lease .* was taken over or deleted while this run"
    with pytest.raises(CheckpointUploadFailed, match=f"{lost} .*host host-b"):
        uploader.finish(final=root / "step-000004")
    assert uploader.uploaded == [2]
    assert not list(store.list(f"{checkpoints}/step-000004/")), "the old owner wrote a checkpoint"
    assert json.loads(store.get_bytes(key))["owner"] == newcomer.record.owner
    owner.release()
    newcomer.release()


def test_the_uploader_writes_nothing_without_a_held_lease(store, settings, prefix, tmp_path) -> None:
    down = ObjectStore.from_settings(settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                                                      s3_max_attempts=1))
    messages: list[str] = []
    pending = _lease(down, f"{prefix}/checkpoints/r/lease.json", "host-a", messages, **_CUT_TIMING).acquire()
    root = tmp_path / "checkpoints"
    record = tmp_path / "run.yaml"
    record.write_text("run_name: r\n")
    uploader = CheckpointUploader(store, root=root, key_prefix=f"{prefix}/checkpoints/r", keep_last=2,
                                  run_files={f"{prefix}/reports/train/r/run.yaml": record}, lease=pending,
                                  outage_limit_s=1.0, backoff_s=(0.1, 0.2), log=messages.append)
    uploader.submit(_fake_checkpoint(root, 2))
    refused = r"past the outage limit of 1 s .*run 'r' has not claimed .* yet .*; not writing s3://"
    with pytest.raises(CheckpointUploadFailed, match=refused):
        uploader.finish(final=root / "step-000002")
    assert not list(store.list(f"{prefix}/")), "the uploader wrote to S3 without the run's lease"
    pending.release()

