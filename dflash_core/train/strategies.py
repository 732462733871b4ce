"""Step strategies: how a run's optimizer steps go. `PlainSteps` prepares each micro-batch ahead on a
thread, captures it and trains on it; the pair layout's `dflash_core.train.pair_overlap.PairOverlapSteps`
overlaps the next capture and its transfer with the drafter's step. Both take a `StepContext` and
offer open / step / sampler_state / close; the loop (dflash_core.train.loop) picks one from the config.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import torch
from torch.profiler import record_function

from dflash_core.target import CapturedStates
from dflash_core.train.optimizer import optimizer_step
from dflash_core.train.prefetch import BatchPrefetcher, InlineBatches, batch_preparer
from dflash_core.train.step import capture_batch, drafter_step, step_generator

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dflash_core.train.devices import Distributed
    from dflash_core.train.parts import TrainingParts


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

    @staticmethod
    def mean_ms(timings: Sequence[StepTiming]) -> dict[str, float]:
        """{"prepare": ms, "dispatch": ms, "wait": ms}: each part's mean over `timings` ({} when none)."""
        if not timings:
            return {}
        return {field.name.removesuffix("_s"): 1e3 * sum(getattr(t, field.name) for t in timings) / len(timings)
                for field in dataclasses.fields(StepTiming)}


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
                device=self.parts.devices.drafter, attention_backend=config.attention_backend, loss_scale=1 / accum,
                anchor_sampling=config.drafter.anchor_sampling, prompt_anchors=config.drafter.prompt_anchors)

    def finish_step(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
