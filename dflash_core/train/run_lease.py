"""One live run per run name across hosts: a lease object in the bucket
(`dflash_core.layout.run_lease_key`, beside the run's checkpoints, which every host shares by run name).

The local `run_lock` stops a second start on the same run dir; this stops a second start anywhere
(another output dir, another host) before it reads or writes a checkpoint of the name.

    {"owner": "<uuid>", "host", "pid", "user", "run_dir", "started_at", "heartbeat_at", "stale_after_s",
     "boot_id", "pid_ns", "claims": [{"owner", "at"}, ...], "released_at"}

Claimed with a conditional PUT (`If-None-Match: *`, refused with 412 when the object exists), refreshed
by a background thread every `HEARTBEAT_EVERY_S` with `If-Match: <our ETag>` (so a heartbeat of an
owner that lost the lease never overwrites the new owner's), released at the end with a conditional
DELETE. SeaweedFS, AWS S3 and MinIO honour both preconditions; every claim is also read back, so a
server that ignored them is caught. A lease whose last write (the server's Last-Modified, against the
server's Date on our read: one clock, whatever the hosts' clocks say) is older than the stale time
(`LEASE_STALE_AFTER_S`, or the owner's own if longer) by more than those dates' one-second resolution is taken
over, and so is one whose PID is no longer running in this very PID namespace (a kill -9 of our own earlier
attempt): same kernel boot and PID namespace, since containers on one host or on several can share a host
name; both say whose lease they took.

The owner gives its claim up on its own side too: once its last successful write (timed from when the
request was sent) is older than the stale time less one heartbeat, `held` is False. Each write to S3 asks
`require_held` with how long its request may stay in flight (connect + read timeout, from the client's config:
dflash_core.storage.longest_request_s), and is refused unless it lands within the stale time of that last
renewal, so before another host may take the name over: with the defaults (a 125 s request, 180 s stale) a
write goes out up to 55 s after a renewal. A thread of its own says when the claim expires, even while the
heartbeat's request (or an upload) blocks. The heartbeat keeps renewing with `If-Match`: if nobody took the
name meanwhile the lease is held again, else it is lost.

Late writes. A network path can still hold a request's bytes and deliver them after the client gave up on
them, so the checkpoints themselves say who wrote them. Each claim is named by its owner id and recorded in
`claims` (oldest first, each with the server's time of the claiming write, `at`); a takeover inherits the
claims, and a release after the name ever changed hands keeps the record (`released_at`, free to take at
once) instead of deleting it, so the history lasts as long as it matters. Every object written through the
run's fenced store carries its writer's owner id (`WRITER_METADATA_KEY`). The rule, applied on resume
(`postdates_takeover`): an object is trusted when the current claim wrote it, or when it was written
(Last-Modified, whole seconds) in an earlier second than the claim that took the name from its writer (for
a writer of no recorded claim, unstamped or older than the record: the first recorded claim). Anything else
was written after its writer had lost the name: ignored and reported. (AWS dates a multipart object by when
its upload began, so a takeover also aborts the multipart uploads left under the run's prefix: none of them can
complete afterwards.)
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path

from botocore.exceptions import ClientError

from dflash_core.storage import ObjectStore, PreconditionFailed, StoreError, StoreUnavailable

HEARTBEAT_EVERY_S = 30.0
# Six missed heartbeats: a long S3 hiccup does not hand a live run away; a dead one frees its name in minutes.
LEASE_STALE_AFTER_S = 180.0
WRITER_METADATA_KEY = "run-lease-owner"  # S3 user metadata: the owner id of the claim that wrote the object
_SERVER_DATE_RESOLUTION_S = 1.0  # HTTP dates (Date, Last-Modified) are whole seconds


class RunLeaseHeld(StoreError):
    """Another live run holds this run name's lease: retrying at once cannot help."""


class RunLeaseLost(StoreError):
    """This run's lease was taken over or deleted while it ran: another run owns the name now."""


class RunLeaseNotHeld(StoreUnavailable):
    """This run does not hold its lease right now (the claim is pending, or expired on our side while S3
    was unreachable): nothing may be written to S3 until a claim or renewal succeeds. Retry later."""


def host_name(override: str | None = None) -> str:
    """The name this host gives in leases: `override` (e.g. DFLASH_HOST_NAME), else the system's."""
    return override or socket.gethostname()


@dataclass(frozen=True)
class Claim:
    owner: str
    at: float | None = None  # the server's time of the claiming write (None: not read back yet)


@dataclass(frozen=True)
class LeaseRecord:
    owner: str
    host: str
    pid: int
    user: str
    run_dir: str
    started_at: float
    heartbeat_at: float
    stale_after_s: float
    boot_id: str | None = None  # the kernel's boot (None: unknown, e.g. no /proc, or an older lease)
    pid_ns: str | None = None  # the PID namespace `pid` is a number in, e.g. "pid:[4026531836]"
    claims: tuple[Claim, ...] = ()  # this name's claims since the lease object was created, oldest first
    released_at: float | None = None  # set by an owner that released a lease whose claims must be kept

    @classmethod
    def from_json(cls, found: dict) -> LeaseRecord:
        """A record as written; a TypeError or ValueError when `found` is not one."""
        known = {field.name: found[field.name] for field in fields(cls) if field.name in found}
        known["claims"] = tuple(Claim(**claim) for claim in known.get("claims", ()))
        return cls(**known)

    def describe(self, *, age_s: float | None) -> str:
        beat = f"last heartbeat {_iso(self.heartbeat_at)}"
        if age_s is not None:
            beat += f", {age_s:.0f} s ago by the S3 server's clock"
        return (f"PID {self.pid} on host {self.host} (user {self.user}, run dir {self.run_dir}, started "
                f"{_iso(self.started_at)}, {beat})")


@dataclass(frozen=True)
class _Seen:
    record: LeaseRecord | None  # None: the object is not a lease we can read
    etag: str
    age_s: float | None  # since the object's last write, by the server's clock
    modified: datetime | None = None  # the object's Last-Modified

    def claims(self) -> tuple[Claim, ...]:
        """The record's claims; the last one's time, when its owner has not written it yet, is the object's
        Last-Modified (the lease was not rewritten since that claim, or its owner would have written it)."""
        claims = self.record.claims if self.record is not None else ()
        if claims and claims[-1].at is None and self.modified is not None:
            claims = (*claims[:-1], replace(claims[-1], at=self.modified.timestamp()))
        return claims


def postdates_takeover(claims: Sequence[Claim], *, writer: str | None, written_at: datetime) -> Claim | None:
    """The claim that took the run name from `writer` (the owner id an object is stamped with; None:
    unstamped) when the object was written (Last-Modified) in that claim's second or later, else None: the
    object is trusted (the rule: the module docstring). A claim of unknown time counts as made already."""
    owners = [claim.owner for claim in claims]
    if not claims or writer == owners[-1]:
        return None
    successor = claims[owners.index(writer) + 1] if writer in owners else claims[0]
    if successor.at is not None and int(written_at.timestamp()) < int(successor.at):
        return None
    return successor


def read_claims(store: ObjectStore, key: str) -> tuple[Claim, ...]:
    """The claims recorded in the lease at `key` (none when there is no lease, or it is unreadable)."""
    seen = _read_lease(store, key)
    return seen.claims() if seen is not None else ()


class RunLease:
    """Claim `key` for this process (`acquire`), keep it fresh from a thread, `release` at the end.
    S3 unavailable at the claim: training may start, the claim is retried in the background and
    `held` stays False until it succeeds; it is False again while the claim has expired on our side
    (writers ask `require_held` before each write to S3)."""

    def __init__(self, store: ObjectStore, key: str, *, run_name: str, run_dir: Path, host: str | None = None,
                 heartbeat_every_s: float = HEARTBEAT_EVERY_S, stale_after_s: float = LEASE_STALE_AFTER_S,
                 log: Callable[[str], None] | None = None):
        if stale_after_s <= heartbeat_every_s:
            raise ValueError(f"stale_after_s ({stale_after_s}) must exceed heartbeat_every_s ({heartbeat_every_s})")
        self.store = store
        self.key = key
        self.run_name = run_name
        self.heartbeat_every_s = heartbeat_every_s
        self.stale_after_s = stale_after_s
        self.expires_after_s = stale_after_s - heartbeat_every_s  # our side of the claim: see the module doc
        self.log = log or (lambda message: print(f"[run lease] {message}", file=sys.stderr, flush=True))
        now = time.time()
        self.record = LeaseRecord(owner=uuid.uuid4().hex, host=host_name(host), pid=os.getpid(), user=_user(),
                                  run_dir=str(run_dir), started_at=now, heartbeat_at=now,
                                  stale_after_s=stale_after_s, boot_id=_boot_id(), pid_ns=_pid_namespace())
        self._etag: str | None = None
        self._took_over = False  # whether the name was another run's when we claimed it
        self._renewed_at: float | None = None  # time.monotonic() when our last successful write was sent
        self._expired_logged = False
        self._renewal_lock = threading.Lock()  # a renewal and the expiry watch agree on `_expired_logged`
        self._lost: StoreError | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def uri(self) -> str:
        return self.store.uri(self.key)

    @property
    def held(self) -> bool:
        """Claimed, not lost, and renewed within `expires_after_s`: whether this run may write to S3 now."""
        return self._etag is not None and self._lost is None and self._since_renewal() <= self.expires_after_s

    @property
    def claims(self) -> tuple[Claim, ...]:
        """This run name's claims, oldest first: ours last once claimed, else as the lease in S3 has them."""
        return self.record.claims if self._etag is not None else read_claims(self.store, self.key)

    def require_held(self, key: str | None = None, *, in_flight_s: float = 0.0) -> dict[str, str]:
        """Raise unless `held` and a request sent now, in flight for up to `in_flight_s`, lands before another
        run may take the name over: `RunLeaseLost`/`RunLeaseHeld` when another run owns the name (final),
        `RunLeaseNotHeld` while the claim is pending or expired, or too close to expiring (retry later). `key`:
        the write refused. Returns the metadata that stamps a write as this claim's (a dflash_core.storage
        `WriteGuard`)."""
        self.raise_if_lost()
        refused = f"; not writing {self.store.uri(key)}" if key is not None else ""
        run = f"run {self.run_name!r}"
        if self._etag is None:
            raise RunLeaseNotHeld(f"{run} has not claimed {self.uri} yet (S3 was unreachable at the claim, "
                                  f"which is retried in the background){refused}")
        since = self._since_renewal()
        if not self.held:
            raise RunLeaseNotHeld(
                f"{run} last renewed its lease {self.uri} {since:.1f} s ago, past its "
                f"{self.expires_after_s:g} s: another run may take the name over after {self.stale_after_s:g} s "
                f"without a heartbeat, so nothing goes to S3 until a renewal succeeds{refused}")
        if since + in_flight_s > self.stale_after_s:
            raise RunLeaseNotHeld(
                f"{run} last renewed its lease {self.uri} {since:.1f} s ago: a request sent now may stay in flight "
                f"for up to {in_flight_s:g} s (its client's connect and read timeouts), past the "
                f"{self.stale_after_s:g} s after which another run may take the name over; nothing goes to S3 "
                f"until a renewal succeeds{refused}")
        return {WRITER_METADATA_KEY: self.record.owner}

    # ---- the run's side --------------------------------------------------------------------------

    def acquire(self) -> RunLease:
        """Claim the lease, or raise `RunLeaseHeld` naming the live owner; never waits for it. A
        `StoreUnavailable` leaves the claim pending: the heartbeat thread retries it."""
        try:
            self._claim()
        except StoreUnavailable as error:
            self.log(f"cannot claim run {self.run_name!r} at {self.uri} yet ({error}); retrying in the background, "
                     "checkpoints go to S3 only once it is claimed")
        for target, name in ((self._beat, "run-lease-heartbeat"), (self._watch_expiry, "run-lease-expiry")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()
        return self

    def raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    def wait_held(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a pending claim; whether the lease is held."""
        deadline = time.monotonic() + timeout_s
        while not self.held and self._lost is None and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.held

    def release(self) -> None:
        """Stop the heartbeat and give the lease up if it is still ours: a conditional DELETE, or, when we took
        the name over from another run, a conditional PUT marking it released that keeps its claims (see the
        module doc)."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        etag, self._etag = self._etag, None
        if etag is None or self._lost is not None:
            return
        try:
            if self._took_over:
                released = self._put(if_match=etag, record=replace(self.record, released_at=time.time()))
                if released is None:
                    raise PreconditionFailed(self.uri)
            else:
                self.store.delete(self.key, if_match=etag)
        except PreconditionFailed:
            self.log(f"{self.uri} is no longer ours at release: left as it is")
        except StoreError as error:  # the lease goes stale by itself
            self.log(f"could not release {self.uri} ({error}); it is free once {self.stale_after_s:.0f} s old")

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ---- claim, refresh ----------------------------------------------------------------------------

    def _claim(self) -> None:
        """Create the lease, or take over a stale, dead or released one; RunLeaseHeld when a live owner has it."""
        for _ in range(3):  # a takeover raced by another claimant: look again
            self.record = self._with_our_claim(None)
            sent = time.monotonic()
            etag = self._put(if_absent=True)
            if etag is None:
                seen = self._read()
                if seen is None:
                    continue  # released between our PUT and our read
                why = self._free_because(seen)
                if why is None:
                    raise RunLeaseHeld(self._held_message(seen))
                self.record = self._with_our_claim(seen)
                sent = time.monotonic()
                etag = self._put(if_match=seen.etag)
                if etag is None:
                    continue
                old = seen.record.describe(age_s=seen.age_s) if seen.record else "an unreadable lease"
                self._took_over = seen.record is None or seen.record.owner != self.record.owner
                self.log(f"took over run {self.run_name!r} at {self.uri} from {old}: {why}")
            self._etag, self._renewed_at = etag, sent
            self._confirm()
            self.log(f"claimed run {self.run_name!r} at {self.uri} as PID {self.record.pid} on host {self.record.host}")
            if self._took_over:
                self._abort_their_uploads()
            return
        raise RunLeaseHeld(f"run {self.run_name!r}: {self.uri} changed under three claims in a row; another "
                           "run is starting with this name: wait, or choose another run_name")

    def _abort_their_uploads(self) -> None:
        """Abort the multipart uploads the previous owner left under the run's prefix (beside the lease): one
        completed after the takeover would be an object whose Last-Modified is when its upload began (AWS)."""
        prefix = self.key.rpartition("/")[0] + "/"
        try:
            aborted = self.store.abort_incomplete_uploads(prefix)
        except StoreError as error:  # the uploader's reconcile aborts them too, once it runs
            self.log(f"could not abort the multipart uploads left under {self.store.uri(prefix)} ({error})")
            return
        if aborted:
            self.log(f"aborted {aborted} multipart upload(s) the previous owner left under {self.store.uri(prefix)}")

    def _with_our_claim(self, seen: _Seen | None) -> LeaseRecord:
        """Our record, with the claims of `seen` (the lease we take over; None: a new lease) and ours last."""
        claims = seen.claims() if seen is not None else ()
        if not claims or claims[-1].owner != self.record.owner:  # not a retry of a claim of ours that landed
            claims = (*claims, Claim(owner=self.record.owner))
        return replace(self.record, claims=claims, released_at=None)

    def _confirm(self) -> None:
        """Read the claim back: a server that ignored our precondition would let another claimant's PUT win.
        Our claim's time is the Last-Modified read back (the heartbeat writes it into the lease)."""
        seen = self._read()
        if seen is None or seen.record is None or seen.record.owner != self.record.owner:
            self._etag = None
            if seen is None:
                raise RunLeaseHeld(f"run {self.run_name!r}: {self.uri} vanished right after our claim; another run "
                                   "is starting with this name: wait, or choose another run_name")
            raise RunLeaseHeld(self._held_message(seen))
        self.record = replace(self.record, claims=seen.claims())

    def _refresh(self) -> None:
        self.record = replace(self.record, heartbeat_at=time.time())
        sent = time.monotonic()
        etag = self._put(if_match=self._etag)
        if etag is None:
            seen = self._read()
            by = seen.record.describe(age_s=seen.age_s) if seen and seen.record else "nobody (deleted)"
            self._lost = RunLeaseLost(
                f"run {self.run_name!r}: the lease {self.uri} was taken over or deleted while this run trained (now "
                f"held by {by}); this run stops so that two runs never write one name's checkpoints. Its local "
                f"checkpoints are intact under {self.record.run_dir}")
            self.log(str(self._lost))
            return
        if self._since_renewal() > self.expires_after_s:  # it had expired by the time this write got through
            self.log(f"renewed {self.uri} after {self._since_renewal():.0f} s without a renewal; nobody took "
                     "the name meanwhile, S3 writes go on")
        with self._renewal_lock:
            self._etag, self._renewed_at, self._expired_logged = etag, sent, False

    def _beat(self) -> None:
        delay = 1.0
        while not self._stop.wait(self.heartbeat_every_s if self._etag is not None else delay):
            try:
                if self._etag is None:
                    self._claim()
                else:
                    self._refresh()
                delay = 1.0
            except RunLeaseHeld as error:
                self._lost = error
                self.log(str(error))
            except StoreError as error:
                delay = min(delay * 2, self.heartbeat_every_s)
                self.log(f"{'claim' if self._etag is None else 'heartbeat'} of {self.uri} failed ({error}); retrying")
            if self._lost is not None:
                return

    def _watch_expiry(self) -> None:
        """Say when the claim expires on our side, at that moment: the heartbeat thread may be blocked in a
        request for as long as its client's timeouts allow."""
        while not self._stop.wait(self._until_expiry_s()):
            if self._lost is not None:
                return
            with self._renewal_lock:
                expired = self._etag is not None and not self.held and not self._expired_logged
                self._expired_logged = self._expired_logged or expired
            if expired:
                self.log(f"no renewal of {self.uri} for {self._since_renewal():.0f} s: this run no longer counts "
                         "as holding its name and writes nothing to S3 until a renewal succeeds")

    def _until_expiry_s(self) -> float:
        if self._renewed_at is None or self._expired_logged:
            return self.heartbeat_every_s  # a renewal comes no sooner, and the next expiry later still
        return max(self.expires_after_s - self._since_renewal(), 0.0) + 0.01

    def _since_renewal(self) -> float:
        return float("inf") if self._renewed_at is None else time.monotonic() - self._renewed_at

    def _free_because(self, seen: _Seen) -> str | None:
        """Why an existing lease may be taken over, or None while its owner is live."""
        record = seen.record
        if record is not None and record.owner == self.record.owner:
            return "our own claim"
        if record is not None and record.released_at is not None:
            return f"released by its owner at {_iso(record.released_at)}"
        # The owner's writes land within its own stale time of its last renewal: never take it over before that.
        stale = max(self.stale_after_s, record.stale_after_s if record is not None else 0.0)
        if seen.age_s is not None and seen.age_s > stale + _SERVER_DATE_RESOLUTION_S:
            return f"no heartbeat for {seen.age_s:.0f} s (stale after {stale:.0f} s)"
        if record is None:
            return None if seen.age_s is not None else "unreadable, with no time to judge it by"
        if self._same_pid_namespace(record) and not _pid_running(record.pid):
            return (f"PID {record.pid} is no longer running on this host (same boot, PID namespace "
                    f"{record.pid_ns})")
        return None

    def _same_pid_namespace(self, record: LeaseRecord) -> bool:
        """Whether `record.pid` is a PID of our own namespace: the same kernel boot (a namespace's id is
        unique only within one) and the same PID namespace; unknown on either side counts as not."""
        ours = self.record
        return (None not in (ours.boot_id, ours.pid_ns) and record.boot_id == ours.boot_id
                and record.pid_ns == ours.pid_ns)

    def _held_message(self, seen: _Seen) -> str:
        holder = seen.record.describe(age_s=seen.age_s) if seen.record else "an unreadable lease object"
        return (f"run {self.run_name!r} is already running as {holder} (lease {self.uri}); checkpoints in S3 are "
                f"shared by run name, so this run does not start. Wait for it to finish, choose another run_name, "
                f"or, if that run is gone, delete {self.uri} (a lease without a heartbeat for "
                f"{self.stale_after_s:.0f} s is taken over by the next start)")

    # ---- S3 ----------------------------------------------------------------------------------------

    def _put(self, *, if_absent: bool = False, if_match: str | None = None,
             record: LeaseRecord | None = None) -> str | None:
        """Write our record (or `record`) under a precondition; its ETag, or None when the precondition failed."""
        body = json.dumps(asdict(record or self.record), indent=2).encode()
        try:
            info = self.store.put_bytes(self.key, body, content_type="application/json",
                                        if_absent=if_absent, if_match=if_match)
        except PreconditionFailed:
            return None
        return info.etag

    def _read(self) -> _Seen | None:
        return _read_lease(self.store, self.key)


def _read_lease(store: ObjectStore, key: str) -> _Seen | None:
    """The lease at `key` as the server has it now (None: there is none)."""
    with store._errors(key):
        try:
            response = store.client.get_object(Bucket=store.bucket, Key=key)
            body = response["Body"].read()
        except ClientError as error:
            if _not_found(error):
                return None
            raise
    server_now = response["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
    modified = response.get("LastModified")
    age = (parsedate_to_datetime(server_now) - modified).total_seconds() if server_now and modified else None
    try:
        record = LeaseRecord.from_json(json.loads(body))
    except (ValueError, TypeError):  # not JSON, not an object, or a required field missing
        record = None
    if age is None and record is not None:  # no server clock to go by: the owner's own heartbeat time
        age = time.time() - record.heartbeat_at
    return _Seen(record=record, etag=response["ETag"].strip('"'), age_s=age, modified=modified)


def _not_found(error: ClientError) -> bool:
    return str(error.response.get("Error", {}).get("Code", "")) in {"NoSuchKey", "404", "NotFound"}


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")

