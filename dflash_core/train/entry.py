"""Process entry point of a training run: `python -m dflash_core.train.entry --config run.yaml`,
one process per device (per GPU pair in the pair layout) under torchrun, on one node or many
(`training_argv` builds the torchrun command from a `Rendezvous`).

Exit codes: 0 done (with the final checkpoint complete in S3 when uploading), 143 stopped by SIGTERM
after writing a checkpoint (rerun with --resume), 1 with a one-line `error: <reason>` (the run is
already running, in this run dir or, by its lease in S3, anywhere else; S3 is misconfigured or stayed
down past --s3-outage-limit-s; the disk is full at a checkpoint, the run record, a metrics record or the
target's conversion; a ValueError, this project's user error, as `error: run config: ...`; data whose
quality gate refuses it, or whose token ids the target's vocabulary lacks, as `error: training data
refused: ...`), which the flow does not retry (dflash_core.train.rank_failure). A rank whose loop raises
anything else prints `failed at step N` before its traceback.
Rank 0 of a run with S3 checkpoints holds the run name's lease
(dflash_core.train.run_lease) from before it touches a checkpoint to its exit.
Every rank prints one `rank-summary {json}` line at the end: step, a checksum of its drafter
weights (DDP replicas must agree) and peak GPU memory per device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dflash_core.data.verdict import UnusableData
from dflash_core.layout import checkpoints_key, run_lease_key
from dflash_core.lineage_refs import DigestCache
from dflash_core.provenance import current_producer
from dflash_core.settings import Settings, load_settings
from dflash_core.train.checkpoint import complete_checkpoints, latest_checkpoint, remove_debris
from dflash_core.train.config import TrainConfig
from dflash_core.storage.disk import RUN_DISK_FULL_ADVICE, DiskFull, write_atomically
from dflash_core.train.assemble import build_trainer
from dflash_core.train.devices import Distributed, TrainDevices, resolve_devices
from dflash_core.train.loop import EXIT_PREEMPTED, Trainer
from dflash_core.train.launch_argv import Rendezvous, training_argv  # noqa: F401 - re-exported
from dflash_core.train.rank_failure import error_line, failed_at_step_line
from dflash_core.train.run_lock import RunLock, RunLocked

if TYPE_CHECKING:  # boto3 is imported only when a run reads S3 or uploads checkpoints
    from dflash_core.storage import ObjectStore
    from dflash_core.train.run_lease import RunLease

DEFAULT_PG_TIMEOUT_S = 600  # > the longest wait at a barrier: rank 0 writing (and uploading) a checkpoint


def write_run_record(config: TrainConfig) -> None:
    """run.yaml (the resolved config: defaults filled in, e.g. drafter.num_anchors from the token budget) and
    provenance.json (git SHA, versions, argv) beside the checkpoints."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    versions = {name: _version(name) for name in ("dflash-pipeline", "torch", "transformers", "prefect")}
    record = {**current_producer().model_dump(), "versions": versions, "python": sys.version.split()[0]}
    for name, text in (("run.yaml", config.resolved().to_yaml()), ("provenance.json", json.dumps(record, indent=2))):
        write_atomically(config.run_dir / name, text, what=f"the run record {name}", advice=RUN_DISK_FULL_ADVICE)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def refuse_unsupported_fp8(config: TrainConfig, devices: TrainDevices) -> None:
    """target_fp8 or lm_head_fp8 on a device without row-wise FP8 GEMMs, or drafter_fp8 on one torchao's float8 training
    cannot use: an `error:` line before the target loads (the flow reads it as a refusal, which no retry
    can fix)."""
    from dflash_core.fp8.drafter import supports_drafter_fp8
    from dflash_core.fp8.target import supports_fp8

    why = supports_fp8(devices.target) if config.target_fp8 else None
    if why is not None:
        raise SystemExit(f"error: target_fp8: {why}; set target_fp8: false to keep the target in its own dtype")
    why = supports_fp8(devices.drafter) if config.lm_head_fp8 else None
    if why is not None:
        raise SystemExit(f"error: lm_head_fp8: {why}; set lm_head_fp8: false to keep the loss's LM-head GEMMs in bf16")
    why = supports_drafter_fp8(devices.drafter, config.drafter_fp8_recipe) if config.drafter_fp8 else None
    if why is not None:
        raise SystemExit(f"error: drafter_fp8: {why}; set drafter_fp8: false to train the drafter's GEMMs in bf16")


def refuse_flex_off_gpu(config: TrainConfig, devices: TrainDevices) -> None:
    """attention_backend flex with the drafter off a GPU (flex_attention has no backward on the CPU): an `error:`
    line before the target loads, rather than torch's error at the first step."""
    if config.attention_backend == "flex" and devices.drafter.type != "cuda":
        raise SystemExit(f"error: attention_backend: flex trains on a CUDA GPU only (flex_attention has no backward on "
                         f"{devices.drafter.type}); set attention_backend: auto (flex on a GPU, sdpa elsewhere) or sdpa")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one DFlash training process.")
    parser.add_argument("--config", type=Path, required=True, help="run.yaml (TrainConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--flow-run-id", default=None, help="Prefect flow run that launched this run (lineage)")
    parser.add_argument("--pg-timeout-s", type=float, default=DEFAULT_PG_TIMEOUT_S,
                        help="a collective waiting this long (a rank died) ends the process")
    parser.add_argument("--s3-outage-limit-s", type=float, default=os.environ.get("DFLASH_S3_OUTAGE_LIMIT_S"),
                        help="how long checkpoint uploads may keep failing (S3 down) before the run fails, default "
                             "300; training goes on with local checkpoints meanwhile (env DFLASH_S3_OUTAGE_LIMIT_S)")
    parser.add_argument("--host-name", default=os.environ.get("DFLASH_HOST_NAME"),
                        help="the name this host gives in the run's lease in S3, default the system's host name "
                             "(env DFLASH_HOST_NAME; set it where containers share one)")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig.from_yaml(args.config, overrides=args.set)
    except ValueError as error:
        raise SystemExit(error_line("config", error)) from None
    dist_info = Distributed.from_env()
    lock = lease = None
    if dist_info.is_main:  # one run per run dir (also on a shared output_dir): a second would delete our saves
        try:
            lock = RunLock(config.run_dir, run_name=config.run_name).acquire()
        except RunLocked as error:
            raise SystemExit(f"error: {error}") from None
    settings = load_settings()
    store = _store_if_needed(config, settings)
    try:
        if dist_info.is_main:  # one run per run name in the bucket: checkpoints there are shared by name
            lease = _claim_run_name(store, config, settings, host=args.host_name, resume=args.resume)
            removed = remove_debris(config.run_dir / "checkpoints")
            if removed:
                print(f"removed debris of interrupted saves/prunes: {', '.join(removed)}", file=sys.stderr, flush=True)
        return _train(args, config, dist_info, settings=settings, store=store, lease=lease)
    except DiskFull as error:  # at a checkpoint or the target's conversion; its temp dir is already gone
        raise SystemExit(f"error: {error}") from None
    except UnusableData as error:
        raise SystemExit(error_line("data", error)) from None
    except ValueError as error:  # the config, or a checkpoint or data that does not fit it: the same next time
        raise SystemExit(error_line("config", error)) from None
    finally:
        if lease is not None:
            lease.release()
        if lock is not None:
            lock.release()


def _train(args: argparse.Namespace, config: TrainConfig, dist_info: Distributed, *, settings: Settings,
           store: ObjectStore | None, lease: RunLease | None) -> int:
    devices = resolve_devices(config, dist_info)
    if devices.process.type == "cuda":
        torch.cuda.set_device(devices.process)
    refuse_unsupported_fp8(config, devices)
    refuse_flex_off_gpu(config, devices)
    if dist_info.world_size > 1:
        cuda = devices.process.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=args.pg_timeout_s),
                                device_id=devices.process if cuda else None)
    existing = complete_checkpoints(config.run_dir / "checkpoints")
    if existing and not args.resume:
        raise SystemExit(f"error: {config.run_dir} already holds checkpoints up to {existing[-1].name}: pass "
                         "--resume to continue that run, or choose a new run_name")
    _announce_sigterm(dist_info, config.run_dir / "checkpoints", pg_timeout_s=args.pg_timeout_s)
    checkpoint_prefix = checkpoints_key(settings.s3_prefixes, config.run_name)
    if store is not None and config.upload_checkpoints and dist_info.is_main and not args.resume:
        _refuse_remote_checkpoints(store, checkpoint_prefix)
    trainer = build_trainer(config, store=store, models_dir=settings.work_path("models"), dist_info=dist_info,
                            devices=devices, flow_run_id=args.flow_run_id, s3_outage_limit_s=args.s3_outage_limit_s,
                            checkpoint_prefix=checkpoint_prefix, lease=lease, s3_prefixes=settings.s3_prefixes,
                            digests=DigestCache(settings.work_path("cache", "sha256.json")))
    try:
        if dist_info.is_main:
            write_run_record(config)
        resumed = args.resume and trainer.resume()
        _ranks_agree_on_step(trainer)
        if not resumed:
            trainer.validate_capture()
        log = _console_logger(config) if dist_info.is_main else None
        try:
            result = trainer.run(on_log=log)
        except _refusals(store) as error:  # local checkpoints are intact; the message says what to do
            raise SystemExit(f"error: {error}") from None
        except Exception:
            print(failed_at_step_line(trainer.step + 1), file=sys.stderr, flush=True)
            raise
        _print_rank_summary(trainer)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if dist_info.is_main:
        print(json.dumps({"final_step": result.final_step, "checkpoint": str(result.checkpoint),
                          "preempted": result.preempted}), flush=True)
    return EXIT_PREEMPTED if result.preempted else 0


def _claim_run_name(store: ObjectStore | None, config: TrainConfig, settings: Settings, *, host: str | None,
                    resume: bool) -> RunLease | None:
    """Rank 0 of a run that writes (or resumes from) checkpoints in S3 claims its name there, before it
    touches any checkpoint; another live claimant anywhere is refused with an `error:` line naming it."""
    if store is None or not (config.upload_checkpoints or resume):
        return None
    from dflash_core.storage import StoreError
    from dflash_core.train.run_lease import RunLease

    lease = RunLease(store, run_lease_key(settings.s3_prefixes, config.run_name), run_name=config.run_name,
                     run_dir=config.run_dir, host=host)
    try:
        return lease.acquire()
    except StoreError as error:  # a live owner, or a configuration error: retrying at once cannot help
        raise SystemExit(f"error: {error}") from None


def _store_if_needed(config: TrainConfig, settings: Settings) -> ObjectStore | None:
    if not config.upload_checkpoints and all(Path(item).is_file() for item in config.data):
        return None
    from dflash_core.storage import ObjectStore, StoreError, StoreUnavailable

    store = ObjectStore.from_settings(settings)
    try:
        store.check()
    except StoreUnavailable as error:
        if not all(Path(item).is_file() for item in config.data):
            raise SystemExit(f"error: {error}") from None
        # Local data: train now; the uploader retries until S3 is back or the outage limit passes.
        print(f"warning: {error}; training starts on local data, checkpoint uploads wait for S3",
              file=sys.stderr, flush=True)
    except StoreError as error:  # wrong credentials, missing bucket, not S3: say which, at once
        raise SystemExit(f"error: {error}") from None
    return store


def _refuse_remote_checkpoints(store: ObjectStore, prefix: str) -> None:
    """A fresh run must not mix its checkpoints with another run's of the same name in S3 (the S3 prune
    keeps the newest steps, which would be the other run's)."""
    from dflash_core.storage import StoreUnavailable
    from dflash_core.train.remote import remote_steps

    try:
        steps = remote_steps(store, prefix)
    except StoreUnavailable:
        return  # S3 is down: the uploader's reconcile looks again when it is back
    if steps:
        raise SystemExit(f"error: {store.uri(prefix)}/ already holds checkpoints up to step {steps[-1]}: pass "
                         "--resume to continue that run, or choose a new run_name")


def _refusals(store: ObjectStore | None) -> tuple[type[Exception], ...]:
    """What ends a run with an `error:` line: uploads that cannot succeed, the run name lost to another run."""
    if store is None:
        return ()
    from dflash_core.train.run_lease import RunLeaseHeld, RunLeaseLost
    from dflash_core.train.uploader import CheckpointUploadFailed

    return (CheckpointUploadFailed, RunLeaseHeld, RunLeaseLost)


def _ranks_agree_on_step(trainer: Trainer) -> None:
    """Every rank must start at the same step: a node that found no checkpoint (no shared output_dir,
    no S3 upload) would otherwise train from step 0 beside ranks that resumed."""
    if not dist.is_initialized():
        return
    device = trainer.drafter_device if trainer.drafter_device.type == "cuda" else torch.device("cpu")
    steps = torch.tensor([trainer.step, -trainer.step], device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    high, low = int(steps[0]), -int(steps[1])
    if high != low:
        raise ValueError(f"ranks resumed at different steps ({low} to {high}): every node must see the same "
                         "checkpoints (a shared output_dir, or upload_checkpoints with S3)")


def weights_checksum(module: torch.nn.Module) -> str:
    """A bit-exact fingerprint of a module's weights, computed on their device: per tensor, the sum
    of its raw bits and of bits x position (int64, wrapping, so independent of reduction order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().contiguous().view(-1)
        bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()])
        bits = bits.to(torch.int64)
        positions = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
        digest.update(f"{name}:{int(bits.sum())}:{int((bits * positions).sum())};".encode())
    return digest.hexdigest()[:16]


def _print_rank_summary(trainer: Trainer) -> None:
    devices = {str(d): d for d in (trainer.target_device, trainer.drafter_device) if d.type == "cuda"}
    checksum = weights_checksum(trainer.drafter)
    summary = {"rank": trainer.dist.rank, "step": trainer.step, "drafter_checksum": checksum,
               "peak_gib": {name: round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for name, d in devices.items()}}
    print("rank-summary " + json.dumps(summary), flush=True)
    if not dist.is_initialized():
        return
    # Tensors only (no pickled objects in flight at exit): equal checksums iff max == min over ranks.
    value = int(checksum[:15], 16)
    device = trainer.drafter_device if trainer.drafter_device.type == "cuda" else torch.device("cpu")
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if trainer.dist.is_main:
        same = int(extremes[0]) == -int(extremes[1])
        print(f"drafter weights on {dist.get_world_size()} ranks: {'identical' if same else 'DIFFERENT'}", flush=True)
    dist.barrier()


def _announce_sigterm(dist_info: Distributed, checkpoints: Path, *, pg_timeout_s: float) -> None:
    """Say on stderr, from a thread, when this rank gets SIGTERM: torchrun sends it to every rank when
    one rank dies, and a rank blocked in a collective with the dead one cannot run Python handlers
    (torchrun then kills it after 30 s; without torchrun the process-group timeout ends it)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch(reader: socket.socket, writer: socket.socket) -> None:
        """Runs for the process's life: its frame keeps both ends open (the handler writes to `writer`)."""
        while signal.SIGTERM not in reader.recv(64):
            pass
        latest = latest_checkpoint(checkpoints)
        print(f"[rank {dist_info.rank}] SIGTERM: stopping at the next step boundary. If another rank died, "
              f"this one may be blocked in a collective with it: torchrun ends it within 30 s, the process-group "
              f"timeout within {pg_timeout_s:.0f} s. Rerun with --resume to continue from the last complete "
              f"checkpoint ({latest.name if latest else 'none yet'}).", file=sys.stderr, flush=True)
        time.sleep(20)
        print(f"[rank {dist_info.rank}] still running 20 s after SIGTERM: writing a checkpoint, or blocked in a "
              "collective with a rank that died", file=sys.stderr, flush=True)
        while reader.recv(64):
            pass

    threading.Thread(target=watch, args=(reader, writer), name="sigterm-announcer", daemon=True).start()


def _console_logger(config: TrainConfig):
    def log(record: dict) -> None:
        # The window's means (over the last log_every steps), not one noisy step.
        means = record.get("window") or record
        accuracy = means.get("accuracy_per_position", [])
        head = " ".join(f"{a:.2f}" for a in (accuracy[:4] if isinstance(accuracy, list) else [accuracy]))
        print(f"step {record['step']:>6}/{config.max_steps} loss {means['loss']:.4f} "
              f"tau {means['acceptance_length']:.3f} acc[1..] {head} lr {record['lr']:.2e} "
              f"{record['tokens_per_s']:,.0f} tok/s", flush=True)
    return log


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
