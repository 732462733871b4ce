"""The online training loop: one process per device (torchrun), DDP over the drafter, exact resume.

Rank 0 logs (console progress bar, JSONL metrics) and writes checkpoints, which a background thread
uploads to S3 with the run's record (run.yaml, provenance.json, metrics.jsonl) at the start and after
each checkpoint (dflash_core.train.uploader: an S3 outage does not stop training); every rank restores
the same step, sampler position and RNG state, so a resumed run continues bit-for-bit (on CPU).

Nothing in a step waits for the device: batches are packed ahead on a background thread
(dflash_core.train.prefetch) and copied asynchronously, metrics stay on the device until a log step,
and ranks agree on a stop request every `stop_check_every` steps, so the host queues step n+1 while
the GPU still runs step n. `StepTiming` says where the main thread's time went.
"""

from __future__ import annotations

import json
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dflash_core.storage.disk import RUN_DISK_FULL_ADVICE, append_whole, write_atomically
from dflash_core.layout import (
    DEFAULT_PREFIXES, TRAIN_RUN_FILES, ArtifactKind, checkpoints_key, run_lease_key, train_report_key,
)
from dflash_core.model.dflash2 import config_from_dict, variant_of
from dflash_core.provenance import current_producer
from dflash_core.target import validate_capture
from dflash_core.train import checkpoint as ckpt
from dflash_core.train.data import collate, data_passes
from dflash_core.train.devices import Distributed
from dflash_core.train.metrics_window import MetricsWindow, to_host
from dflash_core.train.report import trim_metrics
from dflash_core.train.step import batch_tensors
from dflash_core.train.strategies import PlainSteps, StepContext, StepStrategy, StepTiming

if TYPE_CHECKING:  # the object store needs boto3: imported only where a store is used
    from dflash_core.target.gdn_packing import GDNKernels
    from dflash_core.storage import ObjectStore
    from dflash_core.train.parts import TrainingParts
    from dflash_core.train.run_lease import RunLease
    from dflash_core.train.uploader import CheckpointUploader

EXIT_PREEMPTED = 143  # SIGTERM: checkpoint written, rerun with resume to continue


@dataclass
class TrainResult:
    final_step: int
    checkpoint: Path | None
    preempted: bool
    metrics_path: Path


def record_target_kernels(run_dir: Path, kernels: GDNKernels) -> None:
    """`target_kernels` in the run's provenance.json (written beside run.yaml, created if absent)."""
    path = run_dir / "provenance.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["target_kernels"] = kernels.as_dict()
    write_atomically(path, json.dumps(record, indent=2), what="the run record provenance.json",
                     advice=RUN_DISK_FULL_ADVICE)


class Trainer:
    """The loop over assembled parts (`dflash_core.train.assemble.build_trainer` makes one from a
    config): steps, logs, checkpoints, resume, stop requests. `model` is what a step's forward calls
    (the drafter, or DDP around it)."""

    def __init__(self, parts: TrainingParts, model: torch.nn.Module, *, store: ObjectStore | None = None,
                 dist_info: Distributed | None = None, checkpoint_prefix: str | None = None,
                 flow_run_id: str | None = None, s3_outage_limit_s: float | None = None,
                 lease: RunLease | None = None, s3_prefixes: dict[ArtifactKind, str] | None = None):
        """`s3_outage_limit_s`: how long checkpoint uploads may keep failing before the run fails (None: the
        uploader's default); `lease`: this run's claim on its name in S3 (rank 0): uploads start once it is
        held, the run stops if it is lost; `s3_prefixes`: the bucket's layout (None: DEFAULT_PREFIXES), which
        keys the run's checkpoints (unless `checkpoint_prefix` is given) and its record in S3."""
        config = parts.config
        prefixes = s3_prefixes or DEFAULT_PREFIXES
        self.parts = parts
        self.model = model
        self.config = config
        self.store = store
        self.dist = dist_info or Distributed.from_env()
        self.checkpoint_prefix = checkpoint_prefix or checkpoints_key(prefixes, config.run_name)
        self.lease_key = run_lease_key(prefixes, config.run_name)
        self.flow_run_id = flow_run_id
        self.run_dir = config.run_dir
        self.run_file_keys = {name: train_report_key(prefixes, config.run_name, name) for name in TRAIN_RUN_FILES}
        self.s3_outage_limit_s = s3_outage_limit_s
        self.lease = lease
        self.uploader: CheckpointUploader | None = None
        context = StepContext(parts=parts, model=model, dist=self.dist)
        if config.pair_overlap:
            from dflash_core.train.pair_overlap import PairOverlapSteps

            self.steps: StepStrategy = PairOverlapSteps(context)
        else:
            self.steps = PlainSteps(context)
        self.stop_check_every = config.stop_check_every
        self.batches_per_epoch = len(parts.sampler)  # before the prefetch thread draws from the sampler
        self.step = 0
        self._stop_requested = False

    # the parts a caller reads most
    target = property(lambda self: self.parts.target)
    drafter = property(lambda self: self.parts.drafter)
    drafter_config = property(lambda self: self.parts.drafter_config)
    corpus = property(lambda self: self.parts.corpus)
    sampler = property(lambda self: self.parts.sampler)
    capture = property(lambda self: self.parts.capture)
    optimizer = property(lambda self: self.parts.optimizer)
    scheduler = property(lambda self: self.parts.scheduler)
    target_kernels = property(lambda self: self.parts.target_kernels)
    inputs = property(lambda self: self.parts.inputs)
    target_device = property(lambda self: self.parts.devices.target)
    drafter_device = property(lambda self: self.parts.devices.drafter)

    # ---- state ---------------------------------------------------------------------------------

    def _train_state(self) -> dict:
        sampler = self.steps.sampler_state()
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": dict(sampler), "rng": ckpt.capture_rng_state(), "step": self.step}

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        meta = {"config": self.config.model_dump(mode="json"), "drafter_config": self.drafter_config.to_dict(),
                "loss": self.drafter.loss.to_dict(),
                "producer": current_producer(flow_run_id=self.flow_run_id).model_dump(),
                "target_kernels": self.target_kernels.as_dict() if self.target_kernels else None}
        path = ckpt.save_checkpoint(self.run_dir / "checkpoints", step=self.step,
                                    model_state=self.drafter.state_dict(), train_state=self._train_state(),
                                    meta=meta, keep_last=self.config.keep_last)
        if self.uploader is not None:
            self.uploader.submit(path)
            self.uploader.submit_run_files()
        return path

    def _start_uploader(self) -> None:
        """Rank 0 with a store: the background uploader, which first reconciles S3 with local checkpoints, then
        uploads the run's record."""
        if self.store is None or not self.config.upload_checkpoints or not self.dist.is_main or self.uploader:
            return
        if self.lease is not None and not self.lease.held:  # S3 was down at the claim: no S3 writes before it
            return
        from dflash_core.train.uploader import DEFAULT_OUTAGE_LIMIT_S, CheckpointUploader

        self.uploader = CheckpointUploader(
            self.store, root=self.run_dir / "checkpoints", key_prefix=self.checkpoint_prefix,
            keep_last=self.config.keep_last, inputs=self.inputs, config=self.config.model_dump(mode="json"),
            producer=current_producer(flow_run_id=self.flow_run_id),
            run_files={key: self.run_dir / name for name, key in self.run_file_keys.items()},
            outage_limit_s=self.s3_outage_limit_s or DEFAULT_OUTAGE_LIMIT_S, lease=self.lease)

    def resume(self) -> bool:
        """Load the latest complete checkpoint (local, else the latest in S3 that no run wrote after losing the
        name to another); False when there is none."""
        root = self.run_dir / "checkpoints"
        path = ckpt.latest_checkpoint(root)
        if path is None and self.store is not None:
            path = self._download_trusted(root)
        if path is None:
            return False
        model_state, state, meta = ckpt.load_checkpoint(path, device="cpu")
        saved, ours = (variant_of(c) for c in (config_from_dict(meta["drafter_config"]), self.drafter_config))
        if saved != ours:
            raise ValueError(f"{path} holds a {saved} drafter but this run's drafter.variant is {ours!r}: resume "
                             "with the variant it was trained as, or start a new run_name")
        saved_taps = list(meta["drafter_config"].get("target_layer_ids") or [])
        if saved_taps and saved_taps != list(self.drafter_config.target_layer_ids):
            raise ValueError(f"{path} holds a drafter reading target layers {saved_taps}, this run's reads "
                             f"{list(self.drafter_config.target_layer_ids)} (the default reads at least 5 since "
                             f"2026-12-05, one per drafter layer before): set drafter.target_layer_ids: {saved_taps} "
                             "to resume it, or start a new run_name")
        saved_optimizer = ((meta.get("config") or {}).get("optim") or {}).get("optimizer", "adamw")
        if saved_optimizer != self.config.optim.optimizer:
            raise ValueError(f"{path} was trained with optim.optimizer={saved_optimizer!r}, this run has "
                             f"{self.config.optim.optimizer!r}: resume with the optimizer it started with, or "
                             "start a new run_name")
        saved_fp8 = bool((meta.get("config") or {}).get("target_fp8", False))
        if saved_fp8 != self.config.target_fp8:
            warnings.warn(f"{path} was trained with target_fp8={saved_fp8}; this run continues it with "
                          f"target_fp8={self.config.target_fp8}, on states of a differently rounded target",
                          stacklevel=2)
        self.drafter.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        ckpt.restore_rng_state(state["rng"])
        self.step = state["step"]
        return True

    def _download_trusted(self, root: Path) -> Path | None:
        """The newest checkpoint in S3 that the run name's claims trust (dflash_core.train.remote), into `root`:
        rank 0 judges by its own lease, other ranks by the lease in S3."""
        from dflash_core.train.remote import download_checkpoint, latest_trusted_checkpoint
        from dflash_core.train.run_lease import read_claims

        claims = self.lease.claims if self.lease is not None else read_claims(self.store, self.lease_key)
        found = latest_trusted_checkpoint(self.store, self.checkpoint_prefix, claims,
                                          log=lambda message: print(message, flush=True))
        if found is None:
            return None
        return download_checkpoint(self.store, key_prefix=self.checkpoint_prefix, step=found.step, root=root,
                                   sha256=found.sha256)

    # ---- training ------------------------------------------------------------------------------

    def validate_capture(self) -> None:
        """Check captures (finite, varying, right tokens) on the first batches before a long run."""
        batches = iter(self.sampler.epoch_batches(0))
        for _ in range(self.config.validate_capture_batches):
            indices = next(batches, None)
            if indices is None:
                return
            tensors = batch_tensors(collate(self.corpus, indices, token_budget=self.config.token_budget),
                                    self.target_device)
            captured = self.capture(tensors["input_ids"], position_ids=tensors["position_ids"],
                                    host_position_ids=tensors["host_position_ids"], gdn_summary=True)
            validate_capture(captured, input_ids=tensors["input_ids"], hidden_size=self.drafter_config.hidden_size)

    def run(self, *, on_log=None, on_step=None) -> TrainResult:
        """Train to `config.max_steps`. `on_log(record)` after each logged record (rank 0);
        `on_step(step=, metrics=, timing=)` after every optimizer step: the metrics still on the device
        (reading them syncs), `timing` a StepTiming."""
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main and self.target_kernels is not None:
            record_target_kernels(self.run_dir, self.target_kernels)
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.dist.is_main:
            self._resume_metrics(metrics_path)
        previous = signal.signal(signal.SIGTERM, self._request_stop)
        self.steps.open()
        last_checkpoint = None
        saved_step = -1
        started = time.perf_counter()
        tokens_since_log = 0
        window = MetricsWindow()
        graphed_layers = config.compile and config.compile_mode == "reduce-overhead"
        self._start_uploader()
        try:
            while self.step < config.max_steps and not self._stop_agreed():
                if self.lease is not None:
                    self.lease.raise_if_lost()
                    self._start_uploader()  # a no-op once started
                if self.uploader is not None:
                    self.uploader.raise_if_failed()
                timing = StepTiming()
                if graphed_layers:  # a new iteration: the last step's graph outputs may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                metrics, tokens = self.steps.step(self.step, timing)
                self.step += 1
                tokens_since_log += tokens
                if self.dist.is_main:
                    window.add(metrics)
                if self.dist.is_main and (self.step % config.log_every == 0 or self.step == config.max_steps):
                    waited = time.perf_counter()
                    window_means = to_host(window.pop())  # the one device->host sync of the window
                    timing.wait_s = time.perf_counter() - waited
                    elapsed = time.perf_counter() - started
                    record = self._log_record(to_host(metrics), tokens_since_log / max(elapsed, 1e-9),
                                              window=window_means)
                    append_whole(metrics_path, json.dumps(record) + "\n", what=f"the metrics record of step {self.step}",
                                 advice=RUN_DISK_FULL_ADVICE)
                    if on_log is not None:
                        on_log(record)
                    started, tokens_since_log = time.perf_counter(), 0
                if on_step is not None:
                    on_step(step=self.step, metrics=metrics, timing=timing)
                if self.step % config.checkpoint_every == 0 or self.step == config.max_steps:
                    last_checkpoint = self.save() or last_checkpoint
                    saved_step = self.step
                    self._barrier()
            preempted = self.step < config.max_steps
            if preempted and saved_step != self.step:
                last_checkpoint = self.save() or last_checkpoint
                self._barrier()
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.steps.close()
        if self.dist.is_main:  # a rerun of a finished run saves nothing: its result is the latest checkpoint
            last_checkpoint = last_checkpoint or ckpt.latest_checkpoint(self.run_dir / "checkpoints")
        self._wait_for_claim()
        if self.uploader is not None:
            self.uploader.finish(final=last_checkpoint)
        return TrainResult(self.step, last_checkpoint, preempted, metrics_path)

    def _resume_metrics(self, path: Path) -> None:
        """metrics.jsonl as of this run's step: the steps after it are logged again, so they (and a torn last
        line) are cut. A run resumed where the log is not (a fresh machine) starts from S3's copy; the
        uploader's first upload of the run's record then replaces S3's with the cut one."""
        uploads = self.store is not None and self.config.upload_checkpoints
        if self.step and uploads and not path.exists():
            from dflash_core.storage import ObjectNotFound, StoreUnavailable

            key = self.run_file_keys["metrics.jsonl"]
            try:
                write_atomically(path, self.store.get_bytes(key), what=f"{path.name} from {self.store.uri(key)}",
                                 advice=RUN_DISK_FULL_ADVICE)
            except ObjectNotFound:
                pass
            except StoreUnavailable as error:  # the log restarts here; S3's copy is replaced at the next upload
                print(f"{self.store.uri(key)} could not be read ({error}): metrics.jsonl starts at step "
                      f"{self.step + 1}", flush=True)
        if cut := trim_metrics(path, step=self.step):
            print(f"{path}: cut {cut} line(s) after step {self.step}, which this run logs again", flush=True)

    def _wait_for_claim(self) -> None:
        """A claim still pending at the end (S3 down since the start): wait for it as long as uploads may
        fail, then start the uploader, whose finish puts the final checkpoint in S3."""
        if self.lease is None or self.uploader is not None or self.store is None or not self.config.upload_checkpoints:
            return
        from dflash_core.train.uploader import DEFAULT_OUTAGE_LIMIT_S, CheckpointUploadFailed

        limit = self.s3_outage_limit_s or DEFAULT_OUTAGE_LIMIT_S
        if not self.lease.wait_held(limit):
            self.lease.raise_if_lost()
            raise CheckpointUploadFailed(f"could not claim the run name at {self.lease.uri} within the outage limit "
                                         f"of {limit:.0f} s, so no checkpoint went to S3; local checkpoints are "
                                         f"intact under {self.run_dir / 'checkpoints'}: rerun with --resume")
        self._start_uploader()

    def _log_record(self, metrics: dict[str, torch.Tensor], tokens_per_s: float, *,
                    window: dict[str, torch.Tensor] | None = None) -> dict:
        """The last step's metrics at the top level; `window`: their means over the steps since the last
        record (`window.steps` of them), which is what to read: one step's accuracy is noisy."""
        passes = data_passes(self.steps.sampler_state(), batches_per_epoch=self.batches_per_epoch)
        record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": round(tokens_per_s, 1),
                  "data_passes": round(passes, 3)}
        record.update(to_host(metrics))
        if window:
            record["window"] = to_host(window)
            record["window"]["steps"] = int(record["window"]["steps"])
        if self.drafter_device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.drafter_device) / 2**30
        return record

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: SIGTERM reaches ranks at different moments, and a rank
        that left the loop alone would leave the others waiting in their next all-reduce."""
        if self.dist.world_size == 1 or not dist.is_initialized():
            return self._stop_requested
        if self.step % self.stop_check_every:  # every rank skips the same steps: no collective, no sync
            return False
        flag = torch.tensor([float(self._stop_requested)], device=self.drafter_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _barrier(self) -> None:
        if self.dist.world_size > 1 and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        self.capture.close()
        if self.uploader is not None:
            self.uploader.close()
