"""Attention masks for training blocks, in three forms from one rule.

Keys are [target context (T) ; all blocks (A*B)], queries are all blocks. Query slot k of the
block anchored at p sees:
  - context token j when j < p and j is in p's document (and, on sliding layers,
    (p + k) - j < window: the usual sliding-window rule with the query at sequence index p+k);
  - every slot of its own block (non-causal inside the block); never another block.
`block_mask_mod` is that rule as a flex_attention mask_mod; evaluated on broadcast index tensors it
also gives the dense boolean mask that the CPU path (SDPA; flex has no CPU backward) uses.
`reference_dense_mask` is an independent loop implementation, kept to test the other two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_core.model.anchors import BlockPlan
from dflash_core.model.attention import AttendFn

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block_mask_mod(plan: BlockPlan, *, sliding_window: int | None = None) -> MaskMod:
    """The training mask rule as mask_mod(batch, head, q_idx, kv_idx) -> bool."""
    anchors, docs = plan.anchors, plan.document_ids
    seq_len, block_size = plan.seq_len, plan.block_size
    if sliding_window is not None and sliding_window < block_size:
        raise ValueError(f"sliding_window {sliding_window} must be >= block_size {block_size}")

    def mask_mod(b, h, q_idx, kv_idx):
        anchor_slot = q_idx // block_size
        anchor = anchors[b, anchor_slot]
        ctx_idx = kv_idx.clamp(max=seq_len - 1)
        # Invalid anchors sit at 0, so they see no context: only their own block.
        sees_ctx = (kv_idx < seq_len) & (ctx_idx < anchor) & (docs[b, ctx_idx] == docs[b, anchor])
        if sliding_window is not None:
            sees_ctx = sees_ctx & (anchor + q_idx % block_size - ctx_idx < sliding_window)
        sees_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == anchor_slot)
        return sees_ctx | sees_block

    return mask_mod


def dense_mask(plan: BlockPlan, *, sliding_window: int | None = None) -> torch.Tensor:
    """Bool [B, 1, A*B, T + A*B] from `block_mask_mod`, for SDPA."""
    batch, num_anchors = plan.anchors.shape
    q_len = num_anchors * plan.block_size
    device = plan.anchors.device
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(plan.seq_len + q_len, device=device).view(1, 1, 1, -1)
    return block_mask_mod(plan, sliding_window=sliding_window)(b, h, q, kv)


def reference_dense_mask(plan: BlockPlan, *, sliding_window: int | None = None) -> torch.Tensor:
    """Bool [B, A*B, T + A*B] built anchor by anchor; slow and obvious, for tests only."""
    batch, num_anchors = plan.anchors.shape
    seq_len, block = plan.seq_len, plan.block_size
    mask = torch.zeros(batch, num_anchors * block, seq_len + num_anchors * block, dtype=torch.bool)
    docs = plan.document_ids.cpu()
    for row in range(batch):
        for slot in range(num_anchors):
            q0 = slot * block
            mask[row, q0 : q0 + block, seq_len + q0 : seq_len + q0 + block] = True
            if not bool(plan.anchor_valid[row, slot]):
                continue
            anchor = int(plan.anchors[row, slot])
            for k in range(block):
                for j in range(anchor):
                    in_window = sliding_window is None or (anchor + k) - j < sliding_window
                    if docs[row, j] == docs[row, anchor] and in_window:
                        mask[row, q0 + k, j] = True
    return mask


def resolve_attention_backend(backend: str, *, cuda: bool) -> str:
    """The training attention a backend setting means: auto is flex on a GPU (block-sparse, compiled), sdpa (the
    dense mask) elsewhere, where flex has no backward."""
    if backend == "auto":
        return "flex" if cuda else "sdpa"
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attention_backend must be 'flex', 'sdpa' or 'auto', got {backend!r}")
    return backend


def create_flex_block_mask(plan: BlockPlan, *, sliding_window: int | None = None, compile_mask: bool):
    """flex_attention BlockMask for the plan; compile_mask=True on GPU builds it without a dense grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = plan.anchors.shape
    q_len = num_anchors * plan.block_size
    return create_block_mask(
        block_mask_mod(plan, sliding_window=sliding_window),
        batch,
        None,
        q_len,
        plan.seq_len + q_len,
        device=plan.anchors.device,
        _compile=compile_mask,
    )


_compiled_flex_attention = None


def _flex_attention(*, compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex_attention
    if not compiled:
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps) of flex_attention's backward, where a
# measured config beat torch's default on the drafter's mask (docs/benchmarks.md, Figures behind choices: one
# H200, 2026-12-01, 24 x 4 heads of 256, 8,192 queries over 16,384 keys: 8.38 vs 9.60 ms fwd+bwd, same grads).
_TUNED_BACKWARD = {((9, 0), "wide"): (64, 64, 64, 64, 2, 8)}


def tuned_flex_options(head_dim: int, device: torch.device) -> dict | None:
    """kernel_options for the drafter's flex attention on `device`; None: torch's defaults."""
    if device.type != "cuda":
        return None
    config = _TUNED_BACKWARD.get((torch.cuda.get_device_capability(device), "wide" if head_dim > 128 else "narrow"))
    if config is None:
        return None
    names = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
    return dict(zip(names, config))


def flex_attend(block_mask, *, compiled: bool, kernel_options: dict | None = None) -> AttendFn:
    """AttendFn through flex_attention (compiled on GPU: the eager path is a slow reference);
    `kernel_options`: flex_attention's, e.g. the backward's block sizes, for 16-bit inputs only (the
    tuned configs do not fit fp32 tiles in shared memory; fp32 keeps torch's defaults)."""
    kernel = _flex_attention(compiled=compiled)

    def attend(query, key, value):
        extra = {"kernel_options": kernel_options} if kernel_options and query.element_size() == 2 else {}
        return kernel(query, key, value, block_mask=block_mask, enable_gqa=query.shape[1] != key.shape[1], **extra)

    return attend


def sdpa_attend(mask_B1QK: torch.Tensor | None) -> AttendFn:
    """AttendFn through scaled_dot_product_attention with a dense boolean mask (None: all visible)."""

    def attend(query, key, value):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask_B1QK, enable_gqa=query.shape[1] != key.shape[1]
        )

    return attend


def drafting_mask(
    *, context_len: int, block_size: int, first_position: int, sliding_window: int | None, device
) -> torch.Tensor | None:
    """Mask [1, 1, B, context_len + B] for one drafted block whose anchor sits at sequence index
    `first_position` right after `context_len` cached context tokens; None when everything is visible."""
    if sliding_window is None or first_position + block_size - 1 < sliding_window:
        return None
    query_pos = first_position + torch.arange(block_size, device=device)[:, None]
    ctx_pos = torch.arange(context_len, device=device)[None, :]
    sees_ctx = query_pos - ctx_pos < sliding_window
    sees_block = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    return torch.cat((sees_ctx, sees_block), dim=1)[None, None]
