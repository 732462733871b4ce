"""A run lease cut off from its bucket, on the real SeaweedFS (a relay to the server whose port is closed, then
opened again): the owner gives its claim up on its own side before another host may take the name, holds it
again if nobody did, and its uploader, fenced by the lease, never writes into the new owner's checkpoints;
without a held lease the uploader writes nothing.

Run: `.venv/bin/python -m pytest tests/integration/test_run_lease_outage.py -q`
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from dflash_core.train.checkpoint import _FILES
from dflash_core.train.run_lease import RunLease, RunLeaseHeld, RunLeaseLost, RunLeaseNotHeld
from dflash_core.train.uploader import CheckpointUploader, CheckpointUploadFailed
from tests.conftest import free_port

from tests.integration.test_run_lease import _lease, quick_store

# The owner gives up after 2.7 s; its writes, in flight for up to 2 s (quick_store), go out up to 1 s after a renewal.
_CUT_TIMING = {"heartbeat_every_s": 0.3, "stale_after_s": 3.0}


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
    """The bucket as a host behind `link` reaches it, with short timeouts and one retry."""
    return quick_store(settings, endpoint_url=link.url)


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
    # the guarantee: it stops before another host may take the name (stale_after_s), not a poll's slack after
    # its own expiry, which a loaded 2-core machine can miss
    assert time.monotonic() - cut < owner.stale_after_s
    step_key = f"{prefix}/checkpoints/r/step-000002/meta.json"
    expired = (r"last renewed its lease .* ago, past its 2\.7 s: another run may take the name over after "
               rf"3 s .*not writing {store.uri(step_key)}")
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



def test_a_file_upload_under_way_stops_once_the_guard_refuses(store, prefix, tmp_path) -> None:
    """A multipart upload (a checkpoint's weights) asks the guard as its parts go out: one whose lease expires
    mid-upload leaves neither an object nor an open multipart upload behind."""
    from dflash_core.storage import MULTIPART_THRESHOLD
    from dflash_core.storage.errors import StoreUnavailable

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * (2 * MULTIPART_THRESHOLD + 1))
    asked: list[str] = []

    def lease_expires_after_the_first_ask(key: str, *, in_flight_s: float) -> None:
        asked.append(key)
        if len(asked) > 1:
            raise StoreUnavailable(f"lease expired; not writing {key}")

    key = f"{prefix}/checkpoints/r/step-000002/model.safetensors"
    with pytest.raises(StoreUnavailable, match="lease expired; not writing"):
        store.fenced(lease_expires_after_the_first_ask).put_file(key, weights)
    assert len(asked) >= 2 and set(asked) == {key}
    assert not store.exists(key)
    assert not store.incomplete_uploads(f"{prefix}/"), "the refused multipart upload was left open"
