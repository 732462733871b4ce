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
import math
import os
import signal
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.profiler import record_function

from dflash_core.hybrid import GDNKernels, install_packed_gdn
from dflash_core.layout import DEFAULT_PREFIXES, TRAIN_RUN_FILES, ArtifactKind, train_report_key
from dflash_core.model.dflash2 import config_from_dict, variant_of
from dflash_core.model.init_from_target import init_from_target_layers
from dflash_core.provenance import current_producer
from dflash_core.target import (
    HiddenStateCapture, compile_decoder_layers, has_recurrent_layers, language_model, quantize_decoder_layers_fp8,
    target_heads, use_flex_attention, validate_capture,
)
from dflash_core.train import checkpoint as ckpt
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import (
    PackedBatchSampler, TokenizedCorpus, collate, load_corpus, read_shard_table, samples_with_loss,
)
from dflash_core.train.inputs import fetch_shards, load_target_model
from dflash_core.train.prefetch import BatchPrefetcher, InlineBatches, batch_preparer
from dflash_core.train.report import end_torn_line
from dflash_core.train.drafter_setup import drafter_config_for, load_target_tokenizer
from dflash_core.train.metrics_window import MetricsWindow, to_host
from dflash_core.train.step import batch_tensors, capture_batch, drafter_step, step_generator

if TYPE_CHECKING:  # the object store needs boto3: imported only where a store is used
    from dflash_core.lineage import InputRef
    from dflash_core.storage import ObjectStore
    from dflash_core.train.run_lease import RunLease
    from dflash_core.train.uploader import CheckpointUploader

EXIT_PREEMPTED = 143  # SIGTERM: checkpoint written, rerun with resume to continue


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class StepTiming:
    """Main-thread seconds of one optimizer step. prepare: getting its batches ready (the wait on the
    prefetch queue and the queued copies; packing itself when prefetch is off); dispatch: queuing its
    target forward, drafter step and optimizer (a full CUDA launch queue makes this wait on the GPU
    too); wait: blocked on the device for the metrics of a log step. When prepare + dispatch stay well
    under the step time the host is off the critical path."""

    prepare_s: float = 0.0
    dispatch_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class TrainResult:
    final_step: int
    checkpoint: Path | None
    preempted: bool
    metrics_path: Path


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _devices(config: TrainConfig, dist_info: Distributed) -> tuple[torch.device, torch.device]:
    default = f"cuda:{dist_info.local_rank}" if torch.cuda.is_available() else "cpu"
    target = torch.device(config.target_device or default)
    drafter = torch.device(config.drafter_device or target) if config.placement == "pair" else target
    return target, drafter


def quantize_target(target, *, device: torch.device, log: bool) -> None:
    """The target's decoder-layer GEMMs to FP8, or a ValueError saying why this device cannot."""
    from dflash_core.fp8 import supports_fp8

    why = supports_fp8(device)
    if why is not None:
        raise ValueError(f"target_fp8: {why}; set target_fp8: false to keep the target in its own dtype")
    quantized, kept = quantize_decoder_layers_fp8(target)
    if log:
        print(f"target GEMMs: fp8 ({quantized} linears; {kept} kept in their dtype: unaligned or narrow)",
              file=sys.stderr, flush=True)


def record_target_kernels(run_dir: Path, kernels: GDNKernels) -> None:
    """`target_kernels` in the run's provenance.json (written beside run.yaml, created if absent)."""
    path = run_dir / "provenance.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record["target_kernels"] = kernels.as_dict()
    path.write_text(json.dumps(record, indent=2))


class Trainer:
    def __init__(self, config: TrainConfig, *, store: ObjectStore | None = None, models_dir: Path = Path(".dflash/models"),
                 checkpoint_prefix: str | None = None, dist_info: Distributed | None = None,
                 flow_run_id: str | None = None, corpus: TokenizedCorpus | None = None,
                 s3_outage_limit_s: float | None = None, lease: RunLease | None = None,
                 s3_prefixes: dict[ArtifactKind, str] | None = None):
        """`corpus` given (benchmarks, tests) replaces reading `config.data`; `s3_outage_limit_s`: how long
        checkpoint uploads may keep failing before the run fails (None: the uploader's default); `lease`:
        this run's claim on its name in S3 (rank 0): uploads start once it is held, the run stops if it is lost;
        `s3_prefixes`: the bucket's layout (None: DEFAULT_PREFIXES), which keys the run's record in S3."""
        self.prefetch_batches = config.prefetch_batches
        self.stop_check_every = config.stop_check_every
        self.config = config
        self.store = store
        self.dist = dist_info or Distributed.from_env()
        self.checkpoint_prefix = checkpoint_prefix or f"checkpoints/{config.run_name}"
        self.flow_run_id = flow_run_id
        self.run_dir = config.run_dir
        self.run_file_keys = {name: train_report_key(s3_prefixes or DEFAULT_PREFIXES, config.run_name, name)
                              for name in TRAIN_RUN_FILES}
        self.s3_outage_limit_s = s3_outage_limit_s
        self.lease = lease
        self.uploader: CheckpointUploader | None = None
        self.target_device, self.drafter_device = _devices(config, self.dist)
        torch.manual_seed(config.seed)

        self.inputs: list[InputRef] = []
        if corpus is None:
            shards = fetch_shards(config.data, store=store, cache_dir=self.run_dir.parent / ".cache",
                                  allow_failed_quality_gate=config.allow_failed_quality_gate)
            self.inputs = [ref for _, ref in shards if ref is not None]
            corpus = load_corpus([(str(path), read_shard_table(path)) for path, _ in shards])
        self.corpus = corpus
        self.target = load_target_model(config.target, device=self.target_device, models_dir=models_dir,
                                        seed=config.seed)
        if self.target_device.type == "cuda":
            # Packed documents: a BlockMask built from position ids skips the cross-document blocks.
            reason = use_flex_attention(self.target)
            if reason is not None:
                warnings.warn(f"target keeps its attention implementation ({reason}); packed rows cost more",
                              stacklevel=2)
        samples_per_batch = config.max_samples_per_batch
        # Hybrid targets pack exactly when dflash_core.hybrid can restart their GDN layers per document.
        self.target_kernels = install_packed_gdn(self.target) if has_recurrent_layers(self.target.config) else None
        if has_recurrent_layers(self.target.config) and self.target_kernels is None and samples_per_batch != 1:
            warnings.warn("the target has recurrent (linear-attention) layers this trainer cannot restart per "
                          "document: packing is off (max_samples_per_batch=1)", stacklevel=2)
            samples_per_batch = 1
        if self.target_kernels is not None and self.dist.is_main:
            print(f"target kernels: {self.target_kernels}", file=sys.stderr, flush=True)
        self.sampler = PackedBatchSampler(self.corpus.lengths, token_budget=config.token_budget, seed=config.seed,
                                          rank=self.dist.rank, world_size=self.dist.world_size,
                                          drop_samples_without_loss=~samples_with_loss(self.corpus),
                                          max_samples_per_batch=samples_per_batch, packing=config.packing)
        self.drafter_config = drafter_config_for(config, target_config=self.target.config, corpus=self.corpus,
                                                 tokenizer=load_target_tokenizer(config.target, models_dir=models_dir))
        torch.manual_seed(config.seed)
        drafter = self.drafter_config.build(device=self.drafter_device)
        drafter.init_weights()
        if config.drafter.init == "target":
            init_from_target_layers(drafter, language_model(self.target).layers)
        heads = target_heads(self.target)
        if self.drafter_device != self.target_device:  # pair layout: the drafter gets its own frozen copies
            import copy

            heads = type(heads)(**{name: copy.deepcopy(module).to(self.drafter_device)
                                   for name, module in vars(heads).items()})
        drafter.attach_target(heads)
        if config.target_fp8:  # after the drafter copied what it needs (heads, init layers) from the target
            quantize_target(self.target, device=self.target_device, log=self.dist.is_main)
        if config.compile:
            drafter.compile_layers()
            compile_decoder_layers(self.target)
        self.drafter = drafter
        self.model = drafter
        if self.dist.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.drafter_device.index] if self.drafter_device.type == "cuda" else None
            self.model = DistributedDataParallel(drafter, device_ids=device_ids)
        self.teacher = config.drafter.loss_target == "teacher"
        self.capture = HiddenStateCapture(self.target, layer_ids=self.drafter_config.target_layer_ids,
                                          capture_final=self.teacher)
        o = config.optim
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                           fused=self.drafter_device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=o.warmup_steps, total=config.max_steps,
                                                min_ratio=o.min_lr_ratio))
        self.step = 0
        self._stop_requested = False
        self._consumed_sampler_state: dict | None = None  # while batches are prefetched: the trained-on position

    # ---- state ---------------------------------------------------------------------------------

    def _train_state(self) -> dict:
        sampler = self._consumed_sampler_state or self.sampler.state_dict()
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "sampler": dict(sampler), "rng": ckpt.capture_rng_state(), "step": self.step}

    def save(self) -> Path | None:
        if not self.dist.is_main:
            return None
        meta = {"config": self.config.model_dump(mode="json"), "drafter_config": self.drafter_config.to_dict(),
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
            outage_limit_s=self.s3_outage_limit_s or DEFAULT_OUTAGE_LIMIT_S)

    def resume(self) -> bool:
        """Load the latest complete checkpoint (local, else S3); False when there is none."""
        root = self.run_dir / "checkpoints"
        path = ckpt.latest_checkpoint(root)
        if path is None and self.store is not None:
            from dflash_core.train.remote import download_checkpoint, remote_steps

            steps = remote_steps(self.store, self.checkpoint_prefix)
            if steps:
                path = download_checkpoint(self.store, key_prefix=self.checkpoint_prefix, step=steps[-1], root=root)
        if path is None:
            return False
        model_state, state, meta = ckpt.load_checkpoint(path, device="cpu")
        saved, ours = (variant_of(c) for c in (config_from_dict(meta["drafter_config"]), self.drafter_config))
        if saved != ours:
            raise ValueError(f"{path} holds a {saved} drafter but this run's drafter.variant is {ours!r}: resume "
                             "with the variant it was trained as, or start a new run_name")
        saved_fp8 = bool((meta.get("config") or {}).get("target_fp8", False))
        if saved_fp8 != self.config.target_fp8:
            warnings.warn(f"{path} was trained with target_fp8={saved_fp8}; this run continues it with "
                          f"target_fp8={self.config.target_fp8}, on states of a differently rounded target",
                          stacklevel=2)
        self.drafter.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self._consumed_sampler_state = None
        ckpt.restore_rng_state(state["rng"])
        self.step = state["step"]
        return True

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
        if self.dist.is_main and end_torn_line(metrics_path):
            print(f"{metrics_path}: the last record was cut short (a crash mid-write); it is logged again", flush=True)
        previous = signal.signal(signal.SIGTERM, self._request_stop)
        batches = self._open_batches()
        last_checkpoint = None
        saved_step = -1
        started = time.perf_counter()
        tokens_since_log = 0
        window = MetricsWindow()
        self._start_uploader()
        try:
            while self.step < config.max_steps and not self._stop_agreed():
                if self.lease is not None:
                    self.lease.raise_if_lost()
                    self._start_uploader()  # a no-op once started
                if self.uploader is not None:
                    self.uploader.raise_if_failed()
                self._timing = StepTiming()
                metrics, tokens = self._optimizer_step(batches)
                self.step += 1
                tokens_since_log += tokens
                if self.dist.is_main:
                    window.add(metrics)
                if self.dist.is_main and (self.step % config.log_every == 0 or self.step == config.max_steps):
                    waited = time.perf_counter()
                    window_means = to_host(window.pop())  # the one device->host sync of the window
                    self._timing.wait_s = time.perf_counter() - waited
                    elapsed = time.perf_counter() - started
                    record = self._log_record(to_host(metrics), tokens_since_log / max(elapsed, 1e-9),
                                              window=window_means)
                    with open(metrics_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    if on_log is not None:
                        on_log(record)
                    started, tokens_since_log = time.perf_counter(), 0
                if on_step is not None:
                    on_step(step=self.step, metrics=metrics, timing=self._timing)
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
            self._close_batches(batches)
        if self.dist.is_main:  # a rerun of a finished run saves nothing: its result is the latest checkpoint
            last_checkpoint = last_checkpoint or ckpt.latest_checkpoint(self.run_dir / "checkpoints")
        self._wait_for_claim()
        if self.uploader is not None:
            self.uploader.finish(final=last_checkpoint)
        return TrainResult(self.step, last_checkpoint, preempted, metrics_path)

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

    def _optimizer_step(self, batches) -> tuple[dict[str, torch.Tensor], int]:
        config = self.config
        accum = config.optim.grad_accum
        summed: dict[str, torch.Tensor] = {}
        tokens = 0
        timing = self._timing
        started = time.perf_counter()
        for micro in range(accum):
            with record_function("dflash.prepare_batch"):
                prepared = batches.next()
                tensors = prepared.to_device(self.target_device)
            self._consumed_sampler_state = prepared.sampler_state
            ready = time.perf_counter()
            timing.prepare_s += ready - started
            tokens += prepared.batch.num_real_tokens * self.dist.world_size
            with record_function("dflash.target_forward"):
                captured = capture_batch(self.capture, tensors)
            sync = micro == accum - 1 or self.dist.world_size == 1
            context = self.model.no_sync() if not sync and hasattr(self.model, "no_sync") else nullcontext()
            with context, record_function("dflash.drafter_step"):
                metrics = drafter_step(
                    self.model, tensors=tensors, captured=captured, num_anchors=config.resolved_num_anchors,
                    block_size=self.drafter_config.block_size, teacher=self.teacher,
                    generator=step_generator(config.seed, self.step, micro * self.dist.world_size + self.dist.rank),
                    device=self.drafter_device, attention_backend=config.attention_backend, loss_scale=1 / accum)
            for name, value in metrics.items():
                summed[name] = summed.get(name, 0) + value.detach().float() / accum
            started = time.perf_counter()
            timing.dispatch_s += started - ready
        with record_function("dflash.optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), config.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        summed["grad_norm"] = grad_norm.detach()
        timing.dispatch_s += time.perf_counter() - started
        return summed, tokens

    def _open_batches(self):
        """The batch source of the plain step: prefetched on a thread or packed inline. A subclass with
        its own `_optimizer_step` (the pair layout's PairOverlapSteps) draws from the sampler itself."""
        if type(self)._optimizer_step is not Trainer._optimizer_step:
            return iter(self.sampler)
        pin = self.target_device.type == "cuda"
        prepare = batch_preparer(self.corpus, self.sampler, token_budget=self.config.token_budget, pin=pin)
        if not self.prefetch_batches:
            return InlineBatches(prepare)
        return BatchPrefetcher(prepare, depth=self.prefetch_batches, device=self.target_device)

    def _close_batches(self, batches) -> None:
        """Stop the prefetch thread, then rewind the sampler to the last batch trained on: the batches
        queued but not used are drawn again by the next run()."""
        if isinstance(batches, (BatchPrefetcher, InlineBatches)):
            batches.close()
            if self._consumed_sampler_state is not None:
                self.sampler.load_state_dict(self._consumed_sampler_state)
            self._consumed_sampler_state = None

    def _log_record(self, metrics: dict[str, torch.Tensor], tokens_per_s: float, *,
                    window: dict[str, torch.Tensor] | None = None) -> dict:
        """The last step's metrics at the top level; `window`: their means over the steps since the last
        record (`window.steps` of them), which is what to read: one step's accuracy is noisy."""
        record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": round(tokens_per_s, 1)}
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
