"""One online training step: the frozen target's forward captures the tapped layers of a packed
batch, the drafter trains on them; nothing touches disk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash_core.model import plan_blocks
from dflash_core.target import CapturedStates, HiddenStateCapture

if TYPE_CHECKING:  # keeps this module importable with torch alone (the GPU benches' image)
    from dflash_core.train.data import PackedBatch


def batch_tensors(batch: PackedBatch, device: torch.device) -> dict[str, torch.Tensor]:
    tensors = {
        "input_ids": torch.from_numpy(batch.input_ids)[None],
        "position_ids": torch.from_numpy(batch.position_ids)[None],
        "document_ids": torch.from_numpy(batch.document_ids)[None],
        "loss_mask": torch.from_numpy(batch.loss_mask)[None],
    }
    return {name: tensor.to(device, non_blocking=True) for name, tensor in tensors.items()}


def capture_batch(capture: HiddenStateCapture, tensors: dict[str, torch.Tensor]) -> CapturedStates:
    """The target's forward over a packed row. No mask is passed: transformers finds the documents from
    the position ids (restarting at 0) and masks attention across them; with flex_attention on a GPU
    that costs what unpacked rows cost (257 vs 260 ms at 4 x 2,048 on an H200), a dense mask 385 ms."""
    return capture(tensors["input_ids"], position_ids=tensors["position_ids"])


def drafter_step(drafter, *, tensors: dict[str, torch.Tensor], captured: CapturedStates, num_anchors: int,
                 block_size: int, teacher: bool, generator: torch.Generator, device: torch.device,
                 attention_backend: str, loss_scale: float) -> dict[str, torch.Tensor]:
    """Forward + backward of the drafter on one captured batch; the metrics as tensors (no sync)."""
    plan = plan_blocks(loss_mask_BT=tensors["loss_mask"].cpu(), num_anchors=num_anchors, block_size=block_size,
                       position_ids_BT=tensors["position_ids"].cpu(), generator=generator,
                       with_teacher_index=teacher).to(device, non_blocking=True)
    tapped = captured.tapped_hidden.to(device, non_blocking=True)
    final = captured.final_hidden.to(device, non_blocking=True) if teacher else None
    input_ids = tensors["input_ids"].to(device, non_blocking=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        _, loss, metrics = drafter(input_ids=input_ids, target_hidden=tapped, plan=plan, teacher_hidden=final,
                                   attention_backend=attention_backend)
    (loss * loss_scale).backward()
    return metrics
