"""One online training step: the frozen target's forward captures the tapped layers of a packed
batch, the drafter trains on them; nothing touches disk.

In the pair layout (target on one GPU, drafter on another) the captured states cross between the
GPUs every step. `PairOverlapSteps` pipelines that: the next batch's target forward and its copy to
the drafter's GPU (side streams) are queued before the drafter trains on the current batch, so
the target GPU, the link and the drafter GPU work at once. Same batches, same anchors, same losses.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from dflash_core.model import plan_blocks
from dflash_core.target import CapturedStates, HiddenStateCapture

if TYPE_CHECKING:  # keeps this module importable with torch alone (the GPU benches' image)
    from dflash_core.model import BlockPlan
    from dflash_core.train.data import PackedBatch

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


# ---- the pair layout, overlapped ----------------------------------------------------------------

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
    """Trainer mixin (`class T(PairOverlapSteps, Trainer)`): each optimizer step queues the NEXT
    batch's target forward and its transfer before the drafter trains on the current one. Batches
    are drawn in the same order and the saved sampler position excludes the batch in flight, so
    losses and resume match the plain loop exactly. Adds `transfer_ms` (copy time per step, measured
    with CUDA events on the side stream) to the metrics."""

    def _optimizer_step(self, batches) -> tuple[dict[str, torch.Tensor], int]:

        config = self.config
        if getattr(self, "_overlap_batches", None) is not batches:  # a new run(): nothing in flight
            self._overlap_batches, self._next_flight = batches, None
            self._transfer = PairTransfer(self.target_device, self.drafter_device)
        accum = config.optim.grad_accum
        summed: dict[str, torch.Tensor] = {}
        tokens = 0
        copy_ms: list[float] = []
        for micro in range(accum):
            flight = self._next_flight or self._launch(batches, sampler_before=None)
            last = self.step == config.max_steps - 1 and micro == accum - 1
            self._next_flight = None if last else self._launch(batches, sampler_before=self.sampler.state_dict())
            self._transfer.finish(flight)
            tokens += flight.batch.num_real_tokens * self.dist.world_size
            sync = micro == accum - 1 or self.dist.world_size == 1
            context = self.model.no_sync() if not sync and hasattr(self.model, "no_sync") else nullcontext()
            with context:
                metrics = drafter_step(
                    self.model, tensors=flight.tensors, captured=flight.captured,
                    num_anchors=config.resolved_num_anchors, block_size=self.drafter_config.block_size,
                    teacher=self.teacher,
                    generator=step_generator(config.seed, self.step, micro * self.dist.world_size + self.dist.rank),
                    device=self.drafter_device, attention_backend=config.attention_backend, loss_scale=1 / accum)
            for name, value in metrics.items():
                summed[name] = summed.get(name, 0) + value.detach().float() / accum
            elapsed = self._transfer.elapsed_ms(flight)
            if elapsed is not None:
                copy_ms.append(elapsed)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), config.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        summed["grad_norm"] = grad_norm.detach()
        if copy_ms:
            summed["transfer_ms"] = torch.tensor(sum(copy_ms))
        return summed, tokens

    def _launch(self, batches, *, sampler_before: dict | None) -> InFlight:
        from dflash_core.train.data import collate

        batch = collate(self.corpus, next(batches), token_budget=self.config.token_budget)
        tensors = batch_tensors(batch, self.target_device)
        moved, events = self._transfer.start(capture_batch(self.capture, tensors), teacher=self.teacher)
        return InFlight(batch=batch, tensors=tensors, captured=moved, sampler_before=sampler_before, events=events)

    def _train_state(self) -> dict:
        state = super()._train_state()
        flight = getattr(self, "_next_flight", None)
        if flight is not None and flight.sampler_before is not None:  # that batch is not trained on yet
            state["sampler"] = flight.sampler_before
        return state
