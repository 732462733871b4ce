"""One online training step: the frozen target's forward captures the tapped layers of a packed
batch, the drafter trains on them; nothing touches disk.

The step strategies (dflash_core.train.strategies, .pair_overlap) call these per micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

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
                 attention_backend: str, loss_scale: float, anchor_sampling: str = "uniform",
                 prompt_anchors: bool = False) -> dict[str, torch.Tensor]:
    """Forward + backward of the drafter on one captured batch; the metrics as tensors (no sync).
    `captured` may already sit on `device` (PairTransfer); otherwise it is copied there.
    `anchor_sampling` and `prompt_anchors`: how the anchors are planned (`plan_blocks`)."""
    if prompt_anchors and not teacher:
        raise ValueError("prompt_anchors needs the target's argmax as labels (teacher): a prompt slot would "
                         "otherwise learn the prompt's own tokens")
    plan = plan_blocks(loss_mask_BT=_host(tensors, "loss_mask"), num_anchors=num_anchors, block_size=block_size,
                       position_ids_BT=_host(tensors, "position_ids"), generator=generator,
                       with_teacher_index=teacher, anchor_sampling=anchor_sampling, prompt_anchors=prompt_anchors)
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
    if not getattr(drafter, "module", drafter).loss.stochastic:  # DDP wraps the drafter
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
