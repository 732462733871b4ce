"""One online training step: the frozen target's forward captures the tapped layers of a packed
batch, the drafter trains on them; nothing touches disk.

A step strategy runs a run's optimizer steps: `PlainSteps` (each micro-batch prepared ahead on a
thread, captured, trained on) or, in the pair layout, `dflash_core.train.pair_overlap.PairOverlapSteps`.
Both take a `StepContext` and offer open / step / sampler_state / close.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import torch
from torch.profiler import record_function

from dflash_core.model import plan_blocks
from dflash_core.target import CapturedStates, HiddenStateCapture

if TYPE_CHECKING:  # keeps this module importable with torch alone (the GPU benches' image)
    from dflash_core.model import BlockPlan
    from dflash_core.train.assemble import TrainingParts
    from dflash_core.train.data import PackedBatch
    from dflash_core.train.devices import Distributed

_NAMES = ("input_ids", "position_ids", "document_ids", "loss_mask")
HOST_PREFIX = "host_"  # batch_tensors keeps the host copy of each tensor under host_<name>


def batch_tensors(batch: PackedBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The packed row on `device`, plus its host copies under `host_<name>`: anchor planning and the
    drafter's token ids read those, so no step waits for a GPU to hand the loss mask back."""
    host = {name: torch.from_numpy(getattr(batch, name))[None] for name in _NAMES}
    if device.type == "cuda":  # pinned: the copies below are really asynchronous
        host = {name: tensor.pin_memory() for name, tensor in host.items()}
    tensors = {name: tensor.to(device, non_blocking=True) for name, tensor in host.items()}
    return {**tensors, **{HOST_PREFIX + name: tensor for name, tensor in host.items()}}


def _host(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return tensors[HOST_PREFIX + name] if HOST_PREFIX + name in tensors else tensors[name].cpu()


def capture_batch(capture: HiddenStateCapture, tensors: dict[str, torch.Tensor]) -> CapturedStates:
    """The target's forward over a packed row. No mask is passed: transformers finds the documents from
    the position ids (restarting at 0) and masks attention across them; with flex_attention on a GPU
    that costs what unpacked rows cost (257 vs 260 ms at 4 x 2,048 on an H200), a dense mask 385 ms.
    The host copy of the position ids spares hybrid targets a GPU sync to find their documents."""
    return capture(tensors["input_ids"], position_ids=tensors["position_ids"],
                   host_position_ids=tensors.get(HOST_PREFIX + "position_ids"))


def drafter_step(drafter, *, tensors: dict[str, torch.Tensor], captured: CapturedStates, num_anchors: int,
                 block_size: int, teacher: bool, generator: torch.Generator, device: torch.device,
                 attention_backend: str, loss_scale: float) -> dict[str, torch.Tensor]:
    """Forward + backward of the drafter on one captured batch; the metrics as tensors (no sync).
    `captured` may already sit on `device` (PairTransfer); otherwise it is copied there."""
    plan = plan_blocks(loss_mask_BT=_host(tensors, "loss_mask"), num_anchors=num_anchors, block_size=block_size,
                       position_ids_BT=_host(tensors, "position_ids"), generator=generator,
                       with_teacher_index=teacher)
    plan = _pinned(plan) if device.type == "cuda" else plan
    plan = plan.to(device, non_blocking=True)
    tapped = captured.tapped_hidden.to(device, non_blocking=True)
    final = captured.final_hidden.to(device, non_blocking=True) if teacher else None
    input_ids = tensors["input_ids"]
    if input_ids.device != device:  # pair layout: from the host, not through the target's GPU stream
        input_ids = _host(tensors, "input_ids")
    input_ids = input_ids.to(device, non_blocking=True)
    noise = regularization_generator(drafter, generator=generator, device=device)
    extra = {} if noise is None else {"generator": noise}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        _, loss, metrics = drafter(input_ids=input_ids, target_hidden=tapped, plan=plan, teacher_hidden=final,
                                   attention_backend=attention_backend, **extra)
    (loss * loss_scale).backward()
    return metrics


def regularization_generator(drafter, *, generator: torch.Generator, device: torch.device) -> torch.Generator | None:
    """A generator on `device` for the drafter's feature noise and dropout, seeded from the step's
    (anchor) generator after the plan drew from it, so (seed, step, micro-batch) fixes them; None, and
    the step generator untouched, when the drafter's config draws nothing."""
    config = getattr(drafter, "module", drafter).config  # DDP wraps the drafter
    if not getattr(config, "stochastic_training", False):
        return None
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def _pinned(plan: BlockPlan) -> BlockPlan:
    return dataclasses.replace(plan, **{field.name: value.pin_memory() for field in dataclasses.fields(plan)
                                        for value in [getattr(plan, field.name)] if isinstance(value, torch.Tensor)})


def step_generator(seed: int, step: int, global_micro: int) -> torch.Generator:
    """Anchor sampling depends only on (seed, step, global micro-batch index): resume replays it
    exactly, and N ranks x 1 micro-batch sample like 1 rank x N micro-batches."""
    return torch.Generator().manual_seed(hash((seed, step, global_micro)) & 0x7FFF_FFFF_FFFF_FFFF)


# ---- step strategies ---------------------------------------------------------------------------

@dataclasses.dataclass
class StepTiming:
    """Main-thread seconds of one optimizer step. prepare: getting its batches ready (the wait on the
    prefetch queue and the queued copies; packing itself when prefetch is off); dispatch: queuing its
    target forward, drafter step and optimizer (a full CUDA launch queue makes this wait on the GPU
    too); wait: blocked on the device for the metrics of a log step. When prepare + dispatch stay well
    under the step time the host is off the critical path."""

    prepare_s: float = 0.0
    dispatch_s: float = 0.0
    wait_s: float = 0.0


@dataclasses.dataclass
class StepContext:
    """What a strategy steps: the run's parts, the module its forward calls (the drafter, or DDP around
    it) and this process's place among the ranks."""

    parts: TrainingParts
    model: torch.nn.Module
    dist: Distributed

    def micro_step(self, *, step: int, micro: int, tensors: dict[str, torch.Tensor], captured: CapturedStates
                   ) -> dict[str, torch.Tensor]:
        """The drafter's forward + backward on micro-batch `micro` of optimizer step `step` (gradients
        averaged over the step's micro-batches; DDP synchronizes only on the last)."""
        config = self.parts.config
        accum = config.optim.grad_accum
        sync = micro == accum - 1 or self.dist.world_size == 1
        context = self.model.no_sync() if not sync and hasattr(self.model, "no_sync") else nullcontext()
        with context, record_function("dflash.drafter_step"):
            return drafter_step(
                self.model, tensors=tensors, captured=captured, num_anchors=config.resolved_num_anchors,
                block_size=self.parts.drafter_config.block_size, teacher=self.parts.teacher,
                generator=step_generator(config.seed, step, micro * self.dist.world_size + self.dist.rank),
                device=self.parts.devices.drafter, attention_backend=config.attention_backend, loss_scale=1 / accum)

    def finish_step(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from dflash_core.train.optimizer import optimizer_step

        parts = self.parts
        with record_function("dflash.optimizer"):
            summed["grad_norm"] = optimizer_step(parts.drafter, parts.optimizer, parts.scheduler,
                                                 grad_clip=parts.config.optim.grad_clip)
        return summed


class StepStrategy(Protocol):
    def open(self) -> None:
        """Start drawing batches from the sampler's current position."""

    def step(self, step: int, timing: StepTiming) -> tuple[dict[str, torch.Tensor], int]:
        """One optimizer step: its metrics (on the device, summed over micro-batches) and real tokens."""

    def sampler_state(self) -> dict:
        """The sampler's position after the last batch trained on (what a checkpoint saves)."""

    def close(self) -> None:
        """Stop drawing and rewind the sampler to `sampler_state()`: batches drawn ahead and not
        trained on are drawn again by the next open."""


def add_micro_metrics(summed: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], *, accum: int) -> None:
    for name, value in metrics.items():
        summed[name] = summed.get(name, 0) + value.detach().float() / accum


class PlainSteps:
    """Each micro-batch: its packed row (prepared ahead on a thread, or inline with prefetch 0), the
    target's forward, the drafter's forward and backward; then the optimizer."""

    def __init__(self, context: StepContext):
        self.context = context
        self.batches = None
        self.trained_state: dict | None = None  # while batches are drawn ahead: the trained-on position

    def open(self) -> None:
        from dflash_core.train.prefetch import BatchPrefetcher, InlineBatches, batch_preparer

        parts = self.context.parts
        config = parts.config
        prepare = batch_preparer(parts.corpus, parts.sampler, token_budget=config.token_budget,
                                 pin=parts.devices.target.type == "cuda")
        self.batches = BatchPrefetcher(prepare, depth=config.prefetch_batches, device=parts.devices.target) \
            if config.prefetch_batches else InlineBatches(prepare)

    def step(self, step: int, timing: StepTiming) -> tuple[dict[str, torch.Tensor], int]:
        parts = self.context.parts
        accum = parts.config.optim.grad_accum
        summed: dict[str, torch.Tensor] = {}
        tokens = 0
        started = time.perf_counter()
        for micro in range(accum):
            with record_function("dflash.prepare_batch"):
                prepared = self.batches.next()
                tensors = prepared.to_device(parts.devices.target)
            self.trained_state = prepared.sampler_state
            ready = time.perf_counter()
            timing.prepare_s += ready - started
            tokens += prepared.batch.num_real_tokens * self.context.dist.world_size
            with record_function("dflash.target_forward"):
                captured = capture_batch(parts.capture, tensors)
            metrics = self.context.micro_step(step=step, micro=micro, tensors=tensors, captured=captured)
            add_micro_metrics(summed, metrics, accum=accum)
            started = time.perf_counter()
            timing.dispatch_s += started - ready
        summed = self.context.finish_step(summed)
        timing.dispatch_s += time.perf_counter() - started
        return summed, tokens

    def sampler_state(self) -> dict:
        return self.trained_state or self.context.parts.sampler.state_dict()

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
            self.batches = None
        if self.trained_state is not None:
            self.context.parts.sampler.load_state_dict(self.trained_state)
        self.trained_state = None
