"""Loss pieces: position weights, teacher tokens, and a chunked LM-head + cross-entropy.

Neither the teacher nor the drafter ever holds [tokens, vocab] logits for all tokens at once:
both walk over row chunks. The drafter's loss computes its input gradient chunk by chunk in the
forward pass (the LM head is the target's, frozen, so that is the only gradient), which keeps
peak memory at one chunk of fp32 logits and costs the same two matmuls per chunk as autograd.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def position_weights(*, block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[block_size] fp32: slot 0 (the anchor, given) weighs 0; slot k >= 1 weighs exp(-(k-1)/gamma)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    slots = torch.arange(block_size, dtype=torch.float32, device=device)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


@torch.no_grad()
def teacher_token_ids(
    final_hidden_BTH: torch.Tensor,
    *,
    index_flat: torch.Tensor,
    final_norm: nn.Module,
    lm_head: nn.Module,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Target argmax at the flat positions `index_flat` (row * T + pos) only, in chunks.

    `final_hidden_BTH` must be the last decoder layer's output BEFORE the final norm; the target's
    own norm and LM head are applied here, in the target's own dtype: a drafter's autocast must not
    change the teacher (bf16 rounding flips near-tied argmaxes).
    """
    flat = final_hidden_BTH.reshape(-1, final_hidden_BTH.shape[-1])
    out = torch.empty(index_flat.shape[0], dtype=torch.long, device=flat.device)
    with torch.autocast(flat.device.type, enabled=False):
        for start in range(0, index_flat.shape[0], chunk_size):
            rows = flat.index_select(0, index_flat[start : start + chunk_size])
            out[start : start + chunk_size] = lm_head(final_norm(rows)).argmax(dim=-1)
    return out


def _chunk_loss_and_grad(logits, labels, scale, inv_total_weight, *, with_grad: bool):
    """Per chunk: weighted CE sum, correctness, and d(loss)/d(logits) in the logits' dtype.

    One function so torch.compile can fuse the fp32 upcast, logsumexp, argmax and softmax into a
    couple of passes over the [chunk, vocab] logits (see `compile_loss_kernel`).
    """
    logits32 = logits.float()
    log_norm = torch.logsumexp(logits32, dim=-1)
    label_logit = logits32.gather(1, labels[:, None]).squeeze(1)
    loss_sum = (scale * (log_norm - label_logit)).sum()
    correct = logits32.argmax(dim=-1) == labels
    if not with_grad:
        return loss_sum, correct, None
    # d(ce)/d(logits) = softmax - onehot, scaled by this token's share of the loss.
    grad_logits = torch.exp(logits32 - log_norm[:, None])
    grad_logits.scatter_add_(1, labels[:, None], torch.full_like(label_logit[:, None], -1.0))
    grad_logits = grad_logits * (scale * inv_total_weight)[:, None]
    return loss_sum, correct, grad_logits.to(logits.dtype)


_chunk_kernel = _chunk_loss_and_grad


def compile_loss_kernel(enabled: bool = True) -> None:
    """Use a torch.compile'd per-chunk loss kernel (GPU); eager when disabled."""
    global _chunk_kernel
    _chunk_kernel = torch.compile(_chunk_loss_and_grad, dynamic=False) if enabled else _chunk_loss_and_grad


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, token_weights_N, chunk_size):
        compute_dtype = weight_VH.dtype
        inv_total_weight = 1.0 / token_weights_N.sum().clamp_min(1e-12)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
        correct = torch.empty(labels_N.shape, dtype=torch.bool, device=hidden_NH.device)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden_NH) if needs_grad else None
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            logits = hidden_NH[start:end].to(compute_dtype) @ weight_VH.T
            chunk_loss, correct[start:end], grad_logits = _chunk_kernel(
                logits, labels_N[start:end], token_weights_N[start:end], inv_total_weight, with_grad=needs_grad
            )
            loss_sum += chunk_loss
            if needs_grad:
                grad_hidden[start:end] = (grad_logits @ weight_VH).to(hidden_NH.dtype)
        ctx.save_for_backward(grad_hidden if needs_grad else hidden_NH.new_empty(0))
        ctx.mark_non_differentiable(correct)
        return loss_sum * inv_total_weight, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None


def chunked_lm_head_cross_entropy(
    hidden_NH: torch.Tensor,
    *,
    lm_head_weight: torch.Tensor,
    labels_N: torch.Tensor,
    token_weights_N: torch.Tensor,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE, correct [N] bool) of logits = hidden @ lm_head_weight.T, chunked.

    The loss is sum(w * ce) / sum(w); tokens of weight 0 cost compute but add nothing. The LM
    head weight gets no gradient (it is the target's, frozen).
    """
    if lm_head_weight.requires_grad:
        raise ValueError("the LM head must be frozen (requires_grad=False): it belongs to the target")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedLinearCrossEntropy.apply(
        hidden_NH, lm_head_weight, labels_N, token_weights_N.float(), chunk_size
    )


def default_chunk_size(*, vocab_size: int, budget_bytes: int = 4 << 30) -> int:
    """Rows per chunk so one chunk's fp32 logits (plus their softmax) stay near `budget_bytes`."""
    rows = budget_bytes // (2 * 4 * vocab_size)
    return max(256, 1 << int(math.log2(max(rows, 1))))
