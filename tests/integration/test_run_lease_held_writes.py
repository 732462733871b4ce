"""A run lease's owner whose requests a network path holds and delivers late, on the real SeaweedFS through a
relay on loopback that can hold what clients send and release it later: a write is sent only if its client's
timeouts let it land before another host may take the name over; a checkpoint that lands after the takeover
anyway (bytes held past the client's own timeouts) is not resumed from; the owner says its claim expired while
its renewal is still blocked.

Run: `.venv/bin/python -m pytest tests/integration/test_run_lease_held_writes.py -q -n 0`
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from dflash_core.storage import ObjectStore, StoreError
from dflash_core.train.checkpoint import _FILES
from dflash_core.train.remote import upload_checkpoint
from dflash_core.train.run_lease import RunLeaseNotHeld
from tests.integration.test_run_lease import _config, _lease, quick_store
from tests.integration.test_run_lease_outage import _take_over, _wait

_TIMING = {"heartbeat_every_s": 0.3, "stale_after_s": 3.0}  # the owner's claim expires on its side after 2.7 s
_CONNECT_S, _READ_S = 0.5, 1.0  # the owner's requests: in flight for up to 1.5 s, so sent up to 1.5 s after a renewal


class HoldingRelay:
    """A TCP relay on loopback to the S3 server. `hold` keeps what clients send from then on (the server sees
    nothing of it), `release` delivers it in order and relays again: a path that stalls, then catches up, even
    for requests whose client gave up meanwhile (a client's close is never passed on)."""

    def __init__(self, endpoint_url: str):
        parsed = urllib.parse.urlsplit(endpoint_url)
        self.upstream = (parsed.hostname, parsed.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._holding = False
        self._held: list[tuple[socket.socket, bytes]] = []
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        with self._lock:
            self._holding = True

    def release(self) -> None:
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
            for sink, data in held:
                with contextlib.suppress(OSError):
                    sink.sendall(data)

    def held_requests(self) -> list[str]:
        """The request lines (method and path) held now."""
        with self._lock:
            data = b"".join(chunk for _, chunk in self._held)
        return [line.decode() for line in re.findall(rb"^(?:GET|HEAD|PUT|POST|DELETE) \S+", data, re.M)]

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump_up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(upstream, client), daemon=True).start()

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self._holding:
                        self._held.append((upstream, data))
                    else:
                        upstream.sendall(data)

    @staticmethod
    def _pump_down(upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                client.sendall(data)


@pytest.fixture
def relay(settings, s3_server):
    held = HoldingRelay(settings.s3_endpoint_url)
    yield held
    held.release()
    held.close()


def _owner_store(relay: HoldingRelay, settings, *, read_s: float = _READ_S) -> ObjectStore:
    return quick_store(settings, endpoint_url=relay.url, connect_s=_CONNECT_S, read_s=read_s)


def test_a_write_that_could_land_after_a_takeover_is_not_sent(store, settings, prefix, relay) -> None:
    """The red team's case: the path stalls, the owner's renewals stop getting through, and a write goes out late
    in the owner's claim (2 s after its last renewal, before its 2.7 s); held, then delivered after another host
    took the name over at 4 s, it would land in the new owner's checkpoints."""
    key = f"{prefix}/checkpoints/r/lease.json"
    step_key = f"{prefix}/checkpoints/r/step-000004/meta.json"
    a_log: list[str] = []
    owner_store = _owner_store(relay, settings)
    owner = _lease(owner_store, key, "host-a", a_log, **_TIMING).acquire()
    relay.hold()
    _wait(lambda: owner._since_renewal() > 2.0, timeout_s=5.0, what="2 s without a renewal")
    assert owner.held, "the test needs the write asked for while the owner still counts its claim as held"
    with pytest.raises(StoreError) as refused:
        owner_store.fenced(owner.require_held).put_bytes(step_key, b"late")
    sent = [line for line in relay.held_requests() if line.startswith("PUT") and "step-000004" in line]

    newcomer = _take_over(store, key, "host-b", [], timeout_s=15.0)
    relay.release()  # the held requests reach the server now, after the takeover
    time.sleep(2.0)
    assert not store.exists(step_key), "a write the old owner sent before the takeover landed after it"
    assert not sent, f"the write went out though it could not land in time: {sent}"
    assert isinstance(refused.value, RunLeaseNotHeld), refused.value
    assert re.search(r"renewed its lease .* ago: a request sent now may stay in flight for up to 1\.5 s .*past the "
                     rf"3 s .*not writing {re.escape(store.uri(step_key))}", str(refused.value)), refused.value
    owner.release()
    newcomer.release()


def _real_checkpoints(config_path: Path, made: Path, *steps: int) -> None:
    """Real checkpoints of the tiny run at `steps`, written by a trainer that touches no store, copied to `made`."""
    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import load_corpus, read_shard_table

    config = TrainConfig.model_validate(json.loads(config_path.read_text()))
    corpus = load_corpus([(item, read_shard_table(Path(item))) for item in config.data])
    maker = build_trainer(config, corpus=corpus)
    try:
        for step in steps:
            maker.step = step
            shutil.copytree(maker.save(), made / f"step-{step:06d}")
    finally:
        maker.close()
    shutil.rmtree(config.run_dir)


def _resume(config_path: Path, store: ObjectStore, checkpoints: str, lease) -> int:
    """The step a fresh trainer of the run resumes at from S3, as rank 0 holding `lease`."""
    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import load_corpus, read_shard_table

    config = TrainConfig.model_validate(json.loads(config_path.read_text()))
    corpus = load_corpus([(item, read_shard_table(Path(item))) for item in config.data])
    trainer = build_trainer(config, corpus=corpus, store=store, checkpoint_prefix=checkpoints, lease=lease)
    try:
        assert trainer.resume()
        return trainer.step
    finally:
        trainer.close()


def test_a_checkpoint_that_lands_after_a_takeover_is_not_resumed_from(store, settings, prefix, relay, tmp_path,
                                                                      one_thread, capsys) -> None:
    """Bytes held past the client's own timeouts still land, once delivered: the new owner's resume skips the
    checkpoint they complete, naming its files and the claims, and resumes from the one before."""
    checkpoints = f"{prefix}/checkpoints/r"
    key = f"{checkpoints}/lease.json"
    config_path = _config(tmp_path, "r", tmp_path / "runs")
    made = tmp_path / "made"
    _real_checkpoints(config_path, made, 2, 4)
    owner_store = _owner_store(relay, settings)
    owner = _lease(owner_store, key, "host-a", [], **_TIMING).acquire()
    fenced = owner_store.fenced(owner.require_held)
    upload_checkpoint(fenced, made / "step-000002", key_prefix=checkpoints, inputs=[], config={})

    relay.hold()  # step 4 goes out within the owner's claim, and the path holds it
    writers = [threading.Thread(target=_try_put, args=(fenced, f"{checkpoints}/step-000004/{name}",
                                                       made / "step-000004" / name)) for name in _FILES]
    for writer in writers:
        writer.start()
    _wait(lambda: sum("step-000004" in line for line in relay.held_requests()) >= 3, timeout_s=5.0,
          what="step 4's three PUTs to be held")
    newcomer = _take_over(store, key, "host-b", [], timeout_s=15.0)
    relay.release()
    _wait(lambda: store.exists(f"{checkpoints}/step-000004/meta.json"), timeout_s=5.0,
          what="the held step 4 to land after the takeover")
    for writer in writers:
        writer.join()

    capsys.readouterr()
    assert _resume(config_path, store, checkpoints, newcomer) == 2
    said = capsys.readouterr().out
    assert re.search(rf"skipped {re.escape(store.uri(checkpoints))}/step-000004/, written after the run name was "
                     rf"taken over: .*meta\.json written .* by claim {owner.record.owner}, after claim "
                     rf"{newcomer.record.owner} took the name at ", said), said
    owner.release()
    newcomer.release()


def _try_put(store: ObjectStore, key: str, path: Path) -> None:
    with contextlib.suppress(StoreError):  # the client gives up on a held request; its bytes land later anyway
        store.put_file(key, path)


def test_the_owner_says_its_claim_expired_while_its_renewal_blocks(settings, prefix, relay) -> None:
    messages: list[str] = []
    owner = _lease(_owner_store(relay, settings, read_s=30.0), f"{prefix}/checkpoints/r/lease.json", "host-a",
                   messages, **_TIMING).acquire()
    relay.hold()  # the next renewal waits for an answer for 30 s
    held_at = time.monotonic()
    _wait(lambda: any("writes nothing to S3 until a renewal succeeds" in m for m in messages), timeout_s=6.0,
          what="the owner to say its claim expired")
    assert time.monotonic() - held_at < owner.stale_after_s + 1.0
    assert not any("heartbeat of" in m for m in messages), "the renewal was not blocked after all"
    relay.release()
    owner.release()
