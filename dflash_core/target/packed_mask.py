"""Transformers' packed-sequence check without the device sync.

A decoder called with `position_ids` and no attention mask asks `find_packed_sequence_indices`
(transformers.masking_utils) which document each token belongs to, and that function ends in
`bool((mask[:, -1] == 0).all())`: with the position ids on the GPU the host waits there for every
kernel queued before the forward, once per forward. On one H200 that wait was 78 ms of host time in
the 27B hybrid's ~820 ms step and left the GPU idle while the host caught up.

Where the caller holds a host copy of the position ids (the Trainer's batches carry one), the same
function runs on that copy instead, and only its result travels to the device. Everything else
(another shape, no host copy, a traced graph) goes to transformers' own function unchanged."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_HOST_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("host_position_ids", default=None)
_installed = False


def _host_first(original):
    def find_packed_sequence_indices(position_ids: torch.Tensor):
        held = _HOST_POSITIONS.get()
        if held is None or held.shape != position_ids.shape or torch.compiler.is_compiling():
            return original(position_ids)
        mask = original(held)
        if mask is None or mask.device == position_ids.device:
            return mask
        if position_ids.device.type == "cuda":
            mask = mask.pin_memory()
        return mask.to(position_ids.device, non_blocking=True)

    find_packed_sequence_indices.__wrapped__ = original
    return find_packed_sequence_indices


def install() -> None:
    """Route transformers' packed-sequence check through the host copy when one is held (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import masking_utils

    masking_utils.find_packed_sequence_indices = _host_first(masking_utils.find_packed_sequence_indices)
    _installed = True


@contextlib.contextmanager
def host_position_ids(positions: torch.Tensor | None) -> Iterator[None]:
    """Within it, a decoder forward whose position ids have `positions`' shape (and the same values:
    `positions` is their host copy) reads the document boundaries from `positions` instead of
    waiting for the device."""
    if positions is None or positions.device.type != "cpu":
        yield
        return
    install()
    token = _HOST_POSITIONS.set(positions)
    try:
        yield
    finally:
        _HOST_POSITIONS.reset(token)
