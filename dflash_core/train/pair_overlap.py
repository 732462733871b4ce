"""The pair layout's step, overlapped: target on one GPU, drafter on another, the captured states
cross between them every step. `PairOverlapSteps` queues the next batch's target forward and its
copy to the drafter's GPU (side streams) before the drafter trains on the current batch, so the
target GPU, the link and the drafter GPU work at once. Same batches, same anchors, same losses.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from dflash_core.target import CapturedStates
from dflash_core.train.step import batch_tensors, capture_batch
from dflash_core.train.strategies import StepContext, StepTiming, add_micro_metrics

if TYPE_CHECKING:
    from dflash_core.train.data import PackedBatch


@dataclasses.dataclass
class InFlight:
    """A captured batch on its way to the drafter's device."""

    batch: PackedBatch
    tensors: dict[str, torch.Tensor]
    captured: CapturedStates       # tensors on the drafter's device once `PairTransfer.finish` ran
    sampler_before: dict[str, Any] | None  # the sampler's position before this batch was drawn
    events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None  # start, end, done


class PairTransfer:
    """Copies captured states from the target's GPU to the drafter's on side streams: a copy waits
    only for its own capture, never for the drafter's queued work (torch's plain cross-device copy
    runs on the source's current stream after a two-way barrier with the destination's current
    stream, so it would wait for the drafter step before it and hold up the next target forward)."""

    def __init__(self, source: torch.device, destination: torch.device):
        self.source, self.destination = source, destination
        self.streams = None
        if source.type == destination.type == "cuda" and source != destination:
            self.streams = (torch.cuda.Stream(source), torch.cuda.Stream(destination))

    def start(self, captured: CapturedStates, *, teacher: bool) -> tuple[CapturedStates, tuple | None]:
        """Queue the copy after the capture on the source stream; returns the moved states (not to be
        read before `finish`) and CUDA events (start, end on the source side; done on the destination)."""
        if self.streams is None:
            final = captured.final_hidden.to(self.destination) if teacher else None
            return dataclasses.replace(captured, tapped_hidden=captured.tapped_hidden.to(self.destination),
                                       final_hidden=final), None
        source_stream, destination_stream = self.streams
        source_stream.wait_stream(torch.cuda.current_stream(self.source))
        start, end, done = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event())
        sources = [captured.tapped_hidden] + ([captured.final_hidden] if teacher else [])
        with ExitStack() as streams:  # copy_ uses the current stream of both devices
            streams.enter_context(torch.cuda.stream(source_stream))
            streams.enter_context(torch.cuda.stream(destination_stream))
            start.record(source_stream)
            moved = [tensor.to(self.destination, non_blocking=True) for tensor in sources]
            end.record(source_stream)
            done.record(destination_stream)
        for tensor in sources:  # the capture's buffers stay reserved until the side stream read them
            tensor.record_stream(source_stream)
        return dataclasses.replace(captured, tapped_hidden=moved[0], final_hidden=moved[1] if teacher else None), \
            (start, end, done)

    def finish(self, flight: InFlight) -> None:
        """Make the drafter's stream wait (on the GPU) for this batch's copy."""
        if flight.events is None:
            return
        current = torch.cuda.current_stream(self.destination)
        current.wait_event(flight.events[2])
        for tensor in (flight.captured.tapped_hidden, flight.captured.final_hidden):
            if tensor is not None:  # allocated on the side stream, read on the drafter's stream
                tensor.record_stream(current)

    @staticmethod
    def elapsed_ms(flight: InFlight) -> float | None:
        if flight.events is None:
            return None
        start, end, _ = flight.events
        end.synchronize()
        return start.elapsed_time(end)


class PairOverlapSteps:
    """Each optimizer step queues the NEXT batch's target forward and its transfer before the drafter
    trains on the current one. Batches are drawn in the same order and the saved sampler position
    excludes the batch in flight, so losses and resume match the plain steps exactly. Adds
    `transfer_ms` (copy time per step, measured with CUDA events on the side stream) to the metrics."""

    def __init__(self, context: StepContext):
        self.context = context
        devices = context.parts.devices
        self.transfer = PairTransfer(devices.target, devices.drafter)
        self.batches = None
        self.next_flight: InFlight | None = None

    def open(self) -> None:
        self.batches = iter(self.context.parts.sampler)
        self.next_flight = None

    def step(self, step: int, timing: StepTiming) -> tuple[dict[str, torch.Tensor], int]:
        parts = self.context.parts
        config = parts.config
        accum = config.optim.grad_accum
        summed: dict[str, torch.Tensor] = {}
        tokens = 0
        copy_ms: list[float] = []
        for micro in range(accum):
            flight = self.next_flight or self._launch(sampler_before=None)
            last = step == config.max_steps - 1 and micro == accum - 1
            self.next_flight = None if last else self._launch(sampler_before=parts.sampler.state_dict())
            self.transfer.finish(flight)
            tokens += flight.batch.num_real_tokens * self.context.dist.world_size
            metrics = self.context.micro_step(step=step, micro=micro, tensors=flight.tensors,
                                              captured=flight.captured)
            add_micro_metrics(summed, metrics, accum=accum)
            elapsed = self.transfer.elapsed_ms(flight)
            if elapsed is not None:
                copy_ms.append(elapsed)
        summed = self.context.finish_step(summed)
        if copy_ms:
            summed["transfer_ms"] = torch.tensor(sum(copy_ms))
        return summed, tokens

    def _launch(self, *, sampler_before: dict | None) -> InFlight:
        from dflash_core.train.data import collate

        parts = self.context.parts
        batch = collate(parts.corpus, next(self.batches), token_budget=parts.config.token_budget)
        tensors = batch_tensors(batch, parts.devices.target)
        moved, events = self.transfer.start(capture_batch(parts.capture, tensors), teacher=parts.teacher)
        return InFlight(batch=batch, tensors=tensors, captured=moved, sampler_before=sampler_before, events=events)

    def sampler_state(self) -> dict:
        flight = self.next_flight
        if flight is not None and flight.sampler_before is not None:  # that batch is not trained on yet
            return flight.sampler_before
        return self.context.parts.sampler.state_dict()

    def close(self) -> None:
        state = self.sampler_state()
        self.context.parts.sampler.load_state_dict(state)
        self.batches, self.next_flight = None, None
