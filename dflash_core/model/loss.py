"""Loss pieces: slot weights (fixed decay or D-PACE), teacher tokens, and a chunked LM-head loss
(cross-entropy against labels, or KL against the target's distribution).

Neither the teacher nor the drafter ever holds [tokens, vocab] logits for all tokens at once:
both walk over row chunks. The drafter's loss computes its input gradient chunk by chunk in the
forward pass (the LM head is the target's, frozen, so that is the only gradient), which keeps
peak memory at one chunk of fp32 logits and costs the same two matmuls per chunk as autograd.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dflash_core.model.lm_head_fp8 import Fp8LMHead


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
    change the teacher (bf16 rounding flips near-tied argmaxes). A head with its own `argmax` (the FP8 head
    of `lm_head_fp8`, which re-scores its top candidates exactly) gives it.
    """
    flat = final_hidden_BTH.reshape(-1, final_hidden_BTH.shape[-1])
    out = torch.empty(index_flat.shape[0], dtype=torch.long, device=flat.device)
    with torch.autocast(flat.device.type, enabled=False):
        for start in range(0, index_flat.shape[0], chunk_size):
            rows = flat.index_select(0, index_flat[start : start + chunk_size])
            normed = final_norm(rows)
            argmax = getattr(lm_head, "argmax", None)
            out[start : start + chunk_size] = argmax(normed) if argmax is not None else lm_head(normed).argmax(dim=-1)
    return out


def dpace_weights(nll_RK: torch.Tensor, valid_RK: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [R, K] (speculators 0.9's DFlash default), no gradient.

    With c_k = (1 - alpha) * exp(-nll_k) + alpha (the drafter's smoothed probability of slot k's
    label; 1 on slots without loss), slot k weighs sum_{j>=k, valid} prod_{i<=j} c_i: the derivative
    of the expected accepted length sum_j prod_{i<=j} c_i with respect to log c_k. Early slots of
    blocks the drafter already gets right weigh most; invalid slots weigh 0.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        valid = valid_RK.to(torch.float32)
        smooth = (1.0 - alpha) * torch.exp(-nll_RK.float()) + alpha
        smooth = torch.where(valid > 0, smooth, torch.ones_like(smooth))
        prefix = torch.cumprod(smooth, dim=-1)
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * valid, dims=[-1]), dim=-1), dims=[-1])
        return suffix * valid


def cross_entropy_terms(logits32, labels, *, smoothing: float = 0.0):
    """Per row of fp32 logits: the loss ((1 - s) * nll + s * mean_v(-log q_v) with label smoothing s),
    the label's NLL, its logit, log Z and correctness. Shared by DFlash's and DFlash 2's per-chunk
    kernels, which torch.compile inlines it into."""
    log_norm = torch.logsumexp(logits32, dim=-1)
    label_logit = logits32.gather(1, labels[:, None]).squeeze(1)
    nll = log_norm - label_logit
    loss = nll if smoothing == 0 else (1.0 - smoothing) * nll + smoothing * (log_norm - logits32.mean(dim=-1))
    correct = logits32.argmax(dim=-1) == labels
    return loss, nll, label_logit, log_norm, correct


def cross_entropy_logit_grad(logits32, log_norm, labels, *, smoothing: float = 0.0):
    """d(loss)/d(logits) of `cross_entropy_terms`' loss: softmax - (1 - s) * onehot - s / V (fp32)."""
    grad = torch.exp(logits32 - log_norm[:, None])
    if smoothing > 0:
        grad = grad - smoothing / logits32.shape[-1]
    return grad.scatter_add_(1, labels[:, None], torch.full_like(log_norm[:, None], smoothing - 1.0))  # fresh: in place


def _ce_rows(logits, labels, *, with_grad: bool):
    """Per row: cross-entropy, the same as the label's NLL, correctness, and d(ce)/d(logits).

    One function so torch.compile can fuse the fp32 upcast, logsumexp, argmax and softmax into a
    couple of passes over the [chunk, vocab] logits (see `compiled_kernels`).
    """
    logits32 = logits.float()
    ce, _, _, log_norm, correct = cross_entropy_terms(logits32, labels)
    if not with_grad:
        return ce, correct, None
    return ce, correct, cross_entropy_logit_grad(logits32, log_norm, labels).to(logits.dtype)


def _smoothed_ce_rows(logits, labels, *, smoothing: float, with_grad: bool):
    """Per row: label-smoothed cross-entropy, the label's NLL, correctness, and d(loss)/d(logits)."""
    logits32 = logits.float()
    loss, nll, _, log_norm, correct = cross_entropy_terms(logits32, labels, smoothing=smoothing)
    if not with_grad:
        return loss, nll, correct, None
    return loss, nll, correct, cross_entropy_logit_grad(logits32, log_norm, labels, smoothing=smoothing).to(logits.dtype)


def _kl_rows(logits, teacher_logits, *, with_grad: bool):
    """Per row: KL(teacher || drafter), the NLL of the teacher's argmax, correctness, the teacher's
    argmax, and d(kl)/d(logits) = softmax(drafter) - softmax(teacher)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    p = torch.exp(log_p)
    kl = (p * (log_p - log_q)).sum(dim=-1)
    labels = teacher_logits.argmax(dim=-1)
    nll = -log_q.gather(1, labels[:, None]).squeeze(1)
    correct = log_q.argmax(dim=-1) == labels
    if not with_grad:
        return kl, nll, correct, labels, None
    return kl, nll, correct, labels, (torch.exp(log_q) - p).to(logits.dtype)


@dataclasses.dataclass(frozen=True)
class LossKernels:
    """The per-chunk loss functions one drafter uses: eager, or torch.compile'd (GPU; shapes are static
    per chunk size), chosen per call: compiling one drafter changes no other."""

    ce: Callable
    smoothed_ce: Callable
    kl: Callable


EAGER_KERNELS = LossKernels(ce=_ce_rows, smoothed_ce=_smoothed_ce_rows, kl=_kl_rows)


@functools.cache
def compiled_kernels() -> LossKernels:
    """The compiled kernels, made once per process (torch.compile is lazy: nothing compiles before a call)."""
    return LossKernels(ce=torch.compile(_ce_rows, dynamic=False),
                       smoothed_ce=torch.compile(_smoothed_ce_rows, dynamic=False),
                       kl=torch.compile(_kl_rows, dynamic=False))


@dataclasses.dataclass
class LMHeadLoss:
    """loss: scalar; per row [N]: correct (argmax == label), labels (the teacher's argmax under
    KL), weights (the slot weight applied, before normalization)."""

    loss: torch.Tensor
    correct: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def head_logits(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, fp8_head: Fp8LMHead | None) -> torch.Tensor:
    """One chunk's logits, hidden @ W.T: in W's dtype, or through the FP8 copy of W when there is one."""
    return fp8_head.logits(hidden_NH) if fp8_head is not None else hidden_NH.to(weight_VH.dtype) @ weight_VH.T


def head_grad_input(grad_NV: torch.Tensor, weight_VH: torch.Tensor, fp8_head: Fp8LMHead | None) -> torch.Tensor:
    """One chunk's input gradient, grad_logits @ W, as `head_logits` computes the logits."""
    return fp8_head.grad_input(grad_NV) if fp8_head is not None else grad_NV @ weight_VH


def check_fp8_head(fp8_head: Fp8LMHead | None, lm_head_weight: torch.Tensor) -> None:
    if fp8_head is not None and (fp8_head.weight.data_ptr() != lm_head_weight.data_ptr()
                                 or fp8_head.weight.shape != lm_head_weight.shape):
        raise ValueError("fp8_head must be the FP8 copy of this lm_head_weight (Fp8LMHead(lm_head_weight))")


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """Per chunk of rows: logits, per-row loss and the per-row gradient d(loss_row)/d(hidden),
    unweighted. Weights are applied once every row's loss is known, which is what lets D-PACE
    weigh a slot by its whole block in the same single pass over the vocabulary."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, teacher_NH, token_weights_N, valid_N, chunk_size,
                dpace_alpha, num_slots, label_smoothing, kernels, fp8_head):
        compute_dtype = weight_VH.dtype
        num_rows = hidden_NH.shape[0]
        device = hidden_NH.device
        loss_rows = torch.empty(num_rows, dtype=torch.float32, device=device)
        separate_nll = teacher_NH is not None or label_smoothing > 0  # D-PACE reads the label's NLL
        nll_rows = torch.empty(num_rows, dtype=torch.float32, device=device) if separate_nll else loss_rows
        correct = torch.empty(num_rows, dtype=torch.bool, device=device)
        labels_out = labels_N.clone() if teacher_NH is None else torch.empty(num_rows, dtype=torch.long, device=device)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden_NH) if needs_grad else None
        chunk_size = even_chunk_size(num_rows, chunk_size)
        for start in range(0, num_rows, chunk_size):
            end = start + chunk_size
            logits = head_logits(hidden_NH[start:end], weight_VH, fp8_head)
            if teacher_NH is None and label_smoothing > 0:
                loss_rows[start:end], nll_rows[start:end], correct[start:end], grad_logits = kernels.smoothed_ce(
                    logits, labels_N[start:end], smoothing=label_smoothing, with_grad=needs_grad)
            elif teacher_NH is None:
                loss_rows[start:end], correct[start:end], grad_logits = kernels.ce(
                    logits, labels_N[start:end], with_grad=needs_grad)
            else:
                with torch.autocast(device.type, enabled=False):
                    teacher_logits = teacher_NH[start:end].to(compute_dtype) @ weight_VH.T
                (loss_rows[start:end], nll_rows[start:end], correct[start:end], labels_out[start:end],
                 grad_logits) = kernels.kl(logits, teacher_logits, with_grad=needs_grad)
            if needs_grad:
                grad_hidden[start:end] = head_grad_input(grad_logits, weight_VH, fp8_head).to(hidden_NH.dtype)
        if dpace_alpha is None:
            weights = token_weights_N * valid_N
            total = weights.sum().clamp_min(1e-12)
        else:  # as speculators: D-PACE weights, normalized by the number of slots with loss
            weights = dpace_weights(nll_rows.view(-1, num_slots), valid_N.view(-1, num_slots),
                                    alpha=dpace_alpha).flatten()
            total = valid_N.sum().clamp_min(1.0)
        scale = weights / total
        if needs_grad:
            grad_hidden.mul_(scale[:, None].to(grad_hidden.dtype))
        ctx.save_for_backward(grad_hidden if needs_grad else hidden_NH.new_empty(0))
        ctx.mark_non_differentiable(correct, labels_out, weights)
        return (scale * loss_rows).sum(), correct, labels_out, weights

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, grad_labels, grad_weights):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype),) + (None,) * 11


def chunked_lm_head_loss(
    hidden_NH: torch.Tensor,
    *,
    lm_head_weight: torch.Tensor,
    valid_N: torch.Tensor,
    labels_N: torch.Tensor | None = None,
    teacher_hidden_NH: torch.Tensor | None = None,
    token_weights_N: torch.Tensor | None = None,
    dpace_alpha: float | None = None,
    num_slots: int | None = None,
    chunk_size: int = 2048,
    label_smoothing: float = 0.0,
    compiled: bool = False,
    fp8_head: Fp8LMHead | None = None,
) -> LMHeadLoss:
    """The drafter's loss over logits = hidden @ lm_head_weight.T, a chunk of rows at a time.

    Target, one of: `labels_N` (cross-entropy) or `teacher_hidden_NH` (KL to the teacher's
    distribution; rows already through the target's final norm, one per drafted slot, so teacher
    logits exist only for the slots' positions and only a chunk at a time).
    Weighting, one of: `token_weights_N` (loss = sum(w * l) / sum(w) over valid rows) or
    `dpace_alpha` with `num_slots` (rows grouped as blocks of num_slots; loss = sum(w * l) /
    num_valid, as speculators). The LM head weight gets no gradient (it is the target's, frozen).
    `label_smoothing` s (cross-entropy only): each row's loss is (1 - s) * CE + s * the mean over the
    vocabulary of -log q; D-PACE still weighs slots by the label's own NLL. `compiled`: the per-chunk
    kernels torch.compile'd (GPU). `fp8_head`: the FP8 copy of the head (`dflash_core.model.lm_head_fp8.Fp8LMHead`), whose
    GEMMs then make the logits and the input gradient; a KL teacher's logits stay in the head's dtype.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("the LM head must be frozen (requires_grad=False): it belongs to the target")
    check_fp8_head(fp8_head, lm_head_weight)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if (labels_N is None) == (teacher_hidden_NH is None):
        raise ValueError("pass exactly one of labels_N (cross-entropy) and teacher_hidden_NH (KL)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if label_smoothing and teacher_hidden_NH is not None:
        raise ValueError("label_smoothing applies to cross-entropy labels, not to the KL loss")
    if (token_weights_N is None) == (dpace_alpha is None):
        raise ValueError("pass exactly one of token_weights_N (fixed weights) and dpace_alpha (D-PACE)")
    num_rows = hidden_NH.shape[0]
    if dpace_alpha is not None and (not num_slots or num_rows % num_slots):
        raise ValueError(f"D-PACE needs num_slots dividing the {num_rows} rows, got {num_slots}")
    valid = valid_N.to(torch.float32)
    weights = token_weights_N.float() if token_weights_N is not None else None
    loss, correct, labels, applied = _ChunkedLMHeadLoss.apply(
        hidden_NH, lm_head_weight, labels_N, teacher_hidden_NH, weights, valid, chunk_size, dpace_alpha, num_slots,
        float(label_smoothing), compiled_kernels() if compiled else EAGER_KERNELS, fp8_head)
    return LMHeadLoss(loss=loss, correct=correct, labels=labels, weights=applied)


def chunked_lm_head_cross_entropy(
    hidden_NH: torch.Tensor,
    *,
    lm_head_weight: torch.Tensor,
    labels_N: torch.Tensor,
    token_weights_N: torch.Tensor,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE, correct [N] bool) of logits = hidden @ lm_head_weight.T, chunked.

    The loss is sum(w * ce) / sum(w); tokens of weight 0 cost compute but add nothing.
    """
    out = chunked_lm_head_loss(hidden_NH, lm_head_weight=lm_head_weight, valid_N=torch.ones_like(labels_N),
                               labels_N=labels_N, token_weights_N=token_weights_N, chunk_size=chunk_size)
    return out.loss, out.correct


def even_chunk_size(num_rows: int, chunk_size: int, *, multiple: int = 16) -> int:
    """Rows per chunk when `num_rows` run in as few chunks of at most `chunk_size` as possible, all of
    about one size (rounded up to `multiple`, never above `chunk_size`): 7,680 rows at 2,048 run as
    4 x 1,920, not 3 x 2,048 + 1,536, so the compiled per-chunk kernels see one shape and no GEMM runs
    a short ragged chunk."""
    if num_rows <= 0:
        return chunk_size
    chunks = -(-num_rows // chunk_size)
    size = -(-num_rows // chunks)
    return min(chunk_size, -(-size // multiple) * multiple)


def default_chunk_size(*, vocab_size: int, budget_bytes: int = 4 << 30) -> int:
    """Rows per chunk so one chunk's fp32 logits (plus their softmax) stay near `budget_bytes`."""
    rows = budget_bytes // (2 * 4 * vocab_size)
    return max(256, 1 << int(math.log2(max(rows, 1))))
