"""Packed batches prepared off the training loop's critical path.

`BatchPrefetcher` packs the next micro-batches on a background thread into host tensors (pinned
when they go to a GPU, so the loop's `non_blocking` copies really overlap), `depth` ahead, in the
sampler's order; `InlineBatches` does the same work on the caller's thread when it is asked. Both
hand out the same `PreparedBatch`es, each with the sampler position after it was drawn, so a
checkpoint records the batches trained on, not the ones queued. An error while preparing is raised
in the consumer's thread, with its original type, message and traceback.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dflash_core.train.data import PackedBatch, PackedBatchSampler, TokenizedCorpus, collate
from dflash_core.train.step import HOST_PREFIX

_FIELDS = ("input_ids", "position_ids", "document_ids", "loss_mask")
THREAD_NAME = "dflash-batch-prefetch"


@dataclass
class PreparedBatch:
    batch: PackedBatch
    host: dict[str, torch.Tensor]       # host_<name>: [1, T], pinned when bound for a GPU
    sampler_state: dict[str, int]       # the sampler's position after this batch was drawn
    prepare_s: float                    # time spent packing it (on whichever thread did)

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The layout of step.batch_tensors: `<name>` on `device` (asynchronous copies from pinned
        memory), `host_<name>` the host copies."""
        tensors = {name.removeprefix(HOST_PREFIX): tensor.to(device, non_blocking=True)
                   for name, tensor in self.host.items()}
        return {**tensors, **self.host}


def host_tensors(batch: PackedBatch, *, pin: bool) -> dict[str, torch.Tensor]:
    host = {HOST_PREFIX + name: torch.from_numpy(getattr(batch, name))[None]
            for name in _FIELDS}
    return {name: tensor.pin_memory() for name, tensor in host.items()} if pin else host


def batch_preparer(corpus: TokenizedCorpus, sampler: PackedBatchSampler, *, token_budget: int,
                   pin: bool) -> Callable[[], PreparedBatch]:
    """A function that draws the sampler's next batch and packs it (not thread-safe: one caller)."""
    indices: Iterator[list[int]] = iter(sampler)

    def prepare() -> PreparedBatch:
        started = time.perf_counter()
        drawn = next(indices)
        state = sampler.state_dict()
        batch = collate(corpus, drawn, token_budget=token_budget)
        return PreparedBatch(batch=batch, host=host_tensors(batch, pin=pin), sampler_state=state,
                             prepare_s=time.perf_counter() - started)

    return prepare


class InlineBatches:
    """Prepares each batch when `next()` asks for it, on the caller's thread."""

    def __init__(self, prepare: Callable[[], PreparedBatch]) -> None:
        self._prepare = prepare

    def next(self) -> PreparedBatch:
        return self._prepare()

    def close(self) -> None:
        pass


@dataclass
class _Failed:
    error: BaseException


class BatchPrefetcher:
    """Prepares batches on a daemon thread, at most `depth` of them waiting in a queue.

    `next()` returns them in order; it raises the thread's exception (the same object: type, message
    and the thread's traceback) once the batches prepared before it are used up. `close()` stops and
    joins the thread; call it on every exit (the trainer does, in a `finally`)."""

    _POLL_S = 0.05

    def __init__(self, prepare: Callable[[], PreparedBatch], *, depth: int,
                 device: torch.device | None = None) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._prepare = prepare
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._device = device
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # pinned allocations belong to the trainer's device
        while not self._stop.is_set():
            try:
                item = self._prepare()
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
                item = _Failed(error)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=self._POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failed):
                return

    def next(self) -> PreparedBatch:
        if self._failure is not None:
            raise self._failure
        while True:
            try:
                item = self._queue.get(timeout=self._POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch prefetch thread stopped without a batch or an error") from None
        if isinstance(item, _Failed):
            self._failure = item.error
            raise item.error
        return item

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        while True:  # a put blocked on a full queue sees the stop within one poll
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the batch prefetch thread did not stop within {timeout_s:.0f} s")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
